"""Seconds training is blocked per checkpoint save: ``FourDStrategy(async_checkpoint=True)`` over the synchronous
save, on 4 CPU ranks (gloo).

A 160 M-parameter Llama (vocab 32000, dim 1024, 8 layers, ffn 2816; built on the meta device, so each rank
materialises only its shards) trains under FSDP2 (dp=4) with AdamW; ``ModelCheckpoint`` saves every ``--every``
steps (``save_top_k=1``: the older checkpoint is removed, after the new one is complete). Both modes run in the same
world, one after the other (``--rounds`` pairs, alternating order), with the same steps and saves. Blocked time of a
save: the wall time of ``trainer.save_checkpoint`` on the slowest rank (Lightning's state dicts, the wait for a
previous save still in flight, then the whole save, or only the staging copy for async), every save counted. The
async run also prints the wait at the end of fit for its last save (not counted: training is over), and per rank
the bytes of its staging buffers (the staged copy, kept for the next save) against its share of the parameters and
AdamW state, and its resident-memory growth across the first save (lower where freed memory is reused). Target:
async / sync <= 0.25.

Run: OMP_NUM_THREADS=1 python bench/bench_async_checkpoint.py [--rounds 1 --saves 3 --every 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.models import CausalLM, Llama, LlamaConfig  # noqa: E402
from lightning_4d.testing import run_world  # noqa: E402

WORLD = 4
CFG = LlamaConfig(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn_hidden=2816, max_seq_len=32)
BATCH = 1  # per rank: the step is short, so the saves dominate what the bench sees
MODES = ("sync", "async")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Timed(L.Callback):
    """The wall time of every ``trainer.save_checkpoint``, this rank's host memory across the first, the step times,
    and the end-of-fit wait for the last background save."""

    def __init__(self) -> None:
        self.blocked: list[float] = []
        self.rss_growth = 0
        self.steps: list[float] = []
        self.drain = 0.0
        self.share = 0
        self.staged = 0

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        real = trainer.save_checkpoint

        def timed(*args: Any, **kwargs: Any) -> None:
            if not self.blocked:
                self.share = _share(trainer.optimizers[0])
            before, start = _rss(), time.perf_counter()
            real(*args, **kwargs)
            self.blocked.append(time.perf_counter() - start)
            if len(self.blocked) == 1:
                self.rss_growth = _rss() - before
                saver = getattr(trainer.strategy, "_saver", None)
                self.staged = saver.staged_bytes if saver is not None else 0

        trainer.save_checkpoint = timed  # type: ignore[method-assign]
        saver = getattr(trainer.strategy, "_saver", None)
        if saver is not None:
            close = saver.close

            def timed_close() -> Any:
                start = time.perf_counter()
                out = close()
                self.drain = time.perf_counter() - start
                return out

            saver.close = timed_close

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(time.perf_counter())


def _share(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's shards of the parameters and of their optimizer state."""
    from lightning_4d.core.distributed import local_of

    params = [p for group in optimizer.param_groups for p in group["params"]]
    tensors = params + [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return sum(local_of(t).numel() * t.element_size() for t in tensors)


def _fit(mode: str, saves: int, every: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    steps = saves * every
    tokens = torch.randint(0, CFG.vocab_size, (WORLD * BATCH * steps, CFG.max_seq_len + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    timer = _Timed()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{root}/{mode}", every_n_train_steps=every,
                                                      save_top_k=1, filename="{step}")
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=FourDStrategy(async_checkpoint=mode == "async"),
                        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[timer, checkpoints])
    with torch.device("meta"):
        model = Llama(CFG)
    trainer.fit(CausalLM(model, lr=1e-4), data)
    gaps = [b - a for a, b in zip(timer.steps, timer.steps[1:])]
    return {"blocked": timer.blocked, "rss_growth": timer.rss_growth, "share": timer.share, "drain": timer.drain,
            "staged": timer.staged,
            "step": statistics.median(gaps) if gaps else 0.0}


def _world(rank: int, rounds: int, saves: int, every: int, root: str) -> list[dict[str, Any]]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    out = []
    for i in range(rounds):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            out.append({"mode": mode, **_fit(mode, saves, every, root)})
            import torch.distributed as dist

            dist.barrier()
            if rank == 0:
                shutil.rmtree(f"{root}/{mode}", ignore_errors=True)
    return out


def report(results: list[list[dict[str, Any]]], saves: int, every: int) -> tuple[list[str], list[str]]:
    """(printed lines, the markdown page) of the ranks' results."""
    head = (f"Llama {_parameters() / 1e6:.0f} M parameters (vocab {CFG.vocab_size}, dim {CFG.dim}, {CFG.n_layers} "
            f"layers), AdamW, FSDP2 dp={WORLD}, {WORLD} CPU ranks (gloo), batch {BATCH}×{CFG.max_seq_len} per rank; "
            f"{saves} saves per run, one every {every} steps")
    lines, saves_md, ranks_md = [head, ""], [], []
    blocked: dict[str, list[float]] = {m: [] for m in MODES}
    drains, steps = [], {m: [] for m in MODES}
    for run in range(len(results[0])):
        runs = [r[run] for r in results]
        mode = runs[0]["mode"]
        per_save = [max(r["blocked"][i] for r in runs) for i in range(len(runs[0]["blocked"]))]
        blocked[mode].extend(per_save)
        steps[mode].append(max(r["step"] for r in runs))
        saves_md += [f"| {run + 1} | {mode} | {i + 1} | {s:.2f} |" for i, s in enumerate(per_save)]
        line = f"{mode:>5}: blocked per save (slowest rank) {', '.join(f'{s:.2f}' for s in per_save)} s; " \
               f"step {steps[mode][-1]:.2f} s"
        if mode == "async":
            drains.append(max(r["drain"] for r in runs))
            line += f"; end-of-fit wait for the last save {drains[-1]:.2f} s"
        lines.append(line)
        if mode == "async":
            for rank, r in enumerate(runs):
                lines.append(f"       rank {rank}: staging buffers {r['staged'] / 2**20:.0f} MiB = "
                             f"{r['staged'] / r['share']:.3f} × its share of parameters + AdamW state "
                             f"({r['share'] / 2**20:.0f} MiB); resident memory +{r['rss_growth'] / 2**20:.0f} MiB "
                             f"across the first save")
                ranks_md.append(f"| {run + 1} | {rank} | {r['staged'] / 2**20:.1f} | {r['share'] / 2**20:.1f} | "
                                f"{r['staged'] / r['share']:.3f} | {r['rss_growth'] / 2**20:.0f} |")
    sync, async_ = statistics.fmean(blocked["sync"]), statistics.fmean(blocked["async"])
    summary = (f"mean blocked per save: sync {sync:.2f} s, async {async_:.2f} s; async / sync = {async_ / sync:.3f} "
               f"(target <= 0.25)")
    lines += ["", summary]
    page = [
        "# Asynchronous checkpoints: measurements", "",
        "Generated by `python bench/bench_async_checkpoint.py --markdown docs/checkpoint_measurements.md` (what is "
        "measured: the script's docstring); `tests/unit/test_checkpoint_measurements.py` recomputes the summary from "
        "the tables and checks what the README quotes.", "",
        f"{head}. Median step time: sync {statistics.median(steps['sync']):.1f} s, async "
        f"{statistics.median(steps['async']):.1f} s ({os.cpu_count()} CPU cores, shared with other work); wait at "
        f"the end of fit for the last async save: {max(drains):.1f} s.", "",
        "Seconds training is blocked per save (`trainer.save_checkpoint`, the slowest rank):", "",
        "| run | mode | save | blocked s |", "|---:|---|---:|---:|", *saves_md, "",
        "Host memory of the staging buffers (async), per rank:", "",
        "| run | rank | staging MiB | share of parameters + AdamW state MiB | staging / share | resident growth MiB |",
        "|---:|---:|---:|---:|---:|---:|", *ranks_md, "",
        f"**{summary}**", "",
    ]
    return lines, page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="sync/async pairs (alternating order)")
    parser.add_argument("--saves", type=int, default=3, help="saves per run")
    parser.add_argument("--every", type=int, default=2, help="training steps between saves")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix="bench_async_ckpt_")
    results = run_world(_world, WORLD, args.rounds, args.saves, args.every, root, timeout_s=7200, pg_timeout_s=1800)
    lines, page = report(results, args.saves, args.every)
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(page))
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)


def _parameters() -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(CFG).parameters())


if __name__ == "__main__":
    main()
