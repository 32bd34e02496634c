"""The planner's CPU device against real CPU runs on this machine: per-rank peak resident memory and step time.

Each CPU row of ``lightning_4d/planner/calibration/cpu_measured.json`` is a training recipe (``recipes/train.py``
overrides). ``--measure ID ...`` trains it for a few steps (synthetic or stdlib data, models built on the meta
device, no validation, checkpoints or loggers) with a callback that records, on every rank: its resident memory
before the model is built (the process baseline: interpreter, torch, Lightning, gloo), its peak resident memory
during training (``VmHWM`` reset when training starts, so the set-up peak is not in it), and the wall-clock and
CPU seconds of every step. The step time compared with the planner is the CPU-bound one — the CPU seconds all
ranks spent per step over the cores they share — because the machine is shared: other jobs stretch the wall-clock
step (stored too, with the load average) but not the run's own CPU seconds. ``--write`` stores the measurement in the JSON (with the machine's CPU count and load).
Without ``--measure`` it prints the table: the planner's per-rank memory and step time for the same recipe
(``python recipes/plan.py trainer=cpu <overrides> plan.device=cpu plan.trace=false``) against the stored
measurement. ``--constants`` runs the micro-benchmarks behind ``lightning_4d.planner.hardware.CPU``.

Examples:
    python bench/calibrate_planner_cpu.py --constants
    OMP_NUM_THREADS=1 python bench/calibrate_planner_cpu.py --measure default-recipe --write
    python bench/calibrate_planner_cpu.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

MEASURE = ["trainer=cpu", "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "callbacks.checkpoint=false",
           "callbacks.progress_bar=false", "logger.csv=false", "meta_init=true",
           "check_resources=false"]
WARMUP = 2  # steps left out of the step-time median (allocator and autograd warm-up)


def _status(key: str) -> int:
    """A ``/proc/self/status`` size in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _probe(out: str) -> Any:
    """The Lightning callback that records one rank's memory and step times into ``out/rank<r>.json``."""
    import lightning as L

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.base = self.start = 0
            self.wall: list[float] = []
            self.cpu: list[float] = []

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.base = _status("VmRSS")  # before configure_model / the strategy's set-up

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.start = _status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the training peak only

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            rank = trainer.global_rank
            record = {"rank": rank, "baseline_rss": self.base, "start_rss": self.start, "peak_rss": _status("VmHWM"),
                      "wall": self.wall, "cpu": self.cpu, "loadavg": os.getloadavg()}
            Path(out).mkdir(parents=True, exist_ok=True)
            Path(out, f"rank{rank}.json").write_text(json.dumps(record))

    return Probe()


def _rows() -> dict[str, Any]:
    from lightning_4d.recipes.calibration import load_cpu_rows

    return {r["id"]: r for r in load_cpu_rows()["rows"]}


def measure(row_id: str, out: Path) -> None:
    """Train the row's recipe with the probe (Lightning's launcher re-runs this script for the other ranks)."""
    from hydra import compose, initialize_config_dir

    from lightning_4d.recipes import conf_dir, register_configs, run

    row = _rows()[row_id]
    register_configs()
    with initialize_config_dir(str(conf_dir()), version_base=None):
        cfg = compose("train", [*row["overrides"], *MEASURE, f"trainer.max_steps={row['steps']}",
                                f"output_dir={out / 'run'}"])
    run(cfg, callbacks=[_probe(str(out / "ranks"))])


def summarize(directory: Path) -> dict[str, Any]:
    """Per-run figures from the ranks' records: the largest per-rank peak growth over the baseline, the median
    step (wall and CPU seconds, after the warm-up steps) and the machine's load."""
    ranks = [json.loads(p.read_text()) for p in sorted(directory.glob("rank*.json"))]
    def steps(xs: list[float]) -> list[float]:
        return [b - a for a, b in zip(xs, xs[1:])][WARMUP:]
    wall = statistics.median(statistics.median(steps(r["wall"])) for r in ranks)
    cpu = [statistics.median(steps(r["cpu"])) for r in ranks]
    cores = min(os.cpu_count() or 1, len(ranks))
    return {"ranks": len(ranks), "cpu_count": os.cpu_count(), "cpu_bound_step_s": sum(cpu) / cores,
            "peak_growth_bytes": max(r["peak_rss"] - r["baseline_rss"] for r in ranks),
            "baseline_rss_bytes": max(r["baseline_rss"] for r in ranks),
            "step_s": wall, "cpu_s_per_rank": cpu, "cpu_s_total": sum(cpu),
            "loadavg_1min": max(r["loadavg"][0] for r in ranks), "steps_timed": len(steps(ranks[0]["wall"]))}


def constants() -> dict[str, float]:
    """Micro-benchmarks of one core: fp32 GEMM at the shapes of the CPU rows, elementwise bandwidth on
    activation-sized tensors, the package's Llama block at negligible width (framework time per block)."""
    import torch

    torch.set_num_threads(1)

    def best(f: Any, n: int, r: int = 3) -> float:
        """CPU seconds of one call (process time: a loaded machine stretches wall-clock time, not this)."""
        f()
        out = []
        for _ in range(r):
            t = time.process_time()
            for _ in range(n):
                f()
            out.append((time.process_time() - t) / n)
        return min(out)

    res: dict[str, float] = {}
    rates = []
    for m, n, k in ((512, 512, 512), (512, 1536, 512), (512, 256, 512), (256, 384, 128), (1024, 1024, 1024)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        t = best(lambda: a @ b, n=max(2, int(1e8 / (2 * m * n * k))))
        rates.append(2 * m * n * k / t)
        res[f"gemm_{m}x{n}x{k}_gflops"] = 2 * m * n * k / t / 1e9
    res["gemm_median_gflops"] = statistics.median(rates) / 1e9
    x, y = torch.randn(2**20), torch.randn(2**20)
    res["elementwise_4MB_gb_s"] = 3 * 4 * 2**20 / best(lambda: x * y, n=50) / 1e9
    from lightning_4d.models import Llama, LlamaConfig

    for layers in (1, 5):
        cfg = LlamaConfig(vocab_size=16, dim=16, n_layers=layers, n_heads=2, n_kv_heads=2, ffn_hidden=16, max_seq_len=8)
        model, tokens = Llama(cfg), torch.randint(0, 16, (1, 8))
        res[f"llama_{layers}_blocks_step_ms"] = best(lambda: model(tokens).sum().backward(), n=50) * 1e3
    res["block_overhead_ms"] = (res["llama_5_blocks_step_ms"] - res["llama_1_blocks_step_ms"]) / 4
    import torch.nn.functional as F

    q, k, v = torch.randn(2, 8, 256, 64), torch.randn(2, 4, 256, 64), torch.randn(2, 4, 256, 64)
    t = best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), n=10)
    res["sdpa_causal_gflops"] = 4 * 2 * 8 * 256 * 256 * 64 * 0.5 / t / 1e9
    a, b = torch.randn(2 * 256, 64), torch.randn(64, 256)
    res["gemm_attention_shape_gflops"] = 2 * 512 * 256 * 64 / best(lambda: a @ b, n=200) / 1e9
    res.update(_gloo())
    res.update(_memory())
    return res


def _memory() -> dict[str, float]:
    """Resident memory of a training loop in this process: what a negligible-width model adds (the runtime's own
    bytes) and how far the resident peak runs above the peak of live allocations (malloc's ``mallinfo2``) for the
    package's Llama at the width of the CPU rows (the allocator's slack)."""
    import ctypes

    import torch

    from lightning_4d.models import Llama, LlamaConfig

    libc = ctypes.CDLL("libc.so.6")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2

    def live() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def train(dim: int, layers: int, seq: int, batch: int, steps: int) -> tuple[int, int]:
        Path("/proc/self/clear_refs").write_text("5")
        rss0, live0, top = _status("VmRSS"), live(), 0
        cfg = LlamaConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=8 if dim >= 64 else 2,
                          n_kv_heads=4 if dim >= 64 else 2, ffn_hidden=3 * dim, max_seq_len=seq)
        model = Llama(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, 256, (batch, seq))
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            top = max(top, live() - live0)
            loss.backward()
            top = max(top, live() - live0)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            top = max(top, live() - live0)
        grown = _status("VmHWM") - rss0
        del model, opt
        return grown, top

    small_rss, _ = train(16, 1, 8, 1, 5)
    wide_rss, wide_live = train(512, 4, 256, 4, 3)
    return {"runtime_mib": small_rss / 2**20, "wide_rss_growth_mib": wide_rss / 2**20,
            "wide_live_peak_mib": wide_live / 2**20, "allocator_slack": wide_rss / wide_live - 1}


def _gloo_worker(rank: int, path: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    big, small = torch.randn(2**20), torch.randn(1)
    outs = [torch.empty_like(big) for _ in range(2)]
    for _ in range(3):
        dist.all_gather(outs, big)
    t = time.process_time()
    for _ in range(20):
        dist.all_gather(outs, big)
    big_s = (time.process_time() - t) / 20
    t = time.process_time()
    for _ in range(200):
        dist.all_reduce(small)
    small_s = (time.process_time() - t) / 200
    out.put((rank, big_s, small_s))
    dist.destroy_process_group()


def _gloo() -> dict[str, float]:
    """CPU seconds a gloo rank spends per byte sent (all-gather of 4 MB between two ranks) and per call."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_gloo_worker, args=(r, f"{tmp}/store", out)) for r in range(2)]
        for p in procs:
            p.start()
        got = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
    big = max(g[1] for g in got)
    return {"gloo_cpu_gb_s": 4 * 2**20 / big / 1e9, "gloo_cpu_us_per_call": max(g[2] for g in got) * 1e6}


#: The negligible-width rows the host costs are derived from (``--derive``); the other rows validate them.
CALIBRATION_ROWS = ("o-plain", "o-fsdp8", "o-4d-dense", "o-4d-moe", "o-pp2-dp4", "o-tp2-dp4", "o-fsdp8-bytes")


def derive() -> dict[str, Any]:
    """The CPU family's host costs from the calibration rows' measured CPU seconds (at negligible width nearly all
    of a rank's CPU time is the framework's): per optimizer step (``o-plain``, one rank, no collective), per
    collective call (the median over the distributed negligible-width rows) and per byte a rank sends
    (``o-fsdp8-bytes``: FSDP of a 94M-parameter model on 16-token micro-batches). Each rank's planned compute
    (GEMMs, attention, memory-bound kernels, the block overhead of the micro-benchmark) is taken off first."""
    from lightning_4d.planner.comm import comm_per_rank
    from lightning_4d.planner.compute import optimizer_seconds, rank_compute_time
    from lightning_4d.planner.memory import micro_batch_size, resolve_microbatches, stage_layout
    from lightning_4d.planner.roofline import _held_params
    from lightning_4d.recipes.calibration import CPU_PLAN, compose_plan
    from lightning_4d.recipes.planning import plan_setup

    rows = _rows()

    def per_rank(row_id: str) -> list[tuple[float, float, float, float, float]]:
        """(measured CPU s, planned compute + optimizer s, data-parallel calls, other calls, bytes sent) per rank."""
        row = rows[row_id]
        setup = plan_setup(compose_plan(["trainer=cpu", *row["overrides"], *CPU_PLAN]))
        spec, dims, train = setup.spec, setup.dims, setup.train
        dev = setup.cluster.device.with_(step_overhead=0.0)
        layout = stage_layout(spec, dims, train.schedule)
        records = comm_per_rank(spec, dims, train, layout)
        b, m = micro_batch_size(dims, train), resolve_microbatches(dims, train)
        out = []
        for rank, cpu in enumerate(row["measured"]["cpu_s_per_rank"]):
            r = rank // (dims.dp * dims.tp)
            last = r == (dims.pp - 1)
            own = rank_compute_time(spec, dims, train, dev, layout[r], last, b, m).total
            own += optimizer_seconds(_held_params(spec, dims, train, layout[r], r == 0, last), dev)
            dp = sum(x.calls for x in records[r] if x.axis in ("dp", "edp", "dp_shard", "dp_replicate"))
            other = sum(x.calls for x in records[r]) - dp
            out.append((cpu, own, dp, other, sum(x.bytes_sent for x in records[r])))
        return out

    (cpu, own, _, _, _), = per_rank("o-plain")
    step = cpu - own
    import numpy as np

    eqs = [(dp, other, cpu - own - step) for row_id in CALIBRATION_ROWS[1:-1]
           for cpu, own, dp, other, _ in per_rank(row_id)]
    a = np.array([[dp, other] for dp, other, _ in eqs])
    y = np.array([rest for _, _, rest in eqs])
    (dp_call, call), *_ = np.linalg.lstsq(a, y, rcond=None)
    per_byte = [(cpu - own - step - dp * dp_call - other * call) / sent
                for cpu, own, dp, other, sent in per_rank("o-fsdp8-bytes")]
    byte = statistics.median(per_byte)
    residual = [float(r) for r in (a @ np.array([dp_call, call]) - y) / np.maximum(y, 1e-9)]
    # Runtime memory: what the negligible-width rows grow besides their (planned, slack-inflated) tensors.
    from lightning_4d.recipes.calibration import plan_overrides

    runtime = []
    for row_id in CALIBRATION_ROWS[:-1]:
        _, plan = plan_overrides(["trainer=cpu", *rows[row_id]["overrides"], *CPU_PLAN])
        tensors = max(r["total"] - r["runtime"] for r in plan["memory"]["per_role"])
        runtime.append(rows[row_id]["measured"]["peak_growth_bytes"] - tensors)
    return {"step_overhead_ms": step * 1e3, "dp_call_ms": float(dp_call) * 1e3, "call_ms": float(call) * 1e3,
            "fit_residual_range": [min(residual), max(residual)], "bytes_gb_per_cpu_s": 1 / byte / 1e9,
            "runtime_mib": statistics.median(runtime) / 2**20}


def table() -> str:
    """The CPU table (planner / measured), from the stored measurements and the recipe path."""
    from lightning_4d.recipes.calibration import cpu_rows, format_cpu_markdown

    return format_cpu_markdown(cpu_rows())


def main(argv: Optional[list[str]] = None) -> int:
    """Measure rows (``--measure``), print the micro-benchmarks (``--constants``) or the table (default)."""
    import subprocess

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure", nargs="*", default=None, help="row ids to train and measure (none: all)")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one row's training (what --measure starts)
    ap.add_argument("--write", action="store_true", help="store the measurements in cpu_measured.json")
    ap.add_argument("--out", default="outputs/calibrate_cpu", help="where the runs write their records")
    ap.add_argument("--constants", action="store_true", help="run the CPU micro-benchmarks")
    ap.add_argument("--derive", action="store_true", help="derive the host costs from the calibration rows")
    args = ap.parse_args(argv)
    if args.derive:
        print(json.dumps(derive(), indent=1))
        return 0
    if args.constants:
        print(json.dumps(constants(), indent=1))
        return 0
    if args.run is not None:  # every rank of one row's world runs this (Lightning's launcher re-runs the script)
        measure(args.run, Path(args.out) / args.run)
        return 0
    if args.measure is None:
        print(table())
        return 0
    results = {}
    for row_id in args.measure or list(_rows()):
        out = Path(args.out) / row_id
        for old in (out / "ranks").glob("rank*.json"):
            old.unlink()
        subprocess.run([sys.executable, __file__, "--run", row_id, "--out", args.out], check=True)
        results[row_id] = summarize(out / "ranks")
        print(row_id, json.dumps(results[row_id]), flush=True)
    if args.write:
        from lightning_4d.recipes.calibration import store_cpu_measurements

        store_cpu_measurements(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
