"""Lengths a model declares that change its attention with the sequence length — sliding windows, attention chunks,
an indexer's top-k, a position scale — and shrinking them for the set-up check.

Context parallelism is exact only if the mask each layer applies is recomputed for the whole sequence, and a
mask read on a sequence shorter than the layer's window (or chunk, or top-k) looks causal. The set-up check
(:mod:`.check`) therefore runs on a sequence longer than every such length. Real ones are thousands of tokens, so
the check shrinks them while it runs (:func:`shrunk`): every attribute named in :data:`LENGTH_NAMES` (on any module
and on the ``config`` objects the modules hold, where transformers' mask builders read them) is set to a small,
distinct, order-preserving odd value, and restored afterwards. A window or chunk the check then reads from a layer's
mask maps back to the declared length it came from (:meth:`Shrunk.original`); one that maps to none is not a
declared length and is refused (:mod:`.check`). Whether a layer uses the attribute at all is not assumed: the mask
it applies says so.

Example:
    >>> import torch
    >>> class Attn(torch.nn.Module):
    ...     sliding_window = 4096
    >>> model = torch.nn.Sequential(Attn())
    >>> with shrunk(model) as lengths:
    ...     model[0].sliding_window, lengths.original(3), lengths.longest
    (3, 4096, 3)
    >>> model[0].sliding_window
    4096
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from torch import nn

__all__ = ["LENGTH_NAMES", "Shrunk", "declared_lengths", "shrunk"]

#: Attribute names whose integer value is a length in tokens that shapes attention: sliding windows (transformers'
#: ``sliding_window``, Longformer's ``attention_window``, ``window_size``, ...), Llama 4's ``attention_chunk_size``,
#: DeepSeek-V3.2's indexer ``index_topk``, Llama 4's temperature-tuning ``floor_scale``.
LENGTH_NAMES = re.compile(r"(?:^|_)window(?:_size)?$|^attention_chunk_size$|^index_top_?k$|^floor_scale$")

_FIRST = 3  # the smallest shrunk length (odd: never a multiple of the zigzag chunk, so chunk edges are crossed)


def _length(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _owners(model: nn.Module) -> list[Any]:
    """The modules of ``model`` and the distinct configs they hold (and their sub-configs), each once."""
    seen: dict[int, Any] = {}
    for sub in model.modules():
        seen.setdefault(id(sub), sub)
        config = getattr(sub, "config", None)
        stack = [config] if config is not None and not isinstance(config, nn.Module) else []
        while stack:
            cfg = stack.pop()
            if id(cfg) in seen:
                continue
            seen[id(cfg)] = cfg
            stack += [v for v in vars(cfg).values() if type(v).__name__.endswith("Config")] \
                if hasattr(cfg, "__dict__") else []
    return list(seen.values())


def declared_lengths(model: nn.Module) -> list[tuple[Any, str, int]]:
    """``(owner, attribute, value)`` of every :data:`LENGTH_NAMES` attribute with a positive integer value on a
    module of ``model`` or a config it holds. Pure.

    Example:
        >>> import torch
        >>> class Cfg:
        ...     sliding_window, max_window_layers = 8, 2
        >>> lin = torch.nn.Linear(1, 1); lin.config = Cfg()
        >>> [(name, value) for _, name, value in declared_lengths(lin)]
        [('sliding_window', 8)]
    """
    out = []
    for owner in _owners(model):
        attrs = vars(owner) if hasattr(owner, "__dict__") else {}
        names = set(attrs) | {n for n in vars(type(owner)) if not n.startswith("__")}
        for name in sorted(names):
            if LENGTH_NAMES.search(name):
                value = getattr(owner, name, None)
                if _length(value):
                    out.append((owner, name, value))
    return out


@dataclass
class Shrunk:
    """The lengths :func:`shrunk` set: ``values`` maps each declared length to its shrunk one (``longest``: the
    largest shrunk value, 0 when nothing was declared)."""

    values: dict[int, int] = field(default_factory=dict)

    @property
    def longest(self) -> int:
        return max(self.values.values(), default=0)

    def original(self, size: int) -> int | None:
        """The declared length a window or chunk of ``size`` tokens read during the check stands for (``size``
        itself when nothing was shrunk; ``None`` when it is no declared length, shrunk)."""
        if not self.values:
            return size
        back = {v: k for k, v in self.values.items()}
        return back.get(size)


def shrink_map(lengths: list[int]) -> dict[int, int]:
    """Each distinct length to a small odd value, in the same order (3, 5, 7, ...). Pure.

    Example:
        >>> shrink_map([4096, 8192, 4096, 128])
        {128: 3, 4096: 5, 8192: 7}
    """
    return {v: _FIRST + 2 * i for i, v in enumerate(sorted(set(lengths)))}


@contextlib.contextmanager
def shrunk(model: nn.Module) -> Iterator[Shrunk]:
    """While active, every declared length of ``model`` (:func:`declared_lengths`) holds its shrunk value
    (:func:`shrink_map`); restored on exit.

    Example:
        >>> import torch
        >>> with shrunk(torch.nn.Linear(1, 1)) as lengths:
        ...     lengths.longest
        0
    """
    found = declared_lengths(model)
    mapping = shrink_map([v for _, _, v in found])
    changed: list[tuple[Any, str, Any, bool]] = []
    try:
        for owner, name, value in found:
            # an instance attribute or a property is set back; a plain class attribute shows through again
            restore = (hasattr(owner, "__dict__") and name in vars(owner)) or \
                isinstance(getattr(type(owner), name, None), property)
            try:
                setattr(owner, name, mapping[value])
            except (AttributeError, TypeError):  # a read-only property: left as it is
                continue
            changed.append((owner, name, value, restore))
        yield Shrunk(mapping)
    finally:
        for owner, name, value, restore in reversed(changed):
            if restore:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
