"""Cost of the per-step guards: the non-finite check and the preemption check on vs off, 2 CPU ranks.

``FourDStrategy(nonfinite="raise")`` (default) all-reduces the loss and the global gradient norm's finiteness
before the optimizer step, and the preemption check (default ``preemption_signals``) all-reduces one integer
after it. The same Llama trains the same data with both on and with ``nonfinite="off",
preemption_signals=()``, alternating runs so machine noise hits both alike; dp=2 (FSDP2) so that the extra
collectives cross ranks. Printed per round: mean step time off / on and the ratio (wall and process CPU);
then the median over rounds (target < 1.03).

Run: python bench/bench_guards.py [--rounds 3 --steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
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

CFG = LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=384, max_seq_len=128)
BATCH, WARMUP = 4, 5


class _StepTimer(L.Callback):
    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append((time.perf_counter(), time.process_time()))


def _fit(steps: int, guards: bool) -> dict[str, list[float]]:
    torch.manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (2 * BATCH * steps, CFG.max_seq_len + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    timer = _StepTimer()
    options = {} if guards else dict(nonfinite="off", preemption_signals=())
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(**options), max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[timer])
    trainer.fit(CausalLM(Llama(CFG)), data)
    pairs = list(zip(timer.starts, timer.starts[1:]))
    return {"wall": [b[0] - a[0] for a, b in pairs], "cpu": [b[1] - a[1] for a, b in pairs]}


def _world(rank: int, rounds: int, steps: int) -> dict[str, Any]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    off, on = [], []
    for _ in range(rounds):
        off.append(_fit(steps, False))
        on.append(_fit(steps, True))
    return {"off": off, "on": on}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating off/on pairs")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    args = parser.parse_args()
    t0 = time.perf_counter()
    res = run_world(_world, 2, args.rounds, args.steps, timeout_s=3600)[0]
    print(f"Llama ({CFG.n_layers} layers, dim {CFG.dim}), dp=2 FSDP2, batch {BATCH}×{CFG.max_seq_len} per rank, "
          f"{args.steps} steps per run, 2 CPU ranks\n")
    walls, cpus = [], []
    print(f"{'round':>5}{'off wall':>10}{'on wall':>9}{'ratio':>7}{'off cpu':>9}{'on cpu':>8}{'ratio':>7}  (ms per step)")
    for i, (off_run, on_run) in enumerate(zip(res["off"], res["on"])):
        a, b = (statistics.fmean(r["wall"][WARMUP:]) for r in (off_run, on_run))
        c, d = (statistics.fmean(r["cpu"][WARMUP:]) for r in (off_run, on_run))
        walls.append(b / a)
        cpus.append(d / c)
        print(f"{i:>5}{a * 1e3:>10.1f}{b * 1e3:>9.1f}{b / a:>7.3f}{c * 1e3:>9.1f}{d * 1e3:>8.1f}{d / c:>7.3f}")
    print(f"\nstep time, guards on / off (median over rounds): wall {statistics.median(walls):.3f}, "
          f"process CPU {statistics.median(cpus):.3f}  (target < 1.03)")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
