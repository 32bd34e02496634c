""""Sharded = unsharded" for a model that no rank holds: the set-up check on a reduced copy.

A model built on the meta device is rewritten and materialised shard by shard
(:mod:`lightning_4d.materialize.local_shards`), so the full-size check of :func:`lightning_4d.core.verify.check_tensor_parallel`
cannot run (there is no unsharded output to compare with). Instead :func:`check_reduced_model` materialises
a *reduced copy* of the unsharded model, small enough for one rank, and applies the very same plan to it
(:func:`lightning_4d.layout.parallelize.check_layout`, the plan filtered to the kept blocks), comparing the sharded
forward with the unsharded one on real values. It runs for every model (meta-built or not, MoE included) before
the real model is rewritten:

- depth: the first block of each distinct structure (:func:`block_signature`: sliding-window and global
  attention, MoE and dense layers are each represented), then the earliest others up to ``pp ·
  virtual_stages`` blocks (one per pipeline stage);
- width: unchanged (head counts, fused projections, norms and the TP styles are what is checked);
- vocabulary: every ``nn.Embedding`` and every linear layer producing as many features as an embedding has
  rows (the head) cut to ``16 · tp`` rows, when the model's forward still runs that way (else kept);
- values: parameters drawn element by element from a fixed seed (:func:`perturb_`: identical initial values —
  norms of ones, zero biases — cannot hide a rewrite that mixes heads or drops a sum, and the check does not
  depend on the model's initialisers); buffers (masks, rotary tables) from the model itself when it was built
  for real, else from its initialisers.

Memory: the copy's embedding, head and ``pp · v`` blocks, unsharded, plus its rewritten copy, before this rank's
shards exist (so the set-up peak is the larger of the two, not their sum). The copy runs only if that fits a
budget (:func:`check_budget_bytes`: by default this rank's share plus the largest tensor, at least 256 MiB; the
planner's set-up term counts it where it runs): a model whose blocks are too wide
for it (``pp · v`` unsharded blocks of a 100 B+ model) is checked structurally only, with a warning saying so and
how to force the value check (``FourDStrategy(reduced_check_budget=...)``). What is checked at full size instead, on the meta device: the trace,
the block discovery, the pipeline split and every rewrite's structural rules (divisibility, head counts,
tied weights, expert placement).

Example:
    >>> # not run: needs a process group
    >>> check_reduced_model(skeleton, plan, mesh)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch
from torch import nn

from lightning_4d._compat import meta_scalar_mode, own_tensors, to_empty_keeping_ties
from lightning_4d.core.comm import internal_comm
from lightning_4d.analysis.hooks import PIPELINE_PRE, PIPELINE_SPLIT, user_hook
from lightning_4d.materialize.local_shards import materialize, module_copy
from lightning_4d.mesh import FourDMesh, ParallelDims
from lightning_4d.plan import LayoutPlan
from lightning_4d.layout.parallelize import check_layout
from lightning_4d.pipeline.partition import partition_blocks
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


def block_signature(block: nn.Module, ignore: frozenset[str] = frozenset()
                    ) -> tuple[tuple[str, Union[str, tuple[int, ...], int, float, bool]], ...]:
    """What makes two blocks rewrite differently: every submodule's name and type, every tensor's name and
    shape, and the plain (int / float / str / bool) attributes of every submodule (sliding windows, attention
    types, MoE or dense), as a hashable tuple; attribute keys in ``ignore`` (per-layer indices) left out.

    Example:
        >>> block_signature(nn.Linear(2, 3)) == block_signature(nn.Linear(2, 3)), block_signature(nn.Linear(2, 4))[0]
        (True, ('', 'Linear'))
    """
    parts: list[tuple[str, Union[str, tuple[int, ...], int, float, bool]]] = []
    for name, mod in block.named_modules():
        parts.append((name, type(mod).__name__))
        parts += [(f"{name}.{k}", tuple(t.shape)) for k, t, _ in own_tensors(mod) if t is not None]
        parts += [(key, v) for key, v in _plain_attributes(name, mod) if key not in ignore]
    return tuple(parts)


def _plain_attributes(name: str, mod: nn.Module) -> list[tuple[str, Union[int, float, str, bool]]]:
    return [(f"{name}.{k}", v) for k, v in sorted(vars(mod).items())
            if not k.startswith("_") and k != "training" and isinstance(v, (int, float, str, bool))]


def _index_attributes(blocks: list[nn.Module]) -> frozenset[str]:
    """Attribute keys whose value differs in every block (a layer index, a depth-scaled init std): left out of
    the signatures, or every block would count as distinct."""
    values: dict[str, set[Union[int, float, str, bool]]] = {}
    for block in blocks:
        for name, mod in block.named_modules():
            for key, v in _plain_attributes(name, mod):
                values.setdefault(key, set()).add(v)
    return frozenset(k for k, v in values.items() if len(blocks) > 1 and len(v) == len(blocks))


def reduce_depth(model: nn.Module, blocks_path: str, keep: int) -> list[int]:
    """Keep, in place, the first block of every distinct :func:`block_signature` and then the earliest others
    until ``keep`` blocks remain (fewer when there are fewer), in their original order; returns the kept
    indices.

    Example:
        >>> net = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 3), nn.Linear(3, 2)]))
        >>> reduce_depth(net, "0", 1), len(net[0])
        ([0, 2, 3], 3)
    """
    container = model.get_submodule(blocks_path)
    blocks = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
    chosen: list[int] = []
    seen: set[tuple[tuple[str, Union[str, tuple[int, ...], int, float, bool]], ...]] = set()
    ignore = _index_attributes(blocks)
    for i, block in enumerate(blocks):
        sig = block_signature(block, ignore)
        if sig not in seen:
            seen.add(sig)
            chosen.append(i)
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
    """Apply ``plan`` (filtered to the kept blocks: :meth:`~lightning_4d.plan.LayoutPlan.for_blocks`, no second
    trace) to a reduced, perturbed copy of ``skeleton`` (the unsharded model on the meta device; left unchanged) and
    compare its forward with the unsharded one (:func:`~lightning_4d.layout.parallelize.check_layout`). Collective over
    ``tp``; run before the real model is rewritten. ``buffers``: the
    values of the model's buffers by name when it was built for real (else its initialisers make them).
    Returns a one-line description of what was checked, or ``None`` when nothing needed checking (no TP, no PP).
    ``budget_bytes``: skip the value check (with a warning) when the reduced copy would hold more
    (:func:`reduced_copy_bytes`); ``None``: no limit.

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
    keys = [k for k, _ in container.named_children()]
    depth = len(keys)
    keep = max(1, dims.pp * dims.virtual_stages)
    uses_hooks = any(user_hook(clone, h) for h in (PIPELINE_SPLIT, PIPELINE_PRE))
    kept = reduce_depth(clone, blocks_path, keep) if not uses_hooks else list(range(depth))
    listed = not isinstance(container, nn.ModuleDict)  # a list's kept blocks are renumbered from 0
    renamed = {keys[i]: (str(j) if listed else keys[i]) for j, i in enumerate(kept)}
    reduced = plan.for_blocks([k for k in plan.block_order if k in renamed], renamed,
                              partition_blocks(len(kept), keep)) if len(kept) < depth else plan
    vocab_rows = 16 * dims.tp
    trial = module_copy(clone)
    vocab = reduce_vocabulary(trial, vocab_rows, blocks_path)
    if vocab:  # does the forward still run with the cut vocabulary? Shapes only: on the meta device
        if _forward_runs(trial, dims.tp):
            reduce_vocabulary(clone, vocab_rows, blocks_path)
        else:
            vocab = 0
    del trial
    tensors = {id(t): t for t in [*clone.parameters(), *clone.buffers()]}.values()
    need = reduced_copy_bytes(sum(t.numel() * t.element_size() for t in tensors))
    if budget_bytes is not None and need > budget_bytes:
        what = (f"rewrite checked structurally only (trace, block discovery, pipeline split, every rewrite's "
                f"shape rules on the meta device): the value check on a reduced copy (blocks {kept} of {depth}) "
                f"would hold {need / 2**20:.0f} MiB, over its budget of {budget_bytes / 2**20:.0f} MiB")
        log.warning("lightning_4d: %s. To check values anyway, pass FourDStrategy(reduced_check_budget=<bytes>) "
                    "with room for it, or run the same layout once on a model with the same block types and "
                    "fewer layers.", what)
        return what
    _fill(clone, device, buffers)
    with internal_comm():  # a set-up check, not the training step's communication
        check_layout(clone, reduced, mesh, accumulate=accumulate)
    what = (f"rewrite checked on a reduced copy: blocks {kept} of {depth}"
            f"{f', vocabulary {vocab_rows} of {vocab}' if vocab else ''}, perturbed weights")
    log.info("lightning_4d: %s", what)
    del clone
    return what


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
