"""Weights tied between the first and the last pipeline stage (GPT-2: embedding = output head).

Before splitting, one ``Parameter`` object is used by a pre-module (stage 0) and a post-module
(last stage). After :func:`~lightning_4d.pipeline.stages.build_pipeline_stages` each owning rank
keeps its own copy (same initial values, since every rank builds the same full model); each copy
only receives the gradient of its own use. :func:`sync_tied_grads` sums the two gradients between
the two owning ranks after backward, so both copies take the identical optimizer step and stay
tied. With the ``"v"`` placement (ZBV, DualPipeV) stage 0 and the last stage share rank 0, the
tie is intact and nothing needs to be done.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(); net.add_module("emb", nn.Embedding(5, 2))
    >>> net.add_module("layers", nn.ModuleList([nn.Linear(2, 2)])); net.add_module("head", nn.Linear(2, 5))
    >>> net.head.weight = net.emb.weight
    >>> from lightning_4d.pipeline.stages import find_pipeline_split
    >>> find_tied_parameters(net, find_pipeline_split(net))
    [('emb.weight', 'head.weight')]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from lightning_4d._compat import registered_submodule
from lightning_4d.core.distributed import local_of

from lightning_4d.pipeline.partition import PipelineSplit

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["check_shared_blocks", "find_tied_parameters", "sync_tied_grads"]


def find_tied_parameters(root: nn.Module, split: PipelineSplit,
                         stage_of: Optional[dict[str, int]] = None) -> list[tuple[str, str]]:
    """Pairs ``(pre_name, post_name)`` of one ``Parameter`` object used by a pre- and a post-module.

    A module reused at several depths (Zamba2's shared transformer block, its weights shared by several blocks) is
    kept where all its uses land on one stage (``stage_of``: block key -> stage; without it, blocks sharing weights
    count as on different stages): that stage holds the one weight. Raises ``ValueError`` otherwise, and for a block
    sharing a weight with a module outside the blocks (see :func:`check_shared_blocks`).

    Example:
        >>> net = nn.Sequential(); net.add_module("emb", nn.Embedding(5, 2))
        >>> net.add_module("layers", nn.ModuleList([nn.Linear(2, 2)])); net.add_module("head", nn.Linear(2, 5))
        >>> net.head.weight = net.emb.weight
        >>> from lightning_4d.pipeline.stages import find_pipeline_split
        >>> find_tied_parameters(net, find_pipeline_split(net))
        [('emb.weight', 'head.weight')]
    """
    check_shared_blocks(root, split.blocks_path, split.block_keys, stage_of, tuple(split.pre) + tuple(split.post))

    def params(paths: Sequence[str]) -> dict[int, str]:
        out: dict[int, str] = {}
        for path in paths:
            mod = registered_submodule(root, path)
            if mod is not None:
                for n, p in mod.named_parameters(remove_duplicate=False):
                    out.setdefault(id(p), f"{path}.{n}")
        return out

    pre, post = params(split.pre), params(split.post)
    return [(pre[pid], post[pid]) for pid in pre if pid in post]


def check_shared_blocks(root: nn.Module, blocks_path: str, block_keys: Sequence[str],
                        stage_of: Optional[dict[str, int]] = None, outside: Sequence[str] = ()) -> None:
    """Refuse weights a block shares with a block of another pipeline stage (``stage_of``: block key -> stage;
    ``None``: every block its own stage) or with a module outside the blocks (``outside``), naming the module, the
    rule and the fix (pure; identical on every rank).

    Example:
        >>> net = nn.Sequential(); net.add_module("layers", nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> net.layers[1].weight = net.layers[0].weight
        >>> check_shared_blocks(net, "layers", ["0", "1"], {"0": 0, "1": 0})  # both uses on stage 0: fine
    """
    owner: dict[int, tuple[str, str]] = {}  # parameter id -> (first block key, its name there)
    for path in outside:
        mod = registered_submodule(root, path)
        for n, p in (mod.named_parameters(remove_duplicate=False) if mod is not None else ()):
            owner.setdefault(id(p), ("", f"{path}.{n}"))
    stage = (lambda k: stage_of.get(k, -1)) if stage_of is not None else (lambda k: k)  # noqa: E731
    for key in block_keys:
        block = registered_submodule(root, f"{blocks_path}.{key}")
        if block is None:
            continue
        for name, p in block.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (key, f"{blocks_path}.{key}.{name}"))
            if first[0] == key or (first[0] and stage(first[0]) == stage(key)):
                continue
            if not first[0]:
                raise ValueError(
                    f"{type(root).__name__}: parameter {blocks_path}.{key}.{name} is shared with {first[1]}; weights "
                    f"tied to a block cannot be split across pipeline stages. Untie them or use pp=1."
                )
            module = _shared_module(block, {i for i, (k, _) in owner.items() if k == first[0]})
            where = (f"stages {stage(first[0])} and {stage(key)}" if stage_of is not None
                     else "different pipeline stages")
            raise ValueError(
                f"{type(root).__name__}: {blocks_path}.{key}.{module} is a module reused at several depths: its "
                f"weights ({blocks_path}.{key}.{name} = {first[1]}) are shared by blocks {first[0]} and {key} of "
                f"{blocks_path}, which land on {where}. Rule: a module reused at several depths is kept whole on one "
                f"stage, so all the blocks that use it must land on the same stage. Fix: a pp (and layer split) that "
                f"puts blocks {first[0]}..{key} on one stage, or pp=1 (tensor, data and expert parallelism do not "
                f"split it)."
            )


def _shared_module(block: nn.Module, shared: set[int]) -> str:
    """The outermost module of ``block`` whose parameters are all in ``shared`` (the reused module's path)."""
    for name, mod in block.named_modules():
        params = [id(p) for p in mod.parameters()]
        if name and params and all(i in shared for i in params):
            return name
    return "(a parameter)"


def sync_tied_grads(
    model: nn.Module,
    tied: Sequence[tuple[str, str]],
    pp_group: Optional["dist.ProcessGroup"],
    first_rank: int,
    last_rank: int,
) -> None:
    """Sum the gradients of tied first/last-stage parameters between their two owning pp ranks.

    Call after the pipeline backward (every pp rank may call it; ranks that own neither copy return
    at once). ``first_rank`` / ``last_rank`` are the pp-group ranks holding stage 0 and the last
    stage; if they are equal the tie is local and nothing happens. A missing gradient counts as zero.

    Args:
        model: the pruned model (names as in ``tied``).
        tied: ``(pre_name, post_name)`` pairs from :func:`find_tied_parameters`.
        pp_group: the pipeline process group.
        first_rank / last_rank: group ranks of the stage-0 and last-stage owners.

    Example:
        >>> # not run: needs a process group
        >>> sync_tied_grads(model, parts.tied, pp_group, 0, 3)  # doctest: +SKIP
    """
    import torch.distributed as dist

    if not tied or first_rank == last_rank:
        return
    me = dist.get_rank(pp_group)
    if me not in (first_rank, last_rank):
        return
    names = [pre if me == first_rank else post for pre, post in tied]
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"tied parameter(s) {missing} are not on pp rank {me}; was the model pruned for this rank?")
    plist = [params[n] for n in names]
    for p in plist:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif hasattr(p.grad, "placements") and p.grad.placements != p.placements:
            # e.g. a vocab-parallel embedding's gradient comes back replicated: lay it out like the weight
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    # Local shards (DTensor under TP / FSDP): both copies are laid out identically on their meshes.
    grads = [local_of(p.grad) for p in plist]
    flat = torch.cat([g.reshape(-1) for g in grads])
    other = torch.empty_like(flat)
    peer = last_rank if me == first_rank else first_rank
    ops = [dist.P2POp(dist.isend, flat, group=pp_group, group_peer=peer),
           dist.P2POp(dist.irecv, other, group=pp_group, group_peer=peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    # Same operands on both ranks (a + b == b + a in IEEE), so both copies get identical gradients.
    total = flat + other
    offset = 0
    for g in grads:
        n = g.numel()
        with torch.no_grad():
            g.copy_(total[offset:offset + n].view_as(g))
        offset += n
