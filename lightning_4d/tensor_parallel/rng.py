"""Random streams for dropout under tensor parallelism (Megatron's "model-parallel RNG tracker").

Dropout on *sharded* activations (sequence shards under SP, head or hidden shards inside a TP
region) must draw different masks on each TP rank; dropout on *replicated* activations must draw
the same mask on every TP rank. The default generator stays identical across TP ranks (same seed,
same consumption) and serves the replicated case; modules that see sharded activations run with a
per-rank generator swapped in for the duration of their forward.

Example:
    >>> tracker = ShardedRNG(tp_rank=1)
    >>> with tracker.fork():
    ...     _ = torch.rand(1)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["ShardedRNG", "install_sharded_rng", "sharded_dropout_modules"]

_RANK_STRIDE = 2_718_281  # keeps the per-rank seeds apart


class ShardedRNG:
    """Per-TP-rank random streams derived from the shared default stream.

    Each :meth:`fork` draws one number from the default generator (identically on every TP rank, so
    the default streams stay in sync), offsets it by the TP rank and runs the body on a generator
    seeded with it. Because the private seed is a function of the default stream, activation
    checkpointing (which restores the default RNG state before recomputing) replays the same masks.

    Example:
        >>> a, b = ShardedRNG(tp_rank=0), ShardedRNG(tp_rank=1)
        >>> _ = torch.manual_seed(0)
        >>> with a.fork():
        ...     x = torch.rand(3)
        >>> _ = torch.manual_seed(0)
        >>> with b.fork():
        ...     y = torch.rand(3)
        >>> bool((x != y).any())
        True
    """

    def __init__(self, tp_rank: int) -> None:
        self.offset = _RANK_STRIDE * (int(tp_rank) + 1)

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on this rank's private stream; the default stream advances by one draw."""
        seed = int(torch.randint(0, 2**62, (1,)).item()) + self.offset
        saved = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        saved_cuda = torch.cuda.get_rng_state() if cuda else None
        torch.manual_seed(seed)
        try:
            yield
        finally:
            torch.set_rng_state(saved)
            if saved_cuda is not None:
                torch.cuda.set_rng_state(saved_cuda)


def sharded_dropout_modules(blocks: list[tuple[str, nn.Module]], regions: dict[str, list[str]], sp: bool) -> list[str]:
    """Names of modules whose forward sees only sharded activations (pure).

    Under SP: every TP region (attention / MLP: head or hidden shards inside, sequence shards after the
    reduce-scatter) and every dropout that is a direct child of a block (sequence shards). Without SP a
    region's output is all-reduced (replicated) before its own residual dropout, so nothing is forked and
    all TP ranks draw identical masks: consistent, but attention-probability dropout is then correlated
    across head shards.

    Example:
        >>> sharded_dropout_modules([("layers.0", nn.Module())], {"layers.0": ["attention"]}, sp=True)
        ['layers.0.attention']
    """
    names: list[str] = []
    if not sp:
        return names
    for block_name, block in blocks:
        names += [f"{block_name}.{r}" for r in regions.get(block_name, [])]
        names += [f"{block_name}.{n}" for n, m in block.named_children() if isinstance(m, nn.Dropout)]
    return names


_DROPOUT_ATTRS = ("dropout", "dropout_p", "attn_dropout", "attention_dropout", "resid_dropout")


def uses_dropout(module: nn.Module) -> bool:
    """Whether ``module`` may draw dropout masks: an ``nn.Dropout`` with ``p > 0`` or a positive float
    attribute such as ``dropout`` (passed to ``scaled_dot_product_attention``) anywhere inside.

    Example:
        >>> uses_dropout(nn.Sequential(nn.Dropout(0.0))), uses_dropout(nn.Sequential(nn.Dropout(0.1)))
        (False, True)
    """
    for sub in module.modules():
        if isinstance(sub, nn.Dropout) and sub.p > 0:
            return True
        for name in _DROPOUT_ATTRS:
            value = getattr(sub, name, None)
            if isinstance(value, float) and value > 0:
                return True
    return False


def install_sharded_rng(root: nn.Module, names: list[str], tracker: ShardedRNG) -> None:
    """Make each named module that uses dropout run its forward on ``tracker``'s stream (hooks).

    Example:
        >>> net = nn.Sequential(nn.Dropout(0.5))
        >>> install_sharded_rng(net, ["0"], ShardedRNG(0))
    """
    for name in names:
        module = root.get_submodule(name)
        if not uses_dropout(module):
            continue  # no mask is drawn: forking the stream would only cost time
        contexts: list[AbstractContextManager[None]] = []

        def pre(_mod: nn.Module, _args: tuple, _c: list = contexts) -> None:
            ctx = tracker.fork()
            ctx.__enter__()
            _c.append(ctx)

        def post(_mod: nn.Module, _args: tuple, _out: Any, _c: list = contexts) -> None:
            _c.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post, always_call=True)
