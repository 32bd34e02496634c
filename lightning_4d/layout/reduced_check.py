""""Sharded = unsharded" for a model that no rank holds: the set-up check on a reduced copy.

A model built on the meta device is rewritten and materialised shard by shard
(:mod:`lightning_4d.materialize.local_shards`), so the full-size check of :func:`lightning_4d.core.verify.check_tensor_parallel`
cannot run (there is no unsharded output to compare with). Instead :func:`check_reduced_model` materialises
a *reduced copy* of the unsharded model, small enough for one rank, and applies the very same plan to it
(:func:`lightning_4d.layout.parallelize.check_layout`, the plan's entries for the kept blocks), comparing the sharded
forward with the unsharded one on real values. It runs for every model (meta-built or not, MoE included) before
the real model is rewritten:

- depth: every position kept (:mod:`lightning_4d.layout.reduced_copy`): the first block of each distinct
  structure (:func:`~lightning_4d.layout.reduced_copy.block_signature`: sliding-window and global attention, MoE and
  dense layers are each represented) and the first block of every pipeline stage stay real at their own index
  (layer types, rotary tables, masks and per-layer inputs picked by position stay theirs); every other position
  holds a parameter-free stand-in that passes the hidden state on and answers for every other argument it gets;
- width: unchanged (head counts, fused projections, norms and the TP styles are what is checked);
- vocabulary: every ``nn.Embedding`` (per-layer input tables included) and every linear layer producing as many
  features as an embedding has rows (the head) cut to ``16 · tp`` rows, when the model's forward still runs that
  way (else kept);
- values: parameters drawn element by element from a fixed seed (:func:`perturb_`: identical initial values —
  norms of ones, zero biases — cannot hide a rewrite that mixes heads or drops a sum, and the check does not
  depend on the model's initialisers); buffers (masks, rotary tables) from the model itself when it was built
  for real, else from its initialisers.

Memory: the copy's modules outside the blocks (vocabulary cut) and its kept blocks, unsharded, plus its rewritten
copy, before this rank's shards exist (so the set-up peak is the larger of the two, not their sum), within a
budget (:func:`check_budget_bytes`: by default this rank's share plus the largest tensor, at least 256 MiB; the
planner's set-up term counts it). A copy over the budget is checked in passes of one kept block each
(:func:`~lightning_4d.layout.reduced_copy.check_passes`: a 100 B+ model's blocks are value-checked one at a time);
only a model one of whose blocks alone exceeds the budget is checked structurally only, with a warning saying so
and how to force the value check (``FourDStrategy(reduced_check_budget=...)``). What is checked at full size, on
the meta device: the trace, the block discovery, the pipeline split and every rewrite's structural rules
(divisibility, head counts, tied weights, expert placement).

Example:
    >>> # not run: needs a process group
    >>> check_reduced_model(skeleton, plan, mesh)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from lightning_4d._compat import meta_scalar_mode, to_empty_keeping_ties
from lightning_4d.core.comm import internal_comm
from lightning_4d.analysis.hooks import PIPELINE_PRE, PIPELINE_SPLIT, user_hook
from lightning_4d.materialize.local_shards import materialize, module_copy
from lightning_4d.mesh import FourDMesh, ParallelDims
from lightning_4d.plan import LayoutPlan
from lightning_4d.layout.parallelize import check_layout
from lightning_4d.layout.reduced_copy import (
    block_signature,
    check_passes,
    distinct_blocks,
    kept_blocks,
    plan_for_kept,
    stand_in_blocks,
)
from lightning_4d.analysis.trace import HiddenArg
from lightning_4d.analysis.trace import _opaque_moe_on_meta as opaque_moe_on_meta
from lightning_4d.analysis.trace import example_tokens

__all__ = ["CHECK_FLOOR_BYTES", "block_signature", "check_budget_bytes", "check_reduced_model", "perturbed_copy",
           "plan_share_bytes", "reduce_depth", "reduce_vocabulary", "perturb_", "reduced_copy_bytes"]

log = logging.getLogger(__name__)

_SEED = 20240917  # the reduced copy's values: fixed, identical on every rank
CHECK_FLOOR_BYTES = 256 << 20  # the reduced check may always use this much (small models: always checked)


def check_budget_bytes(share_bytes: float, largest_bytes: float) -> float:
    """Bytes the reduced check may hold by default: this rank's share plus the largest single tensor in full (a
    bound set-up may reach for the check's sake; materialisation itself needs only the share plus a chunk of
    scratch), at least :data:`CHECK_FLOOR_BYTES`; the one rule the runtime and the planner
    (:mod:`lightning_4d.planner.setup_memory`) both use.

    Example:
        >>> check_budget_bytes(1e9, 5e8) == 1.5e9, check_budget_bytes(0, 0) == CHECK_FLOOR_BYTES
        (True, True)
    """
    return max(float(CHECK_FLOOR_BYTES), share_bytes + largest_bytes)


def reduced_copy_bytes(model_bytes: float) -> float:
    """Bytes the check holds for a reduced copy of ``model_bytes`` (parameters and buffers): the unsharded copy
    and its rewritten one.

    Example:
        >>> reduced_copy_bytes(100.0)
        200.0
    """
    return 2.0 * model_bytes


def reduce_depth(model: nn.Module, blocks_path: str, keep: int) -> list[int]:
    """Keep, in place, the first block of every distinct :func:`block_signature` and then the earliest others
    until ``keep`` blocks remain (fewer when there are fewer), in their original order; returns the kept
    indices. (The set-up check keeps every position instead: :mod:`lightning_4d.layout.reduced_copy`.)

    Example:
        >>> net = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 3), nn.Linear(3, 2)]))
        >>> reduce_depth(net, "0", 1), len(net[0])
        ([0, 2, 3], 3)
    """
    container = model.get_submodule(blocks_path)
    blocks = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
    chosen = distinct_blocks(blocks)
    for i in range(len(blocks)):
        if len(chosen) >= keep:
            break
        if i not in chosen:
            chosen.append(i)
    chosen.sort()
    if isinstance(container, nn.ModuleDict):
        keys = list(container.keys())
        for i, key in enumerate(keys):
            if i not in chosen:
                del container[key]
    else:
        kept = [blocks[i] for i in chosen]
        del container[:]
        container.extend(kept)
    return chosen


def reduce_vocabulary(model: nn.Module, rows: int, blocks_path: str = "") -> int:
    """Cut every ``nn.Embedding`` with more than ``rows`` rows, and every ``nn.Linear`` outside the blocks (at
    ``blocks_path``) whose ``out_features`` equals such an embedding's row count (the head), to ``rows`` (meta
    tensors; ties kept). Returns the original vocabulary size (0 when nothing was cut).

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(nn.Embedding(100, 4), nn.Linear(4, 100))
        >>> reduce_vocabulary(net, 8), tuple(net[1].weight.shape)
        (100, (8, 4))
    """
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings > rows]
    sizes = {m.num_embeddings for m in tables}
    if not tables:
        return 0
    new: dict[int, nn.Parameter] = {}

    def cut(p: nn.Parameter) -> nn.Parameter:
        if id(p) not in new:
            new[id(p)] = nn.Parameter(torch.empty((rows,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device),
                                      requires_grad=p.requires_grad)
        return new[id(p)]

    for m in tables:
        m.weight = cut(m.weight)
        m.num_embeddings = rows
        if m.padding_idx is not None and m.padding_idx >= rows:
            m.padding_idx = rows - 1
    inside = f"{blocks_path}." if blocks_path else None
    for name, m in model.named_modules():
        if inside is not None and (name + ".").startswith(inside):
            continue
        if type(m) is nn.Linear and m.out_features in sizes:
            m.weight = cut(m.weight)
            if m.bias is not None:
                m.bias = cut(m.bias)
            m.out_features = rows
    return max(sizes)


@torch.no_grad()
def perturb_(model: nn.Module, generator: torch.Generator) -> None:
    """Give every floating-point parameter fresh values from ``generator``, element by element: weights
    ``N(0, 1/fan_in)`` (fan-in: the last dimension), vectors ``1 + 0.2·N(0, 1)`` (norm weights and biases no
    longer all equal). The check then depends on neither the model's initialisers nor their symmetries.

    Example:
        >>> net = nn.LayerNorm(4); perturb_(net, torch.Generator().manual_seed(0))
        >>> bool((net.weight != 1).all()), len(set(net.weight.tolist()))
        (True, 4)
    """
    for p in model.parameters():
        if not p.is_floating_point() or not p.numel():
            continue
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
        value = 1.0 + 0.2 * noise if p.dim() == 1 else noise / max(p.shape[-1], 1) ** 0.5
        p.copy_(value.to(p.device, p.dtype))


def _fill(model: nn.Module, device: torch.device, buffers: Optional[dict[str, torch.Tensor]]) -> None:
    """Materialise the reduced copy: buffers from the model built for real (``buffers``) or, for a meta-built
    one, from its initialisers (masks, rotary tables); parameters drawn by :func:`perturb_` either way."""
    if buffers is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SEED)
            materialize(model, device, pretrained=False)  # shapes are reduced: the files do not fit
    else:
        to_empty_keeping_ties(model, device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers and tuple(buffers[name].shape) == tuple(b.shape):
                    b.copy_(buffers[name])
    perturb_(model, torch.Generator().manual_seed(_SEED))


def perturbed_copy(skeleton: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``skeleton`` (the unsharded model on the meta device) built for real on ``device``: buffers from
    its initialisers, parameters from :func:`perturb_` (the context-parallel set-up check of a meta-built model
    reads its masks there; the caller checks its size against a budget first).

    Example:
        >>> copy = perturbed_copy(nn.Linear(2, 2, device="meta"), torch.device("cpu"))
        >>> copy.weight.is_meta
        False
    """
    clone = module_copy(skeleton)
    _fill(clone, device, None)
    return clone


def _forward_runs(model: nn.Module, tp: int) -> bool:
    """Whether ``model`` (on the meta device) still runs a forward on an example: shapes only (MoE layers pass
    their input through, as in the trace)."""
    opaque = opaque_moe_on_meta(model)
    try:
        with torch.no_grad(), meta_scalar_mode():
            example = example_tokens(model, tp)
            model(*(example if isinstance(example, tuple) else (example,)))
        return True
    except Exception:  # noqa: BLE001 - any failure means: keep the full vocabulary
        return False
    finally:
        for mod in opaque:
            del mod.forward


def check_reduced_model(skeleton: nn.Module, plan: LayoutPlan, mesh: FourDMesh,
                        accumulate: int = 1, device: Optional[torch.device] = None,
                        buffers: Optional[dict[str, torch.Tensor]] = None,
                        budget_bytes: Optional[float] = None) -> Optional[str]:
    """Apply ``plan`` (its entries for the stood-in blocks dropped: :func:`~lightning_4d.layout.reduced_copy.
    plan_for_kept`, no second trace) to a reduced, perturbed copy of ``skeleton`` (the unsharded model on the meta
    device; left unchanged) whose kept blocks stay at their own positions, and compare its forward with the
    unsharded one (:func:`~lightning_4d.layout.parallelize.check_layout`). Collective over ``tp``; run before the
    real model is rewritten. ``buffers``: the values of the model's buffers by name when it was built for real
    (else its initialisers make them). Returns a one-line description of what was checked, or ``None`` when nothing
    needed checking (no TP, no PP). ``budget_bytes``: the copy checks its kept blocks in passes of one block when all
    of them would hold more (:func:`~lightning_4d.layout.reduced_copy.check_passes`), and is skipped with a warning
    only when one block alone would; ``None``: no limit.

    Raises:
        ValueError: from the rewrite's checks, naming the module whose sharded forward differs.
    """
    dims = mesh.dims
    if dims.tp == 1 and dims.pp == 1:
        return None
    device = device or torch.device("cpu")
    clone = module_copy(skeleton)
    blocks_path = plan.blocks_path
    container = clone.get_submodule(blocks_path)
    children = dict(container.named_children())
    keys = list(children)
    uses_hooks = any(user_hook(clone, h) for h in (PIPELINE_SPLIT, PIPELINE_PRE))
    starts = [keys.index(stage[0]) for stage in plan.stages if stage and stage[0] in children]
    kept = keys if uses_hooks else [keys[i] for i in kept_blocks(list(children.values()), starts)]
    vocab_rows = 16 * dims.tp
    trial = module_copy(clone)
    vocab = reduce_vocabulary(trial, vocab_rows, blocks_path)
    if vocab:  # does the forward still run with the cut vocabulary? Shapes only: on the meta device
        if _forward_runs(trial, dims.tp):
            reduce_vocabulary(clone, vocab_rows, blocks_path)
        else:
            vocab = 0
    del trial
    inside = {id(t) for b in children.values() for t in [*b.parameters(), *b.buffers()]}
    outside = sum(_bytes(t) for t in _unique(clone) if id(t) not in inside)
    per_block = {k: float(sum(_bytes(t) for t in _unique(children[k]))) for k in keys}
    passes = check_passes(float(outside), per_block, kept, budget_bytes, reduced_copy_bytes(1.0))
    if passes is None:
        need = reduced_copy_bytes(outside + max(per_block[k] for k in kept))
        what = (f"rewrite checked structurally only (trace, block discovery, pipeline split, every rewrite's "
                f"shape rules on the meta device): the value check on a reduced copy would hold {need / 2**20:.0f} "
                f"MiB with one block ({max(kept, key=lambda k: per_block[k])}) of {len(keys)}, over its budget of "
                f"{budget_bytes / 2**20:.0f} MiB")
        log.warning("lightning_4d: %s. To check values anyway, pass FourDStrategy(reduced_check_budget=<bytes>) "
                    "with room for it.", what)
        return what
    ran = _check_passes(clone, plan, mesh, accumulate, device, buffers, passes, keys)
    where = (f"blocks {ran} of {len(keys)} at their own positions (stand-ins at the others)"
             if len(passes) == 1 else
             f"blocks {ran} of {len(keys)} in {len(passes)} passes of one block (all of them at once would exceed "
             f"the budget of {budget_bytes / 2**20:.0f} MiB; stand-ins at the other positions)")
    what = (f"rewrite checked on a reduced copy: {where}"
            f"{f', vocabulary {vocab_rows} of {vocab}' if vocab else ''}, perturbed weights")
    log.info("lightning_4d: %s", what)
    return what


def _check_passes(clone: nn.Module, plan: LayoutPlan, mesh: FourDMesh, accumulate: int, device: torch.device,
                  buffers: Optional[dict[str, torch.Tensor]], passes: list[list[str]], keys: list[str]) -> list[str]:
    r"""Run the value check once per pass, each on its own copy of ``clone`` (consumed) with the pass's blocks real
    and :class:`~lightning_4d.layout.reduced_copy.StandIn`\s elsewhere; returns the blocks checked. A model whose
    forward cannot run with stand-ins (its loop reads a skipped block's internals) is checked with every block."""
    hidden = HiddenArg(*plan.hidden)
    checked: list[str] = []
    runs: Optional[bool] = None  # whether the whole copy's forward runs on the meta device (shapes only)
    for group in passes:
        copy = module_copy(clone)  # free: on the meta device
        stand_in_blocks(copy, plan.blocks_path, set(group), hidden, plan.block_attrs)
        if len(group) < len(keys) and not _forward_runs(copy, mesh.dims.tp) and (
                runs := _forward_runs(clone, mesh.dims.tp) if runs is None else runs):
            copy, group = clone, keys  # stand-ins break its forward: every block, at the cost of memory
            log.warning("lightning_4d: %s cannot run its forward with stand-ins for the blocks the value check "
                        "leaves out; it checks every block instead", type(clone).__name__)
        _fill(copy, device, buffers)
        with internal_comm():  # a set-up check, not the training step's communication
            check_layout(copy, plan_for_kept(plan, group), mesh, accumulate=accumulate)
        checked += group
        del copy
        if group is keys:
            break
    return [k for k in keys if k in set(checked)]


def _unique(module: nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_SHARDING = ("Colwise", "Rowwise", "ColwiseParallel", "RowwiseParallel")  # styles that split a module's weights


def plan_share_bytes(model: nn.Module, plan: LayoutPlan, dims: ParallelDims) -> float:
    """Bytes of the largest rank's share of ``model`` (on the meta device) under ``plan``, from the plan alone
    (before anything is rewritten): weights of a sharding TP style ÷ tp, experts ÷ ep, the largest pipeline
    stage's blocks plus everything outside the blocks, then ÷ the data-parallel sharding (FSDP2 over dp × cp, HSDP
    over dp_shard (× cp), experts over edp). What the check's default budget starts from
    (:func:`check_budget_bytes`).

    Example:
        >>> from lightning_4d.mesh import ParallelDims
        >>> net = nn.Sequential(nn.ModuleList([nn.Linear(4, 4, bias=False)]))
        >>> plan = LayoutPlan(degrees=(), blocks_path="0", block_order=("0",))
        >>> plan_share_bytes(net, plan, ParallelDims(world_size=2, dp=2))
        32.0
    """
    tpl = plan.tensor_parallel
    sharded = {p for p, s in tpl.styles.items() if s.kind in _SHARDING} if tpl is not None else set()
    experts = tuple(e.path + "." for e in plan.experts)
    stage_of = {f"{plan.blocks_path}.{k}.": s for s, keys in enumerate(plan.stages) for k in keys}
    per_stage = [0.0] * max(1, len(plan.stages))
    outside = 0.0
    dense_dp = 1 if plan.data_parallel == "replicate" else (dims.dp_shard * dims.cp if dims.dp_shard else dims.dp_cp)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        size = float(t.numel() * t.element_size())
        if name.rpartition(".")[0] in sharded:
            size /= dims.tp
        size /= (dims.ep * dims.edp) if name.startswith(experts) else dense_dp
        stage = next((s for prefix, s in stage_of.items() if name.startswith(prefix)), None)
        if stage is None:
            outside += size
        else:
            per_stage[stage] += size
    return outside + max(per_stage)
