"""A fit that a test preempts with a real signal, or whose last rank freezes (run as
``python -m tests.distributed.preempt_script``).

Rank 0 records every training loss in ``--out`` (one JSON number per line). With ``--wait-at S`` it writes
``<root>/ready`` at the start of training batch ``S`` and waits (up to two minutes) until the preemption signal
the test sends has reached this process, so the signal lands during a known step on every launcher: the run
must stop after that step (``preempted-step=S+1``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from lightning_4d.models import CausalLM
from tests.distributed.common import build_model, make_dataset


class _Losses(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps(float(trainer.callback_metrics["train_loss"])) + "\n")


class _WaitForSignal(L.Callback):
    def __init__(self, step: int, root: str) -> None:
        self.step, self.root = step, root

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        saver = trainer.strategy.preemption
        if trainer.global_step != self.step or saver is None or not trainer.is_global_zero:
            return
        with open(os.path.join(self.root, "ready"), "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + 120
        while saver.received is None and time.monotonic() < deadline:
            time.sleep(0.05)


class _FreezeAt(L.Callback):
    """The last rank stops itself (SIGSTOP, as a debugger or a frozen node would) at training batch ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if idx == self.step and trainer.global_rank == trainer.world_size - 1:
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="{}")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--wait-at", type=int, default=-1)
    parser.add_argument("--ckpt-in", default=None)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--freeze-at", type=int, default=-1)
    parser.add_argument("--heartbeat-s", type=float, default=60.0)
    args = parser.parse_args()
    strategy = json.loads(args.layout)
    torch.manual_seed(0)
    lm = CausalLM(build_model("llama-4"), lr=1e-3)
    dp = args.world // (strategy.get("tp", 1) * strategy.get("pp", 1))
    loader = DataLoader(make_dataset(32), batch_size=8 // dp, drop_last=True)
    callbacks: list[Any] = [_Losses(args.out)]
    if args.wait_at >= 0:
        callbacks.append(_WaitForSignal(args.wait_at, args.root))
    if args.freeze_at >= 0:
        callbacks.append(_FreezeAt(args.freeze_at))
    from datetime import timedelta

    trainer = L.Trainer(accelerator="cpu", devices=args.world, strategy=FourDStrategy(**strategy,
                        timeout=timedelta(seconds=600), heartbeat_timeout=timedelta(seconds=args.heartbeat_s)), max_steps=args.max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, num_sanity_val_steps=0, default_root_dir=args.root)
    trainer.fit(lm, loader, ckpt_path=args.ckpt_in)


if __name__ == "__main__":
    main()
