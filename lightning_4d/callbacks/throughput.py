"""Training throughput across the mesh: tokens per second, model FLOP utilisation (MFU), peak memory per rank.

Rates and MFU come from Lightning's :class:`~lightning.fabric.utilities.throughput.Throughput` (the default
peak FLOP/s from :func:`~lightning.fabric.utilities.throughput.get_available_flops`); what is 4D-specific is
the accounting fed to it: one "device" of ``Throughput`` is one data-parallel replica (``dims.dp`` of them
under ``FourDStrategy``, the world otherwise), whose tokens are the world's summed inputs over
``world / dp`` (TP and PP peers share a batch) and whose peak is ``world / dp`` devices' peak;
``flops_per_token`` is the *whole* model's (read before the strategy splits it into pipeline stages).
So MFU = ``flops_per_token(seq_len) · tokens/s ÷ (peak FLOP/s per device · world size)``. Time is wall
time between logging points (data loading included), the slowest rank's; on CUDA the device is
synchronised at each logging point only. Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA,
else the process's resident-set high-water mark (``resource.getrusage``).

Example:
    >>> round(mfu(flops_per_token=1e9, tokens_per_second=1e5, peak_flops=1e15, devices=8), 4)
    0.0125
"""

from __future__ import annotations

import resource
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_4d.core.batches import batch_tokens
from lightning_4d.callbacks._common import RunContext, every_n, gather_rows, log_metrics, resolve_every_n
from lightning_4d.core.precision import precision_info

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.types import STEP_OUTPUT

__all__ = ["FourDThroughputMonitor", "mfu", "peak_memory_bytes", "find_flops_per_token"]



def mfu(flops_per_token: float, tokens_per_second: float, peak_flops: float, devices: int) -> float:
    """Model FLOP utilisation: achieved model FLOP/s over the devices' peak (0 without a peak).

    Example:
        >>> mfu(6.0, 10.0, 100.0, 2)
        0.3
    """
    if peak_flops <= 0 or devices <= 0:
        return 0.0
    return flops_per_token * tokens_per_second / (peak_flops * devices)


def peak_memory_bytes(device: Optional[torch.device] = None) -> int:
    """Peak memory of this rank: CUDA ``max_memory_allocated`` on a CUDA device, else the process's
    maximum resident set size (``ru_maxrss``: KiB on Linux, bytes on macOS).

    Example:
        >>> peak_memory_bytes(torch.device("cpu")) > 0
        True
    """
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def find_flops_per_token(pl_module: torch.nn.Module) -> Optional[Callable[[int], float]]:
    """The first ``flops_per_token(seq_len)`` of the LightningModule or one of its submodules, or ``None``.

    Example:
        >>> find_flops_per_token(torch.nn.Linear(2, 2)) is None
        True
    """
    for module in [pl_module, *getattr(pl_module, "modules", lambda: [])()]:
        fn = getattr(module, "flops_per_token", None)
        if callable(fn):
            return fn
    return None


def _frozen_linear(fn: Optional[Callable[[int], float]]) -> Optional[Callable[[int], float]]:
    """``s ↦ fn(0) + (fn(1) − fn(0))·s`` evaluated now, or ``None``."""
    if fn is None:
        return None
    try:
        a = float(fn(0))
        b = float(fn(1)) - a
    except Exception:  # noqa: BLE001 - not callable with an int: ask again later
        return None
    return lambda s: a + b * s


class FourDThroughputMonitor(Callback):
    """Logs tokens per second, MFU and peak memory per rank across the whole mesh.

    At every logging point (every ``every_n_steps`` batches), over the batches since the previous one:

    - ``perf/tokens_per_second`` (global: all data-parallel replicas), ``perf/step_seconds`` (mean wall
      time per batch; the slowest rank),
    - ``perf/mfu`` when the model has ``flops_per_token(seq_len)`` (or ``flops_per_token=`` is given) and
      the peak FLOP/s of a device is known,
    - ``perf/peak_memory_bytes_max`` / ``_mean`` and ``perf/peak_memory_bytes_rank{r}`` (``per_rank``;
      default: worlds of at most 16 ranks).

    Works with any strategy (the world is the data-parallel group outside ``FourDStrategy``). Unlike
    Lightning's ``ThroughputMonitor`` (per-device rates of one model copy per device), it counts a model
    replica spread over TP × PP devices once and logs the same values on every rank.

    Args:
        peak_flops_per_device: peak FLOP/s of one device for MFU (e.g. ``989e12`` for an H100 in bf16);
            ``None``: Lightning's ``get_available_flops`` for the device and precision; ``0``: no MFU.
        every_n_steps: log every N training batches (default: ``trainer.log_every_n_steps``).
        flops_per_token: ``fn(seq_len) -> FLOPs`` overriding the model's.
        per_rank: log one peak-memory key per rank.
        tokens_fn: ``fn(batch) -> tokens on this rank`` (default: elements of the inputs).

    Example:
        >>> monitor = FourDThroughputMonitor(peak_flops_per_device=989e12, every_n_steps=10)
        >>> # not run: needs a Trainer
        >>> trainer = L.Trainer(strategy=FourDStrategy(tp=8, pp=4), callbacks=[monitor])  # doctest: +SKIP
        >>> trainer.fit(lm, data)  # doctest: +SKIP
        >>> float(trainer.callback_metrics["perf/mfu"])  # doctest: +SKIP
        0.41
    """

    def __init__(self, peak_flops_per_device: Optional[float] = None, every_n_steps: Optional[int] = None,
                 flops_per_token: Optional[Callable[[int], float]] = None, per_rank: Optional[bool] = None,
                 tokens_fn: Optional[Callable[[Any], int]] = None) -> None:
        super().__init__()
        if peak_flops_per_device is not None and peak_flops_per_device < 0:
            raise ValueError(f"peak_flops_per_device={peak_flops_per_device} must be >= 0 (0: no MFU).")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1 (or None for trainer.log_every_n_steps).")
        self.peak_flops_per_device = peak_flops_per_device
        self.every_n_steps = every_n_steps
        self.flops_per_token = flops_per_token
        self.per_rank = per_rank
        self.tokens_fn = tokens_fn
        self._ctx: Optional[RunContext] = None
        self._every = 1
        self._fpt: Optional[Callable[[int], float]] = None
        self._throughput: Optional[Throughput] = None
        self._t_last: Optional[float] = None
        self._tokens = self._batches = self._seq = self._seen = 0
        self._total = [0.0, 0, 0.0]  # replica totals fed to Throughput: seconds, batches, tokens
        self._warned = False  # the tokens of a batch could not be counted (said once)

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._ctx = RunContext.from_trainer(trainer)
        self._every = resolve_every_n(self.every_n_steps, trainer)
        # Before the strategy splits the model into pipeline stages (a stage alone would count only its
        # own parameters): keep FLOPs(s) = a + b·s (linear in the sequence length, as the formula is).
        self._fpt = self.flops_per_token or _frozen_linear(find_flops_per_token(pl_module))
        peak = self.peak_flops_per_device
        if peak is None:
            try:
                dtype = precision_info(trainer.precision).compute_dtype
            except ValueError as err:
                raise ValueError(f"FourDThroughputMonitor: the peak FLOP/s for MFU depends on the compute dtype: "
                                 f"{err} Or pass peak_flops_per_device (0: no MFU).") from err
            peak = get_available_flops(trainer.strategy.root_device, dtype) or 0.0
        devices_per_replica = self._ctx.world_size / self._ctx.dp
        self._throughput = Throughput(available_flops=peak * devices_per_replica, world_size=self._ctx.dp,
                                      window_size=2)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._fpt is None:  # a model created in configure_model
            self._fpt = find_flops_per_token(pl_module)
        self._t_last = None
        self._total = [0.0, 0, 0.0]
        assert self._throughput is not None
        self._throughput.update(time=0.0, batches=0, samples=0, lengths=0, flops=0 if self._fpt else None)

    def _local_tokens(self, pl_module: "pl.LightningModule", batch: Any) -> tuple[int, int]:
        if self.tokens_fn is not None:
            return int(self.tokens_fn(batch)), self._seq
        split = getattr(pl_module, "split_batch", None)
        try:
            inputs = split(batch)[0] if callable(split) else (batch[0] if isinstance(batch, (tuple, list)) else batch)
            inputs = batch_tokens(inputs)  # packed documents: the token ids
        except Exception as err:  # noqa: BLE001 - an unusual batch: said once, then no token rates
            self._cannot_count(f"`split_batch` / `batch[0]` raised {type(err).__name__}: {err}")
            return 0, self._seq
        if isinstance(inputs, torch.Tensor):
            return int(inputs.numel()), int(inputs.shape[1]) if inputs.dim() >= 2 else int(inputs.numel())
        self._cannot_count(f"the batch's inputs are a {type(inputs).__name__}, not a tensor of token ids")
        return 0, self._seq

    def _cannot_count(self, cause: str) -> None:
        """Warn once that this rank's tokens cannot be counted (tokens/s and MFU are then not logged)."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"FourDThroughputMonitor cannot count the tokens of a batch: {cause}; "
                          f"perf/tokens_per_second and perf/mfu are not logged. Fix: pass "
                          f"`FourDThroughputMonitor(tokens_fn=lambda batch: <tokens on this rank>)`.", stacklevel=2)

    def _now(self, pl_module: "pl.LightningModule") -> float:
        device = getattr(pl_module, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self._t_last is None:
            self._t_last = self._now(pl_module)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: STEP_OUTPUT,
                           batch: Any, batch_idx: int) -> None:
        tokens, self._seq = self._local_tokens(pl_module, batch)
        self._tokens += tokens
        self._batches += 1
        step, self._seen = self._seen, self._seen + 1
        if not every_n(self._every, step) or self._t_last is None:
            return
        ctx, throughput = self._ctx, self._throughput
        assert ctx is not None and throughput is not None
        now = self._now(pl_module)
        device = getattr(pl_module, "device", None)
        row = torch.tensor([now - self._t_last, float(self._tokens), float(self._batches),
                            float(peak_memory_bytes(device))], dtype=torch.float64)
        rows = gather_rows(row, device)  # (world, 4)
        self._t_last, self._tokens, self._batches = now, 0, 0
        seconds, batches = float(rows[:, 0].max()), int(rows[:, 2].max())
        replica_tokens = float(rows[:, 1].sum()) * ctx.dp / ctx.world_size  # TP / PP peers count once
        metrics = {
            "perf/step_seconds": seconds / batches,
            "perf/peak_memory_bytes_max": float(rows[:, 3].max()),
            "perf/peak_memory_bytes_mean": float(rows[:, 3].mean()),
        }
        if seconds > 0 and replica_tokens >= batches:  # Throughput's totals must increase
            self._total = [self._total[0] + seconds, self._total[1] + batches, self._total[2] + replica_tokens]
            t, b, n = self._total
            flops = self._fpt(self._seq) * replica_tokens if self._fpt else None
            throughput.update(time=t, batches=b, samples=b, lengths=n, flops=flops)
            out = throughput.compute()
            metrics["perf/tokens_per_second"] = out.get("items_per_sec", out["device/items_per_sec"])
            if "device/mfu" in out and self._seq:
                metrics["perf/mfu"] = out["device/mfu"]
        if self.per_rank if self.per_rank is not None else ctx.world_size <= 16:
            metrics.update({f"perf/peak_memory_bytes_rank{r}": float(v) for r, v in enumerate(rows[:, 3])})
        log_metrics(pl_module, metrics)
