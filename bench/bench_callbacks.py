"""Cost of the monitors: step time with all four on (default settings) vs off, 2 CPU ranks.

The same MoE transformer (tp = 2 with sequence parallelism, ep = 2 folded onto the TP ranks) trains
the same data with ``CommunicationMonitor``, ``PipelineBubbleMonitor`` (inactive: no pp),
``ExpertLoadMonitor`` and ``FourDThroughputMonitor`` at their defaults (they record every
``trainer.log_every_n_steps`` = 50 batches; heatmaps every 100) and without them, alternating runs so
machine noise hits both alike. Step time is the interval between consecutive batch starts after
warm-up (forward, backward, optimizer, every callback hook, data loading). Printed per round: mean
and median step time off / on and their ratios; then the median over rounds of the ratio of means
(target < 1.03; it includes the recorded steps), the same for the process CPU time per step (robust
to other processes on a shared machine, where wall time is noisy: use several rounds), and the cost
of one *recorded* step (the communication recorder's dispatch mode active, the monitors' gathers and
logging) relative to a plain one.

Run: python bench/bench_callbacks.py [--rounds 4 --steps 100]
"""

from __future__ import annotations

import argparse
import os
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
from lightning_4d.callbacks import (  # noqa: E402
    CommunicationMonitor,
    ExpertLoadMonitor,
    FourDThroughputMonitor,
    PipelineBubbleMonitor,
)
from lightning_4d.models import CausalLM  # noqa: E402
from lightning_4d.models.moe import MoEConfig, MoETransformer  # noqa: E402
from lightning_4d.testing import run_world  # noqa: E402

CFG = MoEConfig(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=384, max_seq_len=128,
                num_experts=4, top_k=2, expert_hidden=192, first_dense_layers=1, aux_loss_coef=0.01)
BATCH, WARMUP = 8, 5


class _StepTimer(L.Callback):
    """Wall and process CPU time of every batch start (put first, so every other hook lies between two starts)."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append((time.perf_counter(), time.process_time()))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.starts.append((time.perf_counter(), time.process_time()))


def _fit(steps: int, monitors: bool, outdir: str) -> dict[str, list[float]]:
    torch.manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH * steps, CFG.max_seq_len + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    timer = _StepTimer()
    callbacks: list[Any] = [timer]
    if monitors:
        callbacks += [CommunicationMonitor(), PipelineBubbleMonitor(), ExpertLoadMonitor(),
                      FourDThroughputMonitor(peak_flops_per_device=1e12)]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(tp=2, ep=2), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
                        default_root_dir=outdir)
    trainer.fit(CausalLM(MoETransformer(CFG)), data)
    steps_ = list(zip(timer.starts, timer.starts[1:]))
    return {"wall": [b[0] - a[0] for a, b in steps_], "cpu": [b[1] - a[1] for a, b in steps_]}


def _world(rank: int, rounds: int, steps: int, outdir: str) -> dict[str, Any]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    off, on = [], []
    for _ in range(rounds):
        off.append(_fit(steps, False, outdir))
        on.append(_fit(steps, True, outdir))
    return {"off": off, "on": on}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="alternating off/on pairs")
    parser.add_argument("--steps", type=int, default=100, help="training steps per run (recorded: every 50th)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_callbacks_") as outdir:
        res = run_world(_world, 2, args.rounds, args.steps, outdir, timeout_s=3600)[0]
    print(f"MoE transformer ({CFG.n_layers} layers, dim {CFG.dim}, {CFG.num_experts} experts), tp=2 + SP, ep=2, "
          f"batch {BATCH}×{CFG.max_seq_len}, {args.steps} steps per run, 2 CPU ranks\n")
    mean_ratios, median_ratios, cpu_ratios = [], [], []
    print(f"{'round':>5}{'off mean':>10}{'on mean':>9}{'ratio':>7}{'off median':>12}{'on median':>11}{'ratio':>7}"
          f"{'off cpu':>9}{'on cpu':>8}{'ratio':>7}  (ms per step)")
    for i, (off_run, on_run) in enumerate(zip(res["off"], res["on"])):
        off, on = off_run["wall"][WARMUP:], on_run["wall"][WARMUP:]
        a, b = statistics.fmean(off), statistics.fmean(on)
        c, d = statistics.median(off), statistics.median(on)
        e, f = statistics.fmean(off_run["cpu"][WARMUP:]), statistics.fmean(on_run["cpu"][WARMUP:])
        mean_ratios.append(b / a)
        median_ratios.append(d / c)
        cpu_ratios.append(f / e)
        print(f"{i:>5}{a * 1e3:>10.1f}{b * 1e3:>9.1f}{b / a:>7.3f}{c * 1e3:>12.1f}{d * 1e3:>11.1f}{d / c:>7.3f}"
              f"{e * 1e3:>9.1f}{f * 1e3:>8.1f}{f / e:>7.3f}")
    print(f"\nstep time, all monitors on / off (median over rounds of the ratio of means): "
          f"wall {statistics.median(mean_ratios):.3f}, process CPU {statistics.median(cpu_ratios):.3f}"
          "  (target < 1.03)")
    # Batches 50, 100, ... are recorded (every 50 from 0); the five before each are plain ones.
    rec = [on["cpu"][k] / statistics.median(on["cpu"][k - 5:k]) for on in res["on"]
           for k in range(50, len(on["cpu"]), 50)]
    if rec:
        cost = statistics.median(rec)
        print(f"one recorded step / a plain step (CPU time): {cost:.2f}, i.e. {(cost - 1) / 50:.1%} per step "
              f"amortised over the default 50-step cadence")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
