"""Count host syncs: every call that needs a tensor's value on the host, or copies host data to the device.

On a GPU each such call stalls the host until the device has drained its queue: the training step should make at
most one (where something is logged or decided), plus one per MoE layer for the all-to-all's split sizes. A CPU run
cannot stall, but it runs the same Python, so :class:`HostSyncCounter` finds the same calls there. It counts what
``torch.cuda.set_sync_debug_mode("warn")`` reports on a GPU:

- reading a value: ``.item()``, ``bool()`` / ``int()`` / ``float()`` of a tensor, ``.tolist()``, ``.numpy()``,
  ``.cpu()`` (and ``.to("cpu")`` of a tensor on a real ``device``), ``torch.equal`` / ``allclose``;
- an output whose shape depends on values: ``nonzero`` (``torch.where(cond)``), ``bincount``, ``unique``,
  ``masked_select``, boolean-mask indexing (read or write), ``repeat_interleave`` without ``output_size``;
- host data copied to the device: ``torch.tensor(data, device=...)`` / ``torch.as_tensor(data, device=...)``.

Tensors count as device tensors when they are on ``device`` — by default (or ``"cpu"``) every tensor: a CPU run
standing in for a GPU one. What a GPU run keeps on the host is left out by call site (``ignore``): the optimizer's
step counters (``torch/optim``) and DeviceMesh's rank table. Not seen on a CPU stand-in: ``.to(...)`` between host
and device (there the host *is* the device, so no call tells a copy from a no-op) and syncs inside DTensor's own
op handlers.

Example:
    >>> x = torch.ones(3)
    >>> with HostSyncCounter() as syncs:
    ...     y = x * 2           # stays on the device
    ...     _ = float(y.sum())  # one value read on the host
    >>> syncs.count, syncs.kinds()
    (1, {'item': 1})
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any, Optional, Sequence, Union

import torch
from torch.overrides import TorchFunctionMode

from lightning_4d import _compat

__all__ = ["HostSyncCounter", "DEFAULT_IGNORE", "SYNC_OPS"]

#: Call sites (path fragments, ``/``-separated) whose syncs a GPU run makes on host tensors: the optimizers'
#: ``step`` counters (host tensors unless ``capturable`` / ``fused``) and DeviceMesh's rank table.
DEFAULT_IGNORE: tuple[str, ...] = ("torch/optim/", "torch/distributed/device_mesh.py")

#: ATen ops (overload packet names) that read a value on the host or size their output by values.
SYNC_OPS: dict[str, str] = {
    "_local_scalar_dense": "item", "equal": "item", "allclose": "item", "is_nonzero": "item",
    "nonzero": "nonzero", "argwhere": "nonzero", "masked_select": "nonzero", "bincount": "bincount",
    "unique": "unique", "_unique": "unique", "_unique2": "unique", "unique_dim": "unique",
    "unique_consecutive": "unique", "repeat_interleave": "repeat_interleave", "index": "mask_index",
    "index_put": "mask_index", "index_put_": "mask_index", "_index_put_impl_": "mask_index",
}
_READS = {"tolist": "tolist", "numpy": "tolist", "cpu": "to_host"}
_FACTORIES = {"tensor", "as_tensor", "asarray"}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)


def _device_type(device: Any) -> Optional[str]:
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, int):
        return "cuda"
    return torch.device(device).type


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the host as its target device."""
    target = kwargs.get("device")
    if target is None and len(args) > 1 and not isinstance(args[1], torch.dtype):
        target = args[1].device if isinstance(args[1], torch.Tensor) else args[1]
    try:
        return _device_type(target) == "cpu"
    except (RuntimeError, TypeError):
        return False


def _mask_indexed(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether an ``index`` / ``index_put`` call takes a boolean mask that sizes a gather (a sync). ``x[mask] = v``
    with one mask and a one-element ``v`` is not one: the kernel turns it into ``masked_fill_``."""
    indices = [i for i in (args[1] if len(args) > 1 else ()) or () if i is not None]
    masks = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if not masks:
        return False
    if name == "index":
        return True
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return not (len(indices) == 1 and not accumulate and isinstance(value, torch.Tensor) and value.numel() == 1)


class HostSyncCounter:
    """Count host syncs (see the module docstring) while entered; :attr:`sites` says where each was made.

    Args:
        device: the device the step's tensors live on; ``None`` (default): every tensor (a CPU stand-in).
        ignore: call-site path fragments to leave out (default :data:`DEFAULT_IGNORE`); a sync whose Python stack
            passes through one is counted in :attr:`ignored` instead.

    Attributes:
        count: syncs counted.
        ignored: syncs left out by ``ignore``; ``ignored_sites`` counts them by kind and fragment.
        sites: ``Counter`` of ``"kind at file:line (function)"``: the innermost frame outside torch.

    Example:
        >>> with HostSyncCounter() as syncs:
        ...     _ = torch.arange(4)[torch.tensor([True, False, True, False])]  # a boolean mask sizes its output
        >>> syncs.count, list(syncs.sites)[0].split(" at ")[0]
        (1, 'mask_index')
    """

    def __init__(self, device: Union[str, torch.device, None] = None, ignore: Sequence[str] = DEFAULT_IGNORE) -> None:
        kind = _device_type(device)
        self.device = None if kind == "cpu" else kind  # a CPU run stands in for a device one
        self.ignore = tuple(os.path.normpath(p) for p in ignore)
        self.count = 0
        self.ignored = 0
        self.sites: Counter[str] = Counter()
        self.ignored_sites: Counter[str] = Counter()
        self._modes: list[Any] = []

    # ------------------------------------------------------------------ recording
    def _on_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (self.device is None or t.device.type == self.device)

    def _record(self, kind: str) -> None:
        frame: Any = sys._getframe(1)
        site, skip = "", ""
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            skip = skip or next((p for p in self.ignore if p in os.path.normpath(path)), "")
            if not path.startswith(_TORCH_DIR) and path != _THIS:
                site = f"{kind} at {_short(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
                break
            frame = frame.f_back
        if skip:
            self.ignored += 1
            self.ignored_sites[f"{kind} in {skip}"] += 1
            return
        self.count += 1
        self.sites[site or kind] += 1

    def _function(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = getattr(func, "__name__", "")
        if name in _READS and args and self._on_device(args[0]):
            self._record(_READS[name])
        elif name == "to" and args and self.device is not None and self._on_device(args[0]) and _to_host(args, kwargs):
            self._record("to_host")
        elif name in _FACTORIES and kwargs.get("device") is not None and not isinstance(args[0] if args else None,
                                                                                        torch.Tensor):
            if self.device is None or _device_type(kwargs["device"]) == self.device:
                self._record("to_device")

    def _dispatch(self, name: str, args: tuple, kwargs: dict) -> None:
        kind = SYNC_OPS.get(name)
        if kind is None or not args or not self._on_device(args[0]):
            return
        if kind == "mask_index" and not _mask_indexed(name, args, kwargs):
            return
        if kind == "repeat_interleave" and kwargs.get("output_size") is not None:
            return
        self._record(kind)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> "HostSyncCounter":
        counter = self

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
                kwargs = kwargs or {}
                counter._function(func, args, kwargs)
                return func(*args, **kwargs)

        class _Ops(_compat.dispatch_mode_base()):  # type: ignore[misc]
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
                kwargs = kwargs or {}
                if not _compat.is_higher_order_op(func):
                    counter._dispatch(_compat.op_name(func), args, kwargs)
                return func(*args, **kwargs)

        self._modes = [_Functions(), _Ops()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    # ------------------------------------------------------------------ reading
    def kinds(self) -> dict[str, int]:
        """Syncs per kind (``item``, ``tolist``, ``to_host``, ``to_device``, ``nonzero``, ``bincount``, ...).

        Example:
            >>> with HostSyncCounter() as s:
            ...     _ = torch.ones(2).tolist()
            >>> s.kinds()
            {'tolist': 1}
        """
        out: Counter[str] = Counter()
        for site, n in self.sites.items():
            out[site.split(" at ")[0]] += n
        return dict(out)

    def report(self) -> str:
        """One line per call site, most frequent first.

        Example:
            >>> HostSyncCounter().report()
            '0 host syncs'
        """
        lines = [f"{self.count} host syncs" + (f" ({self.ignored} ignored)" if self.ignored else "")]
        lines += [f"  {n} x {site}" for site, n in self.sites.most_common()]
        return "\n".join(lines)


def _short(path: str) -> str:
    """``.../lightning_4d/core/loss.py`` -> ``lightning_4d/core/loss.py`` (site-packages and the repository alike)."""
    parts = path.replace(os.sep, "/").split("/")
    for anchor in ("lightning_4d", "lightning", "tests", "bench", "transformers"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return parts[-1]
