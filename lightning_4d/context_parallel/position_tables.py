"""Tables a model slices to its input length, handed to it in this rank's global positions.

Many models keep a per-position table as a buffer — a rotary ``cos`` / ``sin`` cache ``(max_len, dim)`` — and take
its first ``T`` rows for an input of ``T`` tokens (LitGPT: ``cos = self.cos[:T]``), with no ``position_ids`` argument.
Under context parallelism a rank holds ``T/cp`` tokens at zigzag global positions, so ``table[:T/cp]`` would be the
wrong rows. The set-up check's whole-sequence run finds every such slice (:func:`watch_sliced_tables`: a buffer
indexed ``[:T]`` along its first dimension with ``T`` the sequence length); :func:`install_position_tables` then
hooks the module holding it: while a context-parallel step runs (an active
:class:`~.attention.ContextParallelAttention`), its forward sees the table's rows at this rank's global positions
first (``table[positions]``), so ``table[:T/cp]`` is exactly what the whole sequence's run used for these tokens.
The buffer is put back after the forward; outside a context-parallel step nothing changes.

Example:
    >>> import torch
    >>> class Rotary(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("cos", torch.arange(8.0)[:, None], persistent=False)
    ...     def forward(self, x):
    ...         return x + self.cos[: x.shape[1]]
    >>> model = Rotary()
    >>> with watch_sliced_tables(model, seq_len=4) as found:
    ...     _ = model(torch.zeros(1, 4, 1))
    >>> found
    [('', 'cos')]
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_4d.context_parallel.attention import active_attention

__all__ = ["install_position_tables", "watch_sliced_tables"]

_INSTALLED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # owners hooked already (set-up may run again)


def _slices_rows(index: Any, seq_len: int) -> bool:
    """Whether ``index`` (of ``tensor[index]``) takes rows ``[0, seq_len)`` of the first dimension."""
    first = index[0] if isinstance(index, tuple) and index else index
    return (isinstance(first, slice) and first.start in (None, 0) and first.step in (None, 1)
            and first.stop == seq_len)


class _Slices(TorchFunctionMode):
    def __init__(self, buffers: dict[int, tuple[str, str]], seq_len: int) -> None:
        super().__init__()
        self.buffers, self.seq_len, self.found = buffers, seq_len, []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is Tensor.__getitem__ and len(args) == 2 and id(args[0]) in self.buffers:
            owner = self.buffers[id(args[0])]
            if _slices_rows(args[1], self.seq_len) and args[0].dim() >= 1 and args[0].shape[0] >= self.seq_len \
                    and owner not in self.found:
                self.found.append(owner)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watch_sliced_tables(module: nn.Module, seq_len: int) -> Iterator[list[tuple[str, str]]]:
    """While active, ``[(module path, buffer name)]`` of the buffers of ``module`` that a forward slices to
    ``seq_len`` rows (``buffer[:seq_len]``), in the order first seen.

    Example:
        >>> with watch_sliced_tables(nn.Linear(2, 2), seq_len=4) as found:
        ...     pass
        >>> found
        []
    """
    buffers = {id(b): (path, name) for path, sub in module.named_modules()
               for name, b in sub.named_buffers(recurse=False) if b is not None}
    mode = _Slices(buffers, seq_len)
    with mode:
        yield mode.found


def install_position_tables(module: nn.Module, tables: Sequence[tuple[str, str]]) -> None:
    """Hook the owners of ``tables`` (from :func:`watch_sliced_tables`) so that, during a context-parallel step, their
    forward sees each table's rows at this rank's global positions first (see the module docstring). Idempotent.

    Example:
        >>> install_position_tables(nn.Linear(2, 2), [])  # nothing sliced: no hook
    """
    by_owner: dict[str, list[str]] = {}
    for path, name in tables:
        by_owner.setdefault(path, []).append(name)
    for path, names in by_owner.items():
        owner = module.get_submodule(path)
        if owner in _INSTALLED:
            continue
        _INSTALLED.add(owner)
        saved: list[dict[str, Tensor]] = []
        positions: dict[tuple, Tensor] = {}

        def enter(mod: nn.Module, _args: tuple, names: list[str] = names, saved: list = saved,
                  positions: dict = positions) -> None:
            attention = active_attention()
            shard = None if attention is None else attention.current or attention.shard
            if shard is None:
                saved.append(None)  # not a context-parallel step: the forward runs as written
                return
            original = {n: getattr(mod, n) for n in names}
            saved.append(original)
            for n, table in original.items():
                if table is None:
                    continue
                key = (shard.seq_len, shard.cp, shard.rank, table.device)
                if key not in positions:
                    positions[key] = shard.query_pos.to(table.device)  # (T/cp,) this rank's global positions
                setattr(mod, n, table.index_select(0, positions[key]))  # the buffer: (T/cp, ...) rows in local order

        def leave(mod: nn.Module, *_: Any, saved: list = saved) -> None:
            original = saved.pop() if saved else None
            for n, table in (original or {}).items():
                setattr(mod, n, table)

        owner.register_forward_pre_hook(enter)
        owner.register_forward_hook(leave, always_call=True)
