"""The dry run's stand-ins for what fake tensors cannot run: uniform expert routing, a dispatch mode that lets the
set-up trace and the step run on fake and meta tensors, and the pipeline schedule run stage by stage with its sends
measured (see :mod:`lightning_4d.planner.dry_run`).

Example:
    >>> uniform_experts(4, num_experts=4).tolist()
    [0, 1, 2, 3]
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn

from lightning_4d._compat import dispatch_mode_base, fsdp_param_group, is_fake, is_item_op, unset_fake
from lightning_4d.core.comm import CommRecord
from lightning_4d.expert_parallel.permute import FIXED_ROUTING, FixedRouting
from lightning_4d.core.distributed import local_of
from lightning_4d.mesh import ParallelDims
from lightning_4d.planner.spec import TransformerSpec
from lightning_4d.core.precision import precision_info

if TYPE_CHECKING:
    from lightning_4d._compat.dispatch import OperatorBase
    from lightning_4d._compat.dispatch import TorchDispatchMode

__all__ = ["fake_friendly_mode", "traced_micro_batch", "uniform_experts", "uniform_routing"]


# ---------------------------------------------------------------------------------------------- stand-ins
def uniform_experts(num_assignments: int, num_experts: int, ep: int = 1) -> torch.Tensor:
    """Expert of each of ``N·k`` assignments under uniform routing: round-robin over the ``ep`` ranks first,
    then over each rank's ``E/ep`` experts, so every rank receives ``N·k/ep`` of them and every expert
    ``N·k/E`` (when those divide) even when there are fewer assignments than experts; a token's ``k``
    consecutive assignments go to distinct experts.

    Example:
        >>> uniform_experts(8, num_experts=8, ep=4).tolist()
        [0, 2, 4, 6, 1, 3, 5, 7]
    """
    i = torch.arange(num_assignments)
    local = num_experts // ep
    return (i % ep) * local + (i // ep) % local


def traced_micro_batch(spec: TransformerSpec, dims: ParallelDims, b: int, seq_len: int) -> int:
    """Sequences the dry run traces per micro-batch: ``b``, times the smallest factor that makes each rank's
    ``N·k`` routed assignments a multiple of ``ep`` (``N`` tokens per rank: ``b·s/cp``, ``/tp`` with SP), so that
    :func:`uniform_experts` gives every ep rank the same share, as the formulas assume.

    Example:
        >>> from lightning_4d.planner.spec import seed_moe_1t
        >>> dims = ParallelDims.from_world(512, tp=8, pp=8, ep=64)  # 16 tokens · top-2 = 32 assignments < 64
        >>> traced_micro_batch(seed_moe_1t(), dims, 1, 128), traced_micro_batch(seed_moe_1t(), dims, 1, 256)
        (2, 1)
    """
    if dims.ep == 1 or not spec.num_experts or not spec.top_k or spec.num_experts % dims.ep:
        return b
    assignments = b * seq_len // dims.cp // (dims.tp if dims.sp else 1) * spec.top_k
    return b * (dims.ep // math.gcd(assignments, dims.ep))


@contextlib.contextmanager
def uniform_routing(ep: int = 1) -> Iterator[None]:
    """Route every token of the package's MoE layers uniformly and deterministically (for fake tensors).

    Sets :data:`lightning_4d.expert_parallel.permute.FIXED_ROUTING` to a
    :class:`~lightning_4d.expert_parallel.permute.FixedRouting` of :func:`uniform_experts` for ``ep``
    expert-parallel ranks, with host-side index math on real tensors (outside the fake mode): ``MoE.forward``
    sorts assignments with it, ``dispatch`` computes its split sizes on real tensors, and the per-expert count
    all-to-all (still issued, so it is traced) yields the counts of uniform routing on every rank. Outside
    fake tensors the layer computes the same outputs for this routing as without the context.

    Example:
        >>> from lightning_4d.expert_parallel import MoE
        >>> with uniform_routing():
        ...     out = MoE(8, 16, num_experts=4, top_k=2)(torch.randn(2, 3, 8))
        >>> out.shape
        torch.Size([2, 3, 8])
    """
    def assign(num_assignments: int, num_experts: int) -> torch.Tensor:
        return uniform_experts(num_assignments, num_experts, ep if num_experts % ep == 0 else 1)

    token = FIXED_ROUTING.set(FixedRouting(assign, host=unset_fake))
    try:
        yield
    finally:
        FIXED_ROUTING.reset(token)


def fake_friendly_mode() -> TorchDispatchMode:
    """A ``TorchDispatchMode`` letting the package's models run on fake tensors: ``aten.bincount`` of a fake
    tensor gives fake zeros of length ``minlength`` (the router's counts; values never matter),
    ``aten.randint`` (host seeds) and ``.item()`` of real tensors run for real, ``.item()`` of a fake floating
    scalar (the loss's token total, read by :func:`~lightning_4d.core.loss.weighted_global_loss`) gives 1.0. On meta
    tensors (the set-up trace of a meta model) ``bincount`` gives meta zeros likewise.

    Example:
        >>> with fake_friendly_mode():
        ...     torch.bincount(torch.zeros(3, dtype=torch.long, device="meta"), minlength=4).shape
        torch.Size([4])
    """

    class _FakeFriendly(dispatch_mode_base()):  # type: ignore[misc]
        def __torch_dispatch__(self, func: OperatorBase, types: tuple[type, ...], args: tuple = (),
                               kwargs: Optional[dict] = None) -> Any:
            kwargs = kwargs or {}
            if func is torch.ops.aten.bincount.default and (is_fake(args[0]) or args[0].is_meta):
                n = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
                return torch.zeros(int(n), dtype=torch.long, device=args[0].device)
            if func.overloadpacket is torch.ops.aten.randint or (is_item_op(func) and not is_fake(args[0])):
                with unset_fake():
                    return func(*args, **kwargs)
            if is_item_op(func) and is_fake(args[0]) and args[0].is_floating_point():
                return 1.0  # a fake statistic read on the host (the loss's token total): nonzero, values never matter
            return func(*args, **kwargs)

    return _FakeFriendly()


def _reshards_after_forward(module: nn.Module) -> Optional[bool]:
    """Whether an FSDP2-wrapped module frees its gathered parameters after forward
    (``FSDPParamGroup.post_forward_mesh_info``); ``None`` when it is not wrapped."""
    group = fsdp_param_group(module)
    if group is None:
        return None
    return group.post_forward_mesh_info is not None


# ---------------------------------------------------------------------------------------------- one rank
def _leaves(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _leaves(y)]
    return []


def _measured_send(t: torch.Tensor) -> CommRecord:
    """A pp send of the stage boundary tensor ``t`` (measured: torch's schedule is not run)."""
    local = local_of(t)
    nbytes = float(local.numel() * local.element_size())
    return CommRecord("send", "pp", 2, nbytes, nbytes, op="boundary (measured)")


def _stand_in_schedule(dims: ParallelDims, spec: TransformerSpec, precision: str, b: int, s: int, pp_rank: int,
                       boundary: dict, sends: list[CommRecord]) -> Callable[..., None]:
    """What replaces torch's pipeline schedule in the dry run (a :data:`~lightning_4d.pipeline.runner.ScheduleRun`):
    one micro-batch forward and backward through each of the rank's stage modules in turn, the last stage's loss by
    the runner's own :meth:`~lightning_4d.pipeline.runner.PipelineRunner.scaled_loss`; the stage boundary tensors
    crossing to another pp rank are *measured* as sends (``sends``), a later stage's input is a fake tensor of the
    shape the first stage produced (``boundary``)."""
    from lightning_4d.pipeline.partition import stage_to_rank

    def run(runner: Any, args: tuple, target: Optional[torch.Tensor], losses: list, kwargs: dict) -> None:
        style = runner.info.style
        for sid, stage in zip(runner.stage_ids, runner.stages):
            if sid == 0:
                x: Any = args
            else:
                shape, dtype = boundary.get("shape"), boundary.get("dtype")
                if shape is None:  # no first stage traced: the formula's sequence shard
                    local = s // dims.cp
                    shape = (b, local // dims.tp if dims.sp else local, spec.hidden)
                    dtype = precision_info(precision).compute_dtype
                x = (torch.randn(*shape, dtype=dtype, requires_grad=True),)
            out = stage.submod(*x, **kwargs)
            if sid == 0:
                first = _leaves(out)[0]
                boundary.setdefault("shape", tuple(first.shape))
                boundary.setdefault("dtype", first.dtype)
            if sid == runner.num_stages - 1:
                loss = runner.scaled_loss(out, target)
                losses.append(loss)
                loss.backward()
            else:
                outs = [t for t in _leaves(out) if t.requires_grad]
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                if stage_to_rank(sid + 1, dims.pp, style) != pp_rank:
                    sends.extend(_measured_send(t) for t in outs)  # the boundary output
            if sid > 0 and stage_to_rank(sid - 1, dims.pp, style) != pp_rank:
                sends.append(_measured_send(x[0]))  # the boundary input's gradient

    return run
