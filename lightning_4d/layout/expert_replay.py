"""The set-up value check of tensor parallelism on a model with mixture-of-experts layers: their calls replayed.

:func:`lightning_4d.core.verify.check_tensor_parallel` runs the rewritten model on the traced input and compares its
output with the unsharded model's. An MoE layer cannot take part as it is: its routing is data-dependent (a top-k
that a rounding-level difference may flip, a capacity counted over this rank's tokens), and under expert
parallelism its experts are spread over the ``ep`` ranks behind all-to-alls. So the unsharded forward (the trace)
records every MoE layer's input and output (:func:`record_expert_layers`), and the check runs with each MoE layer
replaying them (:func:`check_with_experts_replayed`): the layer compares the input it receives with the recorded
one (this rank's sequence shard of it under sequence parallelism) and returns the recorded output (the same
shard), exactly. What the check compares is then the tensor-parallel rewrite of everything else — attention,
dense MLPs, norms, embedding, head — the only layers it rewrites (the plan leaves MoE layers whole, to expert
parallelism, whose own checks are :func:`~lightning_4d.expert_parallel.inplace.verify_experts`, the rewrite's
replay in :mod:`~lightning_4d.expert_parallel.rewrite` and the parity tests).

A layer whose input is not the recorded tensor or a shard of it along one dimension (a user plan handing it a
DTensor, say) runs its own forward instead; a difference found then is reported as a warning, not an error (it may
be routing flipped by rounding).

Example:
    >>> from torch import nn
    >>> class Layer(nn.Module):  # an MoE layer as far as the package can tell: it has ``experts``
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.experts = nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return self.experts(x)
    >>> net, x = nn.Sequential(nn.Linear(2, 2), Layer()), torch.ones(1, 4, 2)
    >>> with record_expert_layers(net) as calls:
    ...     expected = net(x)
    >>> sorted(calls), len(calls["1"])
    (['1'], 1)
    >>> _ = net[1].experts.weight.data.zero_()  # the layer now computes something else: the replay does not care
    >>> check_with_experts_replayed(net, calls, None, lambda: print(torch.equal(net(x), expected)))
    True
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_4d._compat import pytree, registered_submodule
from lightning_4d.core.comm import internal_comm
from lightning_4d.analysis.layer_kinds import holds_routed_experts
from lightning_4d.core.precision import allowed_difference, max_difference
from lightning_4d.core.verify import changed_output_error

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ExpertCalls", "check_with_experts_replayed", "moe_layers", "record_expert_layers"]

log = logging.getLogger(__name__)

ExpertCalls = dict[str, list[tuple[torch.Tensor, Any]]]  # layer path -> [(input, output)] in call order


def moe_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The outermost mixture-of-experts layers of ``module`` (:func:`~lightning_4d.analysis.layer_kinds.holds_routed_experts`,
    with parameters) by path: the modules the tensor-parallel plan leaves whole.

    Example:
        >>> class Layer(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.experts = nn.ModuleList([nn.Linear(2, 2)])
        >>> list(moe_layers(nn.Sequential(nn.Linear(2, 2), Layer())))
        ['1']
    """
    found: dict[str, nn.Module] = {}
    for name, mod in module.named_modules():
        if any(not p or name.startswith(f"{p}.") for p in found):
            continue
        if holds_routed_experts(mod) and any(True for _ in mod.parameters()):
            found[name] = mod
    return found


def _main_input(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


@contextmanager
def record_expert_layers(module: nn.Module) -> Iterator[ExpertCalls]:
    """Inside the block, every forward of an MoE layer of ``module`` (:func:`moe_layers`) appends its input (the
    first argument) and its output to the yielded ``{path: [(input, output), ...]}`` (detached copies): run the
    unsharded forward inside it.

    Example:
        >>> with record_expert_layers(nn.Linear(2, 2)) as calls:  # no MoE layer: nothing recorded
        ...     pass
        >>> calls
        {}
    """
    calls: ExpertCalls = {}
    handles = []
    for name, layer in moe_layers(module).items():
        def keep(_mod: nn.Module, args: tuple, kwargs: dict, out: Any, name: str = name) -> None:
            # Copies: the forward may go on to change them in place (``h += moe(h)``). Under the trace's mode they
            # are the last uses of tensors the layer itself has already used: no planned layer's consumer.
            x = _main_input(args, kwargs)
            if isinstance(x, torch.Tensor):
                copy = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)
                calls.setdefault(name, []).append((x.detach().clone(), copy))

        handles.append(layer.register_forward_hook(keep, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _shard_dim(local: tuple[int, ...], full: tuple[int, ...], parts: int) -> Optional[int]:
    """The one dimension along which ``local`` is a ``1/parts`` shard of ``full``; ``-1`` when equal, ``None`` when
    neither."""
    if local == full:
        return -1
    if len(local) != len(full):
        return None
    differ = [d for d, (a, b) in enumerate(zip(local, full)) if a != b]
    return differ[0] if len(differ) == 1 and local[differ[0]] * parts == full[differ[0]] else None


def _output_shard(out: Any, full: tuple[int, ...], dim: int, rank: int, parts: int) -> Any:
    """This rank's share of a recorded output, for an input sharded along ``dim`` of ``full``: tensors shaped like
    the input up to ``dim`` cut there, tensors with one row per token (``(N, ...)``, router logits) cut as the
    tokens are; ``None`` when another tensor (a scalar loss, say) has no share to take."""
    tokens = math.prod(full[:-1])
    failed = []

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if dim < 0:
            return t.clone()
        if t.dim() > dim and tuple(t.shape[:dim + 1]) == full[:dim + 1]:
            size = t.shape[dim] // parts
            return t.narrow(dim, rank * size, size).contiguous()
        if t.dim() >= 1 and t.shape[0] == tokens and dim < len(full) - 1:
            rows = t.reshape(*full[:-1], *t.shape[1:])  # (B, T, ...) from (B·T, ...)
            size = rows.shape[dim] // parts
            return rows.narrow(dim, rank * size, size).reshape(-1, *t.shape[1:])
        failed.append(tuple(t.shape))
        return t

    shard = pytree.tree_map(cut, out)
    return None if failed else shard


class _Replay:
    """The replacing forwards and what they saw: per layer path, the largest input difference and its ratio to
    the allowed one; the layers that ran their own forward instead."""

    def __init__(self, calls: ExpertCalls, rank: int, parts: int) -> None:
        self.queues = {name: list(records) for name, records in calls.items()}
        self.rank, self.parts = rank, parts
        self.diff = {name: 0.0 for name in calls}
        self.ratio = {name: 0.0 for name in calls}
        self.own: list[str] = []
        self.replayed: set[str] = set()

    def forward(self, name: str, own: Callable[..., Any]) -> Callable[..., Any]:
        def replayed(*args: Any, **kwargs: Any) -> Any:
            x, queue = _main_input(args, kwargs), self.queues.get(name, [])
            if queue and type(x) is torch.Tensor:
                full, out = queue[0]
                dim = _shard_dim(tuple(x.shape), tuple(full.shape), self.parts)
                shard = None if dim is None else _output_shard(out, tuple(full.shape), dim, self.rank, self.parts)
                if shard is not None:
                    queue.pop(0)
                    size = x.shape[dim] if dim >= 0 else 0
                    expected = full if dim < 0 else full.narrow(dim, self.rank * size, size)
                    diff, scale = max_difference(x.detach(), expected) or (0.0, 0.0)
                    self.diff[name] = max(self.diff[name], diff)
                    self.ratio[name] = max(self.ratio[name], diff / allowed_difference(expected, scale))
                    self.replayed.add(name)
                    return shard
            if name not in self.own:
                self.own.append(name)
            return own(*args, **kwargs)

        return replayed


@contextmanager
def _replaying(module: nn.Module, replay: _Replay) -> Iterator[None]:
    swapped: list[tuple[nn.Module, Any]] = []
    for name in replay.queues:
        layer = registered_submodule(module, name)
        if layer is None:
            continue
        swapped.append((layer, layer.__dict__.get("forward")))
        layer.forward = replay.forward(name, layer.forward)
    try:
        yield
    finally:
        for layer, before in swapped:
            del layer.forward
            if before is not None:
                layer.forward = before


def check_with_experts_replayed(module: nn.Module, calls: ExpertCalls, tp_mesh: Optional["DeviceMesh"],
                                check: Callable[[], None]) -> None:
    """Run ``check`` (the value check of the rewritten ``module``) with every MoE layer recorded in ``calls``
    (:func:`record_expert_layers`, on the unsharded forward) replaying its calls, then compare the inputs the layers
    received (one all-reduce of a few numbers over ``tp_mesh``, so every TP rank decides alike).

    Raises:
        ValueError: when ``check`` does, or when an MoE layer's input differs (the rewrite before it changes the
            values, and nothing after it showed the difference).

    Example:
        >>> check_with_experts_replayed(nn.Linear(2, 2), {}, None, lambda: None)  # nothing to replay
    """
    if not calls:
        check()
        return
    rank = tp_mesh.get_local_rank() if tp_mesh is not None else 0
    replay = _Replay(calls, rank, tp_mesh.size() if tp_mesh is not None else 1)
    with _replaying(module, replay):
        try:
            check()
        except ValueError as err:
            if not replay.own:
                raise
            log.warning("lightning_4d: the tensor-parallel value check of %s found a difference, but the MoE "
                        "layer(s) %s ran their own forward (their input was neither the recorded tensor nor a shard "
                        "of it), whose routing may differ by rounding alone: %s", type(module).__name__,
                        ", ".join(replay.own), err)
    names = list(replay.diff)  # in the order of the unsharded forward, the same on every rank
    device = next(iter(calls.values()))[0][0].device  # where the model runs: what the backend communicates
    seen = torch.tensor([[replay.diff[n] for n in names], [replay.ratio[n] for n in names]], dtype=torch.float64,
                        device=device)  # (2, layers): max abs input difference, its ratio to the allowed one
    if tp_mesh is not None and tp_mesh.size() > 1:
        with internal_comm():  # a set-up check, not the training step's communication
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=tp_mesh.get_group())
    seen = seen.cpu()
    first = next((i for i in range(len(names)) if float(seen[1, i]) > 1.0), None)  # where the values part first
    if first is not None:
        raise changed_output_error(module, float(seen[0, first]), f"at the input of the MoE layer {names[first]}")
    if replay.replayed:  # (none when the check ran no forward: a pipeline chain checked before sharding)
        own = f"; {', '.join(replay.own)} ran their own forward" if replay.own else ""
        log.info("lightning_4d: tensor-parallel value check of %s with %d MoE layer(s) replayed from the unsharded "
                 "forward (their inputs within %.3g of the reference: %.2g of the allowed difference%s)",
                 type(module).__name__, len(replay.replayed), float(seen[0].max()), float(seen[1].max()), own)
