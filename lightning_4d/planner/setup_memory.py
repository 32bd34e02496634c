"""Set-up memory per rank: what a rank holds while ``FourDStrategy`` builds its layout, before the first step.

A model built on the meta device (:mod:`lightning_4d.materialize.local_shards`) never exists whole on a rank, nor does any
tensor the rank does not keep. Set-up has two phases, one after the other, so its peak is the larger of:

- the value check on a reduced copy (:mod:`lightning_4d.layout.reduced_check`): the first block of each kind (dense
  and MoE layers) and of every pipeline stage, the vocabulary cut to ``16·tp`` rows, unsharded, plus its rewritten
  copy (about the same again: FSDP2 shards and TP slices are new tensors), within the check's budget
  (:func:`lightning_4d.layout.reduced_check.check_budget_bytes`, as the runtime computes it): in one pass, else in
  passes of one block (:func:`reduced_check_bytes`), else skipped;
- materialisation: the rank's share of the parameters (:func:`lightning_4d.planner.memory.memory_per_rank`'s
  ``params``) plus one chunk's scratch (:func:`setup_scratch_bytes`): each rank computes only its own elements,
  :data:`lightning_4d.materialize.init_pieces.CHUNK_ELEMENTS` at a time.

A model built for real instead holds every parameter on every rank first: :func:`setup_peak_bytes` with
``meta_built=False`` is the whole model (plus one 64 MB broadcast bucket).

Example:
    >>> from lightning_4d.planner.spec import TransformerSpec
    >>> spec = TransformerSpec(vocab_size=32000, hidden=768, layers=12, heads=12, ffn_hidden=2048)
    >>> largest_tensor_params(spec)
    24576000
"""

from __future__ import annotations

from typing import Optional

from lightning_4d.materialize import init_pieces
from lightning_4d.mesh import ParallelDims
from lightning_4d.layout.reduced_check import check_budget_bytes, reduced_copy_bytes
from lightning_4d.layout.reduced_copy import check_passes
from lightning_4d.pipeline.partition import partition_blocks
from lightning_4d.planner.spec import TransformerSpec

__all__ = ["largest_tensor_params", "reduced_check_bytes", "reduced_check_params", "setup_peak_bytes",
           "setup_scratch_bytes"]

_BUCKET = 64 << 20  # lightning_4d.core.distributed.broadcast_module_state's bucket


def largest_tensor_params(spec: TransformerSpec) -> int:
    """Elements of the largest single tensor of the unsharded model: the embedding / head ``V × h``, an MLP
    matrix, or a layer's stacked experts ``E × F × h`` (gated: ``2F``, as fused ``gate_up`` weights hold).

    Example:
        >>> largest_tensor_params(TransformerSpec(vocab_size=10, hidden=4, layers=1, heads=1, ffn_hidden=64))  # 2·64·4
        512
    """
    ffn = spec.ffn_hidden or 4 * spec.hidden
    sizes = [spec.vocab_size * spec.hidden, ffn * spec.hidden * (2 if spec.gated_mlp else 1)]
    if spec.num_experts:
        sizes.append(spec.num_experts * spec.expert_hidden * spec.hidden * (2 if spec.gated_mlp else 1))
    return max(sizes)


def setup_scratch_bytes(spec: TransformerSpec) -> int:
    """Bytes a rank holds beyond its share while it materialises a meta-built model: one chunk's working set
    (:func:`lightning_4d.materialize.init_pieces.scratch_bytes`), less for a model whose largest tensor is smaller than a chunk.

    Example:
        >>> spec = TransformerSpec(vocab_size=10, hidden=4, layers=1, heads=1, ffn_hidden=64)  # largest: 512 elements
        >>> setup_scratch_bytes(spec) == 512 * init_pieces.SCRATCH_BYTES_PER_ELEMENT
        True
    """
    return min(init_pieces.scratch_bytes(), largest_tensor_params(spec) * init_pieces.SCRATCH_BYTES_PER_ELEMENT)


def _reduced_check_parts(spec: TransformerSpec, dims: ParallelDims) -> tuple[int, dict[str, int]]:
    """``(elements outside the blocks, {layer: elements})`` of the reduced copy's real parts: the first layer of each
    kind (dense, MoE) and the first layer of every pipeline stage (:func:`~lightning_4d.layout.reduced_copy.
    kept_blocks`), an embedding (and untied head) of ``16·tp`` rows."""
    moe_ids = set(spec.moe_layer_ids)
    firsts = (next((i for i in range(spec.layers) if i not in moe_ids), None), min(moe_ids, default=None))
    starts = [part[0] for part in partition_blocks(spec.layers, dims.pp * dims.virtual_stages) if part]
    chosen = sorted({i for i in firsts if i is not None} | set(starts))
    rows = min(16 * dims.tp, spec.vocab_size)
    ends = rows * spec.hidden * (1 if spec.tied_embeddings else 2) + spec.learned_positions * spec.hidden
    return ends, {str(i): sum(spec.layer_params(i).values()) for i in chosen}


def reduced_check_params(spec: TransformerSpec, dims: ParallelDims) -> int:
    """Elements of the reduced copy :mod:`lightning_4d.layout.reduced_check` materialises in one pass: the first
    layer of each kind and of every pipeline stage, an embedding (and untied head) of ``16·tp`` rows. 0 without TP
    and PP.

    Example:
        >>> spec = TransformerSpec(vocab_size=32000, hidden=64, layers=8, heads=4, ffn_hidden=128)
        >>> reduced_check_params(spec, ParallelDims.from_world(4, tp=2, pp=2)) < spec.total_params()
        True
    """
    if dims.tp == 1 and dims.pp == 1:
        return 0
    ends, blocks = _reduced_check_parts(spec, dims)
    return ends + sum(blocks.values())


def reduced_check_bytes(spec: TransformerSpec, dims: ParallelDims, param_bytes: int, budget_bytes: float) -> float:
    """Peak bytes of the reduced check within ``budget_bytes``: all its blocks in one pass, else its largest pass of
    one block (:func:`~lightning_4d.layout.reduced_copy.check_passes`, the runtime's rule), else 0 (checked
    structurally only).

    Example:
        >>> spec = TransformerSpec(vocab_size=64, hidden=32, layers=4, heads=4)
        >>> dims = ParallelDims.from_world(4, tp=2, pp=2)
        >>> one = reduced_check_bytes(spec, dims, 4, 1e12)
        >>> one == reduced_copy_bytes(reduced_check_params(spec, dims) * 4), reduced_check_bytes(spec, dims, 4, 0.0)
        (True, 0.0)
    """
    if dims.tp == 1 and dims.pp == 1:
        return 0.0
    ends, blocks = _reduced_check_parts(spec, dims)
    passes = check_passes(float(ends * param_bytes), {k: float(v * param_bytes) for k, v in blocks.items()},
                          list(blocks), budget_bytes, reduced_copy_bytes(1.0))
    if passes is None:
        return 0.0
    return max(reduced_copy_bytes((ends + sum(blocks[k] for k in group)) * param_bytes) for group in passes)


def setup_peak_bytes(spec: TransformerSpec, dims: ParallelDims, share_bytes: float, param_bytes: int = 4,
                     meta_built: bool = True, largest_share_bytes: Optional[float] = None) -> float:
    """Peak bytes one rank holds during set-up (see the module docstring): ``share_bytes`` is the rank's
    parameters after sharding (``memory_per_rank(...)[r].params``); a meta-built model adds
    :func:`setup_scratch_bytes`. ``largest_share_bytes`` is the largest rank's share (default: this one's), which
    with the largest tensor sets the reduced check's budget as at run time
    (:func:`lightning_4d.layout.reduced_check.check_budget_bytes`): a check over it is skipped and adds nothing.

    Example:
        >>> spec = TransformerSpec(vocab_size=32000, hidden=768, layers=12, heads=12, ffn_hidden=2048)
        >>> dims = ParallelDims.from_world(8, tp=2, pp=2)
        >>> check = reduced_copy_bytes(reduced_check_params(spec, dims) * 4)  # within its budget: it runs
        >>> setup_peak_bytes(spec, dims, share_bytes=1e8) == max(1e8 + setup_scratch_bytes(spec), check)
        True
        >>> setup_peak_bytes(spec, ParallelDims.from_world(8), share_bytes=1e8) == 1e8 + setup_scratch_bytes(spec)
        True
        >>> setup_peak_bytes(spec, dims, 1e8, meta_built=False) >= spec.total_params() * 4
        True
    """
    whole = spec.total_params() * param_bytes
    largest = largest_tensor_params(spec) * param_bytes
    if not meta_built:
        held = whole + min(_BUCKET, whole)
        return max(held, reduced_check_bytes(spec, dims, param_bytes, check_budget_bytes(whole, 0.0)))
    materialise = share_bytes + setup_scratch_bytes(spec)
    budget = check_budget_bytes(share_bytes if largest_share_bytes is None else largest_share_bytes, largest)
    return max(materialise, reduced_check_bytes(spec, dims, param_bytes, budget))
