"""With default settings a frozen rank ends the run within two minutes: every other rank prints a line naming it
and exits with code 1, and the frozen rank (on this host) is ended too, instead of all of them waiting for the
process-group timeout (10 minutes here, 30 by default).

Two ways to freeze: ``SIGSTOP`` (a debugger, a frozen node; 3 ranks, so two survivors must agree) and a
deadlock holding the GIL (a C call made through ``ctypes.PyDLL``, which keeps the GIL; 2 ranks).
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L

from lightning_4d.safety.heartbeat import DEFAULT_TIMEOUT, worst_case_s
from lightning_4d.testing import run_world

PG_TIMEOUT_S = 600.0  # only the heartbeat can end the run well before this


class _FreezeAt(L.Callback):
    """The last rank records when and who it is, then freezes at training batch ``step``."""

    def __init__(self, step: int, how: str, root: str) -> None:
        self.step, self.how, self.root = step, how, root

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if idx != self.step or trainer.global_rank != trainer.world_size - 1:
            return
        with open(os.path.join(self.root, "frozen.json"), "w") as f:
            json.dump({"pid": os.getpid(), "time": time.time()}, f)
        if self.how == "sigstop":
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            import ctypes

            ctypes.PyDLL(None).sleep(int(PG_TIMEOUT_S))  # libc sleep() with the GIL held: no thread runs


def _train_and_freeze(rank: int, how: str, root: str) -> str:
    from datetime import timedelta

    import torch
    from torch.utils.data import DataLoader

    from lightning_4d import FourDStrategy
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model, make_dataset

    err = os.open(os.path.join(root, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(err, 2)  # the heartbeat's line goes to stderr
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=100, logger=False,
                        strategy=FourDStrategy(timeout=timedelta(seconds=PG_TIMEOUT_S)),  # heartbeat: the default
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[_FreezeAt(2, how, root)])
    trainer.fit(CausalLM(build_model("llama"), lr=1e-3), DataLoader(make_dataset(64), batch_size=2))
    return "finished"


def _freeze_world(how: str, world: int, root: Path) -> tuple[list[Any], float]:
    results = run_world(_train_and_freeze, world, how, str(root), raise_on_error=False, pg_timeout_s=PG_TIMEOUT_S,
                        timeout_s=PG_TIMEOUT_S)
    return results, time.time()


def test_a_frozen_rank_ends_the_run_within_two_minutes_by_default(tmp_path: Path) -> None:
    """Both ways to freeze run at the same time (two worlds, 5 ranks): each mostly waits out the timeout."""
    cases = {"sigstop": 3, "gil": 2}
    for how in cases:
        (tmp_path / how).mkdir()
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {how: pool.submit(_freeze_world, how, world, tmp_path / how) for how, world in cases.items()}
        outcomes = {how: future.result() for how, future in futures.items()}
    timeout = DEFAULT_TIMEOUT.total_seconds()
    for how, world in cases.items():
        results, ended = outcomes[how]
        root = tmp_path / how
        frozen = json.loads((root / "frozen.json").read_text())
        victim = world - 1
        # The frozen rank was ended (SIGKILL by a survivor on its host); every survivor exited from its heartbeat.
        assert results[victim] == {"ok": False, "error": f"rank {victim} produced no result (exit code -9)",
                                   "traceback": ""}, (how, results[victim])
        for rank in range(victim):
            assert results[rank]["error"] == f"rank {rank} produced no result (exit code 1)", (how, results[rank])
            err = (root / f"rank{rank}.err").read_text()
            assert re.search(rf"lightning_4d: rank {rank}: rank {victim} \(pid {frozen['pid']} on \S+\) has sent no "
                             rf"heartbeat for {timeout:.0f} s: stopped \(SIGSTOP\), frozen or deadlocked holding the "
                             rf"GIL( \(found by rank \d\))?\. Stopping this rank now", err), (how, err[-3000:])
        elapsed = ended - frozen["time"]
        assert timeout < elapsed < 120, (how, elapsed)  # not before the silence lasted the timeout; within two minutes
        print(f"{how}: the run ended {elapsed:.0f} s after rank {victim} froze (bound {worst_case_s(timeout):.0f} s)")
