"""Cost of the heartbeat per training step: off vs the default (60 s) vs a beat every 0.1 s, 2 CPU ranks.

``FourDStrategy(heartbeat_timeout=...)`` (default 60 s, see :mod:`lightning_4d.safety.heartbeat`) runs two daemon
threads per rank: one increments this rank's counter in the rendezvous store and reads everyone's every
``timeout / 10`` seconds, one watches that the store answers. The same Llama trains the same data with the
heartbeat off, on with the default and on with ``timeout=1 s`` (a beat every 0.1 s: 100 times the default's
store traffic, to make any cost visible), rotating the order every round so machine noise hits all alike; dp=2.
Printed per round: mean step time and the ratios to "off" (wall and process CPU); then the medians. On a
loaded machine these ratios are mostly noise, so the script also times one beat (the store calls of one
round, in this process) and prints the share of a rank's time it takes at each setting's interval.

Run: python bench/bench_heartbeat.py [--rounds 3 --steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.safety.heartbeat import DEFAULT_TIMEOUT  # noqa: E402
from lightning_4d.models import CausalLM, Llama, LlamaConfig  # noqa: E402
from lightning_4d.testing import run_world  # noqa: E402

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
BATCH, WARMUP = 4, 5
SETTINGS: dict[str, Optional[timedelta]] = {"off": None, "default": DEFAULT_TIMEOUT, "0.1 s beat": timedelta(seconds=1)}


class _StepTimer(L.Callback):
    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append((time.perf_counter(), time.process_time()))


def _fit(steps: int, heartbeat: Optional[timedelta]) -> tuple[float, float]:
    torch.manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (2 * BATCH * steps, CFG.max_seq_len + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    timer = _StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(heartbeat_timeout=heartbeat),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer])
    trainer.fit(CausalLM(Llama(CFG)), data)
    pairs = list(zip(timer.starts, timer.starts[1:]))[WARMUP:]
    return (statistics.fmean(b[0] - a[0] for a, b in pairs), statistics.fmean(b[1] - a[1] for a, b in pairs))


def _world(rank: int, rounds: int, steps: int) -> list[dict[str, tuple[float, float]]]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    names = list(SETTINGS)
    out = []
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        out.append({name: _fit(steps, SETTINGS[name]) for name in order})
    return out


def _beat_cost_s(rounds: int = 500, world: int = 2) -> float:
    """Process CPU seconds of one beat: increment, look for a verdict, check and read every counter."""
    from lightning_4d.testing import free_port

    port = free_port()
    master = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    keys = [f"bench/{r}" for r in range(world)]
    for key in keys:
        master.add(key, 1)
    start = time.process_time()
    for _ in range(rounds):
        client.add(keys[0], 1)
        client.check(["bench/verdict"])
        client.check(keys)
        client.multi_get(keys)
    return (time.process_time() - start) / rounds


def main() -> None:
    t0 = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one run per setting")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    args = parser.parse_args()
    print(f"Llama ({CFG.n_layers} layers, dim {CFG.dim}), dp=2 FSDP2, batch {BATCH}×{CFG.max_seq_len} per rank, "
          f"{args.steps} steps per run, 2 CPU ranks (ms per step; ratio to off)\n", flush=True)
    rounds = run_world(_world, 2, args.rounds, args.steps, timeout_s=3600)[0]
    ratios: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS if name != "off"}
    for i, res in enumerate(rounds):
        off_wall, off_cpu = res["off"]
        cells = [f"off {off_wall * 1e3:.1f} wall {off_cpu * 1e3:.1f} cpu"]
        for name in ratios:
            wall, cpu = res[name]
            ratios[name].append((wall / off_wall, cpu / off_cpu))
            cells.append(f"{name} {wall * 1e3:.1f} ({wall / off_wall:.3f}) wall {cpu * 1e3:.1f} ({cpu / off_cpu:.3f}) cpu")
        print(f"round {i}: " + "; ".join(cells))
    for name, pairs in ratios.items():
        print(f"\nstep time, heartbeat {name} / off (median over rounds): wall "
              f"{statistics.median(p[0] for p in pairs):.3f}, process CPU {statistics.median(p[1] for p in pairs):.3f}")
    beat = _beat_cost_s()
    print(f"\none beat: {beat * 1e6:.0f} µs of process CPU (client and, here, the store's host); share of a rank's "
          f"time: default (every {DEFAULT_TIMEOUT.total_seconds() / 10:.0f} s) "
          f"{beat / (DEFAULT_TIMEOUT.total_seconds() / 10):.1e}, 0.1 s beat {beat / 0.1:.1e}")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
