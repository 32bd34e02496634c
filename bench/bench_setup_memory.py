"""Per-rank host memory at set-up and in training: meta-built (shards only) vs CPU-built (whole model per rank).

The package's Llama (and optionally its MoE) under ``FourDStrategy(tp=2, pp=2)`` × dp 2 on 8 CPU ranks (gloo,
``OMP_NUM_THREADS=1``), a few AdamW steps on synthetic tokens, run twice per model size in fresh worlds:

- ``meta``: the model built on the meta device; the strategy rewrites it on meta, checks the rewrite on a
  reduced copy and allocates / initialises only this rank's shards (``lightning_4d.materialize.local_shards``);
- ``cpu``: the same model built eagerly on the CPU (the old path: whole model on every rank, then sharded).

Each rank takes its baseline (``VmRSS``) just before the model and the Trainer are built, then resets the
kernel's peak-RSS counter (``VmHWM``, via ``/proc/self/clear_refs``; without it ``ru_maxrss`` is used, which
cannot be reset). Printed per rank:

- ``share``: bytes of the rank's local shards (sum of the local tensors of its parameters);
- ``set-up``: peak RSS growth over the baseline up to ``on_fit_start`` (model build, ``strategy.setup``);
- ``step``: peak RSS growth over the baseline during the training steps (peak counter reset at
  ``on_fit_start``; FSDP lazy init, activations, gradients, the optimizer states of the first step);
- ``plan``: the planner's per-rank estimate of the training step for the same run (``planner.memory.memory_per_rank``:
  weights + gradients + optimizer states + gathered FSDP copies + activations + logits, with the CPU device's
  allocator slack), compared with the step peak;
- ``plan set-up``: the planner's set-up term for the same run and path (``RankMemory.setup_total``:
  ``lightning_4d.planner.setup_memory``: share + one chunk of initialisation scratch, or the reduced check when
  larger and within its budget; the whole model when built for real; plus the CPU runtime bytes), compared with the
  set-up peak;
- ``private``: peak growth of the private resident memory (``RssAnon + RssShmem``, sampled every 2 ms) up to
  ``on_fit_start``: ``set-up`` without the file-backed pages (shared libraries' code touched for the first time,
  shared by every rank of a host);
- ``target``: the issue's bound on the set-up peak, ``1.5 · share + largest tensor`` (the largest single
  tensor of the whole model, e.g. the ``32000 × dim`` embedding);
- set-up seconds (model build + Trainer + ``fit`` until ``on_fit_start``).

``--warm-up``: each rank first trains a tiny model of the same kind under the same layout and path, then takes its
baseline, so what every process pays once whatever the model (Lightning's and gloo's set-up, BLAS buffers, sharding
caches: ~40 MB here) is not counted as the model's set-up (``bench_hf_load_memory.py`` always does this).

``--phases`` also prints the peak RSS growth of each set-up phase (the strategy's own steps, timed by wrapping
the functions ``lightning_4d.strategy`` calls) and of each training step's forward + backward and optimizer
step (max over the ranks). ``--pin-mmap-threshold`` fixes glibc's mmap threshold at 128 KiB in every rank:
freed tensors then go back to the OS at once, so the difference to a default run is what glibc's heap keeps
(by default it raises the threshold up to 32 MiB as large blocks are freed, and serves later tensors from a
heap that it rarely returns).

Run: OMP_NUM_THREADS=1 python bench/bench_setup_memory.py [--sizes small,151m,moe] [--paths meta,cpu]
     [--steps 3] [--phases] [--pin-mmap-threshold] [--warm-up] [--json out.json]
(about 5 minutes for the default sizes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from memory_probes import clear_peak, kernel_peak, rss, status_kb  # bench/: on the path when run as a script

SIZES: dict[str, dict[str, Any]] = {
    # ≈35 M parameters (134 MB fp32)
    "small": dict(kind="llama", vocab_size=32000, dim=384, n_layers=6, n_heads=6, ffn_hidden=1024),
    # ≈152 M parameters (579 MB fp32): the model (vocab 32000, dim 768, 12 blocks)
    "151m": dict(kind="llama", vocab_size=32000, dim=768, n_layers=12, n_heads=12, ffn_hidden=2688),
    # ≈55 M parameters (211 MB fp32), every block MoE with 8 experts of hidden 768 (ep=2 inside tp·dp)
    "moe": dict(kind="moe", vocab_size=32000, dim=384, n_layers=4, n_heads=6, ffn_hidden=1024, num_experts=8,
                top_k=2, expert_hidden=768),
}
# warm-up runs (``--warm-up``): the same layout and path on a tiny model of the same kind, first, in each rank
WARM_UP: dict[str, dict[str, Any]] = {
    "llama": dict(kind="llama", vocab_size=256, dim=64, n_layers=4, n_heads=4, ffn_hidden=128),
    "moe": dict(kind="moe", vocab_size=256, dim=64, n_layers=4, n_heads=4, ffn_hidden=128, num_experts=4, top_k=2,
                expert_hidden=64),
}
WORLD, TP, PP = 8, 2, 2
SEQ, GLOBAL_BATCH = 64, 8


# ---------------------------------------------------------------------------------------------- memory probes
def private() -> int:
    """Private resident bytes now: anonymous memory plus shared anonymous mappings (``RssAnon + RssShmem``; the
    initialisation's full tensors are the latter), without the file-backed pages (``RssFile``: code of the
    shared libraries, the same pages for every rank on a host)."""
    return (status_kb("RssAnon") + status_kb("RssShmem")) * 1024


class PrivateSampler:
    """The peak of :func:`private` between ``start`` and ``stop``, sampled every 2 ms by a thread (the kernel keeps
    no peak of it; a full tensor of set-up lives for tens of milliseconds at least)."""

    def __init__(self) -> None:
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, private())

    def start(self) -> "PrivateSampler":
        self.peak = private()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, private())


_RESETTABLE: bool | None = None
_FOLDED = 0  # the largest peak seen before the kernel's counter was last reset by a phase


def reset_peak(fold: bool = False) -> bool:
    """Reset the kernel's peak RSS of this process to its current RSS (Linux ≥ 4.0); False if not allowed.
    ``fold``: a phase boundary inside a measured interval: :func:`peak` still covers the earlier phases."""
    global _RESETTABLE, _FOLDED
    _FOLDED = max(_FOLDED, kernel_peak()) if fold else 0
    if _RESETTABLE is False:
        return False
    _RESETTABLE = clear_peak()
    return _RESETTABLE


def pin_mmap_threshold() -> bool:
    """glibc: serve every allocation of 128 KiB or more with its own ``mmap`` (returned to the OS when freed)
    instead of raising the threshold as freed blocks come back (its default), so resident memory follows the live
    tensors rather than what the heap kept. False where ``mallopt`` is missing (not glibc)."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def peak() -> int:
    """Peak resident bytes since the last :func:`reset_peak` without ``fold`` (``VmHWM``; ``ru_maxrss``, which
    cannot be reset, as a fallback)."""
    return max(_FOLDED, kernel_peak())


def phase_peak() -> int:
    """Peak resident bytes since the last :func:`reset_peak` of any kind."""
    return kernel_peak()


# ---------------------------------------------------------------------------------------------- one rank
def build_model(size: dict[str, Any], seq: int = SEQ) -> Any:
    """The model of ``size`` (built on the current default device)."""
    from lightning_4d.models import Llama, LlamaConfig
    from lightning_4d.models.moe import MoEConfig, MoETransformer

    kw = {k: v for k, v in size.items() if k != "kind"}
    if size["kind"] == "moe":
        return MoETransformer(MoEConfig(max_seq_len=seq, **kw))
    return Llama(LlamaConfig(max_seq_len=seq, **kw))


def local_bytes(module: Any) -> tuple[int, int]:
    """(sum of the local tensor bytes of ``module``'s parameters, the largest local parameter's bytes)."""
    total = largest = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        n = local.numel() * local.element_size()
        total += n
        largest = max(largest, n)
    return total, largest


def full_sizes(size: dict[str, Any]) -> tuple[int, int, int]:
    """(parameters, bytes, largest tensor's bytes) of the whole fp32 model (built on meta: free)."""
    import torch

    with torch.device("meta"):
        model = build_model(size)
    params = list(model.parameters())
    return (sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
            max(p.numel() * p.element_size() for p in params))


def planner_estimate(size: dict[str, Any], ep: int, meta_built: bool = True) -> tuple[list[dict[str, float]], str]:
    """The planner's memory per pp rank for this run (fp32, FSDP, 1F1B, the strategy's default micro-batches),
    with the planner's CPU device constants where it has them (allocator slack, runtime bytes); and a line
    saying which were used. Each row has ``total`` and ``allocated`` (tensors only)."""
    import inspect

    import torch

    from lightning_4d.mesh import ParallelDims
    from lightning_4d.planner.memory import memory_per_rank
    from lightning_4d.planner.spec import TrainSpec, TransformerSpec

    with torch.device("meta"):
        model = build_model(size)
    spec = TransformerSpec.from_model(model, seq_len=SEQ)
    assert spec.total_params() == sum(p.numel() for p in model.parameters()), "planner spec != model"
    dims = ParallelDims.from_world(WORLD, tp=TP, pp=PP, ep=ep)
    train = TrainSpec(global_batch_size=GLOBAL_BATCH, seq_len=SEQ, precision="32-true", flash_attention=True,
                      meta_built=meta_built)
    kwargs: dict[str, float] = {}
    try:
        from lightning_4d.planner import hardware

        cpu = getattr(hardware, "CPU", None)
    except ImportError:
        cpu = None
    accepted = inspect.signature(memory_per_rank).parameters
    for name in ("allocator_overhead", "runtime_bytes"):
        if cpu is not None and name in accepted and hasattr(cpu, name):
            kwargs[name] = float(getattr(cpu, name))
    used = ", ".join(f"{k}={v:g}" for k, v in kwargs.items()) or "no CPU device constants"
    rows = [dict(m.as_dict(), allocated=m.allocated) for m in memory_per_rank(spec, dims, train, **kwargs)]
    return rows, f"planner: memory_per_rank with the CPU device's {used}"


class _Phases:
    """Peak RSS growth (over the baseline) of named phases; wraps functions in ``lightning_4d.strategy``."""

    STRATEGY_CALLS = ("meta_skeleton", "broadcast_module_state", "parallelize_module", "check_reduced_model",
                      "materialize_local_shards")

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.rows: list[tuple[str, float, float, float]] = []  # (phase, peak growth, rss growth after, seconds)
        self._open: tuple[str, float] | None = None

    def start(self, name: str) -> None:
        self.stop()
        reset_peak(fold=True)
        self._open = (name, time.perf_counter())

    def stop(self) -> None:
        if self._open is not None:
            name, t0 = self._open
            self.rows.append((name, phase_peak() - self.baseline, rss() - self.baseline, time.perf_counter() - t0))
            self._open = None

    def wrap(self) -> Callable[[], None]:
        import lightning_4d.strategy as strategy_mod

        saved = {}
        for fname in self.STRATEGY_CALLS:
            fn = getattr(strategy_mod, fname, None)
            if fn is None:
                continue
            saved[fname] = fn

            def wrapped(*a: Any, __fn: Callable = fn, __name: str = fname, **k: Any) -> Any:
                self.start(__name)
                try:
                    return __fn(*a, **k)
                finally:
                    self.start("strategy (other)")

            setattr(strategy_mod, fname, wrapped)

        def restore() -> None:
            for fname, fn in saved.items():
                setattr(strategy_mod, fname, fn)

        return restore


def _rank(rank: int, size_name: str, path: str, steps: int, phases: bool, pin: bool,
          warm_up: bool = False) -> dict[str, Any]:
    import gc

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_4d import FourDStrategy
    from lightning_4d._compat import release_freed_host_memory
    from lightning_4d.models import CausalLM

    size = SIZES[size_name] if size_name in SIZES else WARM_UP[size_name]
    if warm_up:  # imports, process groups, kernels' and sharding caches: resident before the baseline
        _rank(rank, size["kind"], path, 1, False, pin)
    ep = 2 if size["kind"] == "moe" else 1
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size["vocab_size"], (GLOBAL_BATCH * steps, SEQ + 1), generator=gen)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=GLOBAL_BATCH // (WORLD // (TP * PP)))
    out: dict[str, Any] = {"rank": rank}

    class Probe(L.Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            out["setup_s"] = time.perf_counter() - t0
            out["setup_peak"] = peak() - baseline
            out["setup_private"] = sampler.stop() - private_base
            out["rss_after_setup"] = rss() - baseline
            out["share"], out["largest_local"] = local_bytes(pl_module)
            report = getattr(trainer.strategy, "materialize_report", None)
            if report is not None:
                out["largest_call"] = report.largest_call_bytes
            reset_peak()
            out["step_peaks"] = []

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if tracker is not None:
                first = " (FSDP lazy init)" if not out["step_peaks"] else ""
                tracker.start(f"step {len(out['step_peaks']) + 1}: forward + backward{first}")

        def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
            if tracker is not None:
                first = " (+ states, TP replica check)" if not out["step_peaks"] else ""
                tracker.start(f"step {len(out['step_peaks']) + 1}: optimizer step{first}")

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if tracker is not None:
                tracker.stop()
            out["step_peaks"].append(peak() - baseline)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            if tracker is not None:
                tracker.stop()

    out["pinned"] = pin and pin_mmap_threshold()
    torch.manual_seed(0)
    gc.collect()
    release_freed_host_memory()  # what a warm-up freed is returned, not reused unseen by the measured run
    baseline = rss()
    resettable = reset_peak()
    tracker = _Phases(baseline) if phases else None
    restore = tracker.wrap() if tracker is not None else (lambda: None)
    private_base = private()
    sampler = PrivateSampler().start()
    t0 = time.perf_counter()
    if tracker is not None:
        tracker.start("build model")
    if path == "meta":
        with torch.device("meta"):
            model = build_model(size)
    else:
        model = build_model(size)
    if tracker is not None:
        tracker.start("Trainer, Lightning set-up")
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, strategy=FourDStrategy(tp=TP, pp=PP, ep=ep), max_steps=steps,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[Probe()],
        )
        trainer.fit(CausalLM(model, lr=1e-4), train_dataloaders=loader)
    finally:
        restore()
    out["step_peak"] = max(out["step_peaks"])
    out["resettable"] = resettable
    out["baseline"] = baseline
    if tracker is not None:
        out["phases"] = tracker.rows
    return out


# ---------------------------------------------------------------------------------------------- report
def _mb(x: float) -> str:
    return f"{x / 2**20:.0f}"


def run(size_name: str, path: str, steps: int, phases: bool, pin: bool = False,
        warm_up: bool = False) -> list[dict[str, Any]]:
    """Every rank's numbers for one model size and path, in a fresh 8-rank world."""
    from lightning_4d.testing import run_world

    return run_world(_rank, WORLD, size_name, path, steps, phases, pin, warm_up, timeout_s=3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,151m", help=f"comma-separated of {sorted(SIZES)}")
    parser.add_argument("--paths", default="meta,cpu", help="meta (shards only), cpu (built eagerly)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--phases", action="store_true", help="per-phase peaks of every rank")
    parser.add_argument("--pin-mmap-threshold", action="store_true",
                        help="glibc mallopt(M_MMAP_THRESHOLD, 128 KiB) in every rank: freed tensors go back to the OS "
                             "at once, so the numbers show live memory without the heap's retention")
    parser.add_argument("--warm-up", action="store_true",
                        help="each rank first trains a tiny model of the same kind under the same layout and path, so "
                             "the process's one-time costs are in its baseline (as bench_hf_load_memory.py does)")
    parser.add_argument("--json", default=None, help="write every rank's numbers to this file")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    summary: list[dict[str, Any]] = []
    everything: dict[str, Any] = {}
    for size_name in args.sizes.split(","):
        size = SIZES[size_name]
        n_params, full, largest = full_sizes(size)
        for path in args.paths.split(","):
            plan, plan_note = planner_estimate(size, ep=2 if size["kind"] == "moe" else 1, meta_built=path == "meta")
            start = time.perf_counter()
            ranks = run(size_name, path, args.steps, args.phases, args.pin_mmap_threshold, args.warm_up)
            wall = time.perf_counter() - start
            everything[f"{size_name}/{path}"] = {"ranks": ranks, "planner": plan, "params": n_params, "full": full,
                                                "largest": largest}
            print(f"\n== {size_name}: {n_params / 1e6:.1f} M parameters, {_mb(full)} MB fp32, largest tensor "
                  f"{_mb(largest)} MB; path {path}; tp={TP} pp={PP} dp={WORLD // (TP * PP)} on {WORLD} ranks "
                  f"({wall:.0f} s wall)")
            print(f"   {plan_note}; 'tensors' is its live-tensor part alone")
            if args.warm_up:
                print("   (warmed up: baseline taken after a tiny model's run of the same layout and path)")
            if ranks[0]["pinned"]:
                print("   (glibc mmap threshold pinned at 128 KiB: no heap retention of freed tensors)")
            if not ranks[0]["resettable"]:
                print("   (peak counter not resettable here: ru_maxrss / VmHWM since the process started)")
            print(f"{'rank':>4} {'share':>6} {'set-up':>7} {'private':>7} {'/share':>7} {'target':>7} {'ok':>3} {'after':>6} "
                  f"{'step':>6} {'plan':>6} {'tensors':>7} {'step/plan':>9} {'plan s-u':>8} {'s-u/plan':>8} "
                  f"{'init call':>9} {'set-up s':>8}   (MB)")
            for r in ranks:
                pp_rank = r["rank"] // (WORLD // PP)
                est, tensors = plan[pp_rank]["total"], plan[pp_rank]["allocated"]
                plan_setup = plan[pp_rank]["setup_total"]
                target = 1.5 * r["share"] + largest
                r.update(plan=est, plan_tensors=tensors, plan_setup=plan_setup, target=target, pp_rank=pp_rank)
                print(f"{r['rank']:>4} {_mb(r['share']):>6} {_mb(r['setup_peak']):>7} {_mb(r['setup_private']):>7} "
                      f"{r['setup_peak'] / r['share']:>7.1f} {_mb(target):>7} "
                      f"{'yes' if r['setup_peak'] <= target else 'NO':>3} {_mb(r['rss_after_setup']):>6} "
                      f"{_mb(r['step_peak']):>6} {_mb(est):>6} {_mb(tensors):>7} {r['step_peak'] / est:>9.2f} "
                      f"{_mb(plan_setup):>8} {r['setup_peak'] / plan_setup:>8.2f} "
                      f"{_mb(r['largest_call']) if 'largest_call' in r else '-':>9} {r['setup_s']:>8.1f}")
            if args.phases:
                names = [p[0] for p in ranks[0]["phases"]]
                print("   phase peaks (growth over baseline, MB; max over ranks) / RSS after / seconds (rank 0):")
                for i, name in enumerate(names):
                    rows = [r["phases"][i] for r in ranks if i < len(r["phases"])]
                    print(f"   {name:<48} peak {_mb(max(x[1] for x in rows)):>6}  rss {_mb(max(x[2] for x in rows)):>6}"
                          f"  {ranks[0]['phases'][i][3]:>6.1f} s")
            worst = max(ranks, key=lambda r: r["setup_peak"] / r["target"])
            summary.append(dict(
                size=size_name, params=n_params, full=full, largest=largest,
                path=path + (" (mmap threshold pinned)" if ranks[0]["pinned"] else "")
                + (" (warmed up)" if args.warm_up else ""),
                share=max(r["share"] for r in ranks), setup=max(r["setup_peak"] for r in ranks),
                setup_share=max(r["setup_peak"] / r["share"] for r in ranks),
                setup_target=worst["setup_peak"] / worst["target"],
                step=max(r["step_peak"] for r in ranks), plan=max(r["plan"] for r in ranks),
                plan_tensors=max(r["plan_tensors"] for r in ranks),
                step_plan=[f(r["step_peak"] / r["plan"] for r in ranks) for f in (min, max)],
                plan_setup=max(r["plan_setup"] for r in ranks),
                setup_plan=[f(r["setup_peak"] / r["plan_setup"] for r in ranks) for f in (min, max)],
                setup_s=max(r["setup_s"] for r in ranks),
                private=max(r["setup_private"] for r in ranks),
                private_target=max(r["setup_private"] / r["target"] for r in ranks),
            ))

    print("\n## Summary (max over the 8 ranks; MB = 2^20 bytes; growth over each rank's baseline)\n")
    print("| model | path | share | set-up peak | set-up / share | set-up / (1.5·share + largest) | step peak "
          "| planner (step) | planner, tensors only | step / planner (min–max over ranks) | planner (set-up) "
          "| set-up / planner | set-up s | set-up private | private / (1.5·share + largest) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['size']} ({s['params'] / 1e6:.0f} M, largest {_mb(s['largest'])}) | {s['path']} "
              f"| {_mb(s['share'])} "
              f"| {_mb(s['setup'])} | {s['setup_share']:.1f}× | {s['setup_target']:.2f} | {_mb(s['step'])} "
              f"| {_mb(s['plan'])} | {_mb(s['plan_tensors'])} | {s['step_plan'][0]:.2f}–{s['step_plan'][1]:.2f} "
              f"| {_mb(s['plan_setup'])} | {s['setup_plan'][0]:.2f}–{s['setup_plan'][1]:.2f} | {s['setup_s']:.1f} "
              f"| {_mb(s['private'])} | {s['private_target']:.2f} |")
    by = {(s["size"], s["path"].split()[0]): s for s in summary}
    for size_name in args.sizes.split(","):
        if (size_name, "meta") in by and (size_name, "cpu") in by:
            m, c = by[(size_name, "meta")], by[(size_name, "cpu")]
            print(f"\n{size_name}: set-up peak cpu / meta = {c['setup'] / m['setup']:.1f}×, "
                  f"set-up seconds cpu / meta = {c['setup_s'] / m['setup_s']:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(everything, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
