"""Preemption that saves and says so: a signal ends the run at the next step with a checkpoint and a non-zero exit.

Schedulers preempt with a signal (SLURM and Kubernetes send ``SIGTERM``, SLURM's ``--signal`` often
``SIGUSR1``) and then kill the job after a grace period. With :class:`PreemptionSaver` (installed by
:class:`~lightning_4d.strategy.FourDStrategy` on every rank) the handler only records the signal; after each
optimizer step all ranks agree on it (one all-reduce of one integer over the world, the same cost as the
broadcast Lightning makes every step), so a signal that reached any rank — the launcher alone, or every
worker under torchrun — stops every rank after the *same* step. Then a complete checkpoint is written
(``preempted-step=N.ckpt``, atomically, like every checkpoint of the strategy; after a save still in flight,
and complete before the exit even with ``async_checkpoint``), rank 0 logs where it is, and
the processes exit with ``128 + signal`` (143 for ``SIGTERM``): a scheduler sees a failed job, not a
finished one. With ``requeue=True`` under SLURM, rank 0 also runs ``scontrol requeue $SLURM_JOB_ID``.
Resuming from the checkpoint continues exactly (``trainer.fit(..., ckpt_path=path)``).

Example:
    >>> resolve_signals(("SIGTERM", "SIGUSR1")) == (signal.SIGTERM, signal.SIGUSR1)
    True
    >>> Preempted(signal.SIGTERM, "ckpts/preempted-step=7.ckpt").code
    143
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_4d import _compat
from lightning_4d.config import DEFAULT_SIGNALS, resolve_signals  # owned by the options

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DEFAULT_SIGNALS", "Preempted", "PreemptionSaver", "resolve_signals"]

log = logging.getLogger(__name__)

class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written; the exit code is ``128 + signal``.

    Attributes:
        signum: the signal; path: the checkpoint written.
    """

    def __init__(self, signum: int, path: str) -> None:
        super().__init__(128 + int(signum))
        self.signum, self.path = int(signum), path

    def __str__(self) -> str:
        return (f"preempted by {signal.Signals(self.signum).name}: checkpoint saved to {self.path}; resume with "
                f"trainer.fit(..., ckpt_path={self.path!r}) (exit code {self.code})")


class PreemptionSaver(Callback):
    """Save a checkpoint and stop with a non-zero exit when a preemption signal arrives (module docstring).

    Args:
        signals: signal numbers to catch (see :func:`resolve_signals`).
        requeue: under SLURM, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` after saving.
        dirpath: where to write; default the ``ModelCheckpoint``'s directory, else
            ``<default_root_dir>/checkpoints``.

    Example:
        >>> saver = PreemptionSaver(resolve_signals(DEFAULT_SIGNALS))
        >>> saver.received is None
        True
    """

    def __init__(self, signals: Sequence[int], requeue: bool = False, dirpath: Optional[str] = None) -> None:
        super().__init__()
        self.signals = tuple(signals)
        self.requeue = requeue
        self.dirpath = dirpath
        self.received: Optional[int] = None
        self.saved: Optional[str] = None
        self._previous: dict[int, Any] = {}
        self._agreed: Optional[tuple[int, int]] = None  # (step, signal) agreed by the strategy's step guard

    # ------------------------------------------------------------------ handlers
    def install(self) -> None:
        """Replace the handlers of :attr:`signals` in this (main) thread, remembering the previous ones.
        Lightning's own ``SIGTERM`` handler (which ends the run with exit code 0 and saves nothing) is replaced."""
        for num in self.signals:
            if num not in self._previous:
                self._previous[num] = signal.getsignal(num)
            signal.signal(num, self._handle)

    def restore(self) -> None:
        """Put the previous handlers back."""
        for num, previous in self._previous.items():
            signal.signal(num, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, _frame: Optional[FrameType]) -> None:
        if self.received is None:  # async-signal-safe: only remember it
            self.received = signum

    # ------------------------------------------------------------------ the agreed stop
    def agree(self, step: int, signum: int) -> None:
        """The signal all ranks agreed on before optimizer step ``step`` (the strategy's non-finite guard
        all-reduces it with its own flags); the batch-end check of that step then needs no collective."""
        self._agreed = (step, signum)

    def _agreed_signal(self, device: torch.device, step: int) -> int:
        from lightning_4d.core.comm import internal_comm

        agreed, self._agreed = self._agreed, None
        if agreed is not None and agreed[0] == step:
            return agreed[1]
        flag = torch.full((1,), self.received or 0, dtype=torch.int64, device=device)  # a fill, not a host copy
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            with internal_comm():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _target(self, trainer: "pl.Trainer") -> str:
        base = self.dirpath
        if base is None:
            callback = getattr(trainer, "checkpoint_callback", None)
            base = getattr(callback, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        return os.path.join(base, f"preempted-step={trainer.global_step}.ckpt")

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if _compat.should_accumulate(trainer):
            return  # mid-accumulation: stop after the optimizer step
        signum = self._agreed_signal(pl_module.device, trainer.global_step - 1)
        if not signum:
            return
        path = self._target(trainer)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(path)  # collective on every rank; atomic; after a save in flight
        wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if wait is not None:
            wait()  # a background save (async_checkpoint) is complete before the exit
        self.saved = path
        error = Preempted(signum, path)
        if trainer.is_global_zero:
            log.warning(str(error))
            print(f"lightning_4d: {error}", flush=True)
            if self.requeue:
                _requeue()
        raise error


def _requeue() -> None:
    job = os.environ.get("SLURM_JOB_ID")
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if not job or shutil.which("scontrol") is None:
        log.warning("preemption requeue asked for, but this is not a SLURM job (no SLURM_JOB_ID / scontrol)")
        return
    result = subprocess.run(["scontrol", "requeue", job], check=False)
    if result.returncode == 0:
        print(f"lightning_4d: requeued SLURM job {job}", flush=True)
    else:
        log.warning(f"scontrol requeue {job} failed with exit code {result.returncode}")
