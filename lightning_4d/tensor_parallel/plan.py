r"""Automatic tensor/sequence-parallel plans from module names (pure: no process group).

What is recognised, by name where a convention exists and by dataflow otherwise (the
:class:`~lightning_4d.analysis.trace.ModelTrace` of one forward):

- column-parallel (output features split): ``wq wk wv`` / ``q_proj k_proj v_proj`` / ``c_attn`` / ``wqkv``,
  ``w1 w3`` / ``gate_proj up_proj`` / ``c_fc``, and any linear that reads its region's input;
  ``nn.Linear`` (and its subclasses, e.g. TorchTitan's) or transformers' ``Conv1D``. The trace follows each
  projection's output through ``split`` / ``chunk`` / slices (``qkv[..., :n_q]``) and per-head ``view``\s
  (:class:`~lightning_4d.analysis.trace.ColumnLayout`): a fused projection cut into pieces (concatenated ``q|k|v``,
  ``gate|up``) gets its rows permuted so that each rank holds ``q_r|k_r|v_r``; one viewed per head or per KV group
  (interleaved) is sharded as it is; heads fewer than ``tp`` (one KV head, multi-query) are replicated: the
  weight stays whole and each rank computes the KV head its query heads use (:class:`Piece`);
- row-parallel (input features split, one reduction): ``wo`` / ``o_proj`` / ``w2`` / ``down_proj`` /
  ``c_proj``, or the last linear its region calls;
- a region (gathered input, one reduction) is the smallest module holding a row-parallel linear and the
  column-parallel ones that feed it (TorchTitan's ``attention.qkv_linear.wqkv`` and ``attention.wo``: the
  ``attention``); linears held by the block itself (OPT's ``fc1`` / ``fc2``) gather and scatter their own tokens;
- head counts, cut widths and group ratios the region reads from attributes (``num_heads``, ``split_size``,
  ``num_key_value_groups``) or from its ``config`` (``config.num_attention_heads``: a per-region copy) become
  per-rank values;
- per-head parameters and module lists inside a region (attention sinks, StableLM's ``norms`` zipped with the
  heads, per-head ``q_norm`` / ``k_norm``) are used per rank on that rank's heads, their gradients summed over
  ``tp``; a norm over the full width of one projection (OLMo 2's ``q_norm``) runs distributed;
- state-space and short-convolution mixers (Mamba-2, LFM2): a projection's features followed through a depthwise
  convolution (``groups == channels``), whose channels are cut with them; group counts and convolved widths per
  rank; a gated norm over the inner width per group or distributed (:mod:`lightning_4d.tensor_parallel.mixers`);
- norms (``LayerNorm``, ``RMSNorm``) directly inside a block: sequence-parallel (also on a region's output:
  Gemma's sandwich norms); on flattened tokens ``(B·T, H)``: run locally, gradients summed;
- the token embedding (the first ``nn.Embedding`` to run): vocab-parallel; the output head (the last
  linear to run after the blocks): column-parallel, with a parallel cross-entropy (``loss_parallel``).

Anything else with parameters inside a region is refused at set-up, naming the module, the cause and the fix.

Every block becomes the Megatron pattern: all-gather (SP) → column → local math → row →
reduce-scatter (SP), or one all-reduce per attention and per MLP without SP.

Example:
    >>> from lightning_4d.models import Llama, LlamaConfig
    >>> m = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4))
    >>> sorted(block_plan(m.layers[0], "layers.0", tp=2).linears.items())[:2]
    [('attention.wk', 'colwise'), ('attention.wo', 'rowwise')]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from lightning_4d.analysis.head_bias import ArgKey
from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.analysis.layer_kinds import holds_routed_experts, is_linear, is_norm
from lightning_4d.core.precision import allowed_difference, max_difference
from lightning_4d.tensor_parallel.block_inputs import feature_cuts, feature_gates, whole_linears
from lightning_4d.tensor_parallel.layouts import concat_permutation
from lightning_4d.tensor_parallel.mixers import plan_mixer
from lightning_4d.tensor_parallel.styles import head_axis, linear_features
from lightning_4d.analysis.trace import ModelTrace

__all__ = [
    "COLWISE_NAMES",
    "ROWWISE_NAMES",
    "HEAD_ATTRS",
    "WIDTH_ATTRS",
    "GROUP_ATTRS",
    "Piece",
    "BlockPlan",
    "ModelPlan",
    "block_plan",
    "model_plan",
    "check_divisible",
    "low_rank_pairs",
]

COLWISE_NAMES = frozenset({"wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "c_attn", "w1", "w3", "gate_proj",
                           "up_proj", "c_fc", "wqkv", "qkv_proj", "query_key_value", "gate_up_proj", "w13",
                           "fc1", "fc_in"})
ROWWISE_NAMES = frozenset({"wo", "o_proj", "w2", "down_proj", "c_proj", "out_proj", "fc2", "fc_out"})
# Per-rank head counts that attention code uses in view/reshape calls; CodeGen's ``mp_num`` counts groups of heads
# (its fused ``qkv_proj`` is ``mp_num`` groups of q | v | k, cut by ``embed_dim // mp_num``): per rank too.
HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "n_kv_heads", "num_key_value_heads", "num_attention_heads",
              "n_local_heads", "n_local_kv_heads", "num_kv_heads", "kv_heads", "mp_num", "num_v_heads", "num_k_heads")
# Widths a region may use to cut or reshape its sharded activations (``split(self.split_size)``).
WIDTH_ATTRS = ("split_size", "embed_dim", "n_embd", "hidden_size", "all_head_size", "q_size", "kv_size",
               "intermediate_size", "inner_dim", "kv_dim")
# Query heads per KV head, used to repeat keys and values: per rank when the KV heads are replicated.
GROUP_ATTRS = ("num_key_value_groups", "n_rep", "num_kv_groups", "num_queries_per_kv", "kv_groups")
# The same facts as a Hugging Face region reads them from its ``config`` (a per-region copy holds per-rank values).
CONFIG_HEAD_ATTRS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_kv_heads", "n_heads")
CONFIG_WIDTH_ATTRS = ("hidden_size", "intermediate_size", "n_embd", "ffn_hidden_size", "n_inner")
CONFIG_GROUP_ATTRS: tuple[str, ...] = ()

_HOOK = f"{hook_call(TP_PLAN)} on your FourDModule (returns {{module path: ParallelStyle}})"
_NAMED = frozenset(HEAD_ATTRS + WIDTH_ATTRS + GROUP_ATTRS + CONFIG_HEAD_ATTRS + CONFIG_WIDTH_ATTRS + CONFIG_GROUP_ATTRS)


@dataclass
class BlockPlan:
    """Layout of one repeated block (names relative to the block).

    Example:
        >>> BlockPlan().linears
        {}
    """

    linears: dict[str, str] = field(default_factory=dict)  # name -> "colwise" | "rowwise" | "replicate"
    low_rank: dict[str, str] = field(default_factory=dict)  # up-projection (colwise) -> its down-projection
    regions: list[str] = field(default_factory=list)  # modules entered with replicated (gathered) input
    norms: list[str] = field(default_factory=list)
    moe: list[str] = field(default_factory=list)
    # of ``moe``: the experts and router a block holds itself (Gemma 4), called on the block's own local tokens
    block_moe: list[str] = field(default_factory=list)
    head_attrs: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> {attr: global value}
    permutations: dict[str, list[int]] = field(default_factory=dict)  # concatenated fused linear -> row order
    partial_params: list[str] = field(default_factory=list)  # replicated params that see sharded activations
    local_attrs: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> {attr: per-rank value}
    config_attrs: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> {config attr: per-rank value}
    gathered: dict[str, list[list[int]]] = field(default_factory=dict)  # replicated-head linear -> rows per rank
    direct: list[str] = field(default_factory=list)  # linears held by the block itself (outside any region)
    # linears held by the block itself that no column-parallel linear feeds (Zamba2's ``linear`` after the shared
    # block): kept whole, run as written (gradients summed over tp under SP, where they see this rank's tokens)
    whole: list[str] = field(default_factory=list)
    head_lists: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # per-head module list -> slices
    head_params: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # per-head parameter -> slices
    # region -> {parameter inside it: rows per rank}: a depthwise convolution's channels, cut with the features
    # of the projection feeding it (:mod:`lightning_4d.tensor_parallel.mixers`)
    channel_rows: dict[str, dict[str, list[list[int]]]] = field(default_factory=dict)
    dist_norms: dict[str, str] = field(default_factory=dict)  # full-width norm -> the linear it normalises
    local_norms: list[str] = field(default_factory=list)  # SP norms on non-(B, T, H) inputs: local, grads summed
    # region -> {argument: (heads, per-rank [lo, hi))}: per-head score biases it receives (ALiBi), cut with its heads
    head_inputs: dict[str, dict[ArgKey, tuple[int, list[tuple[int, int]]]]] = field(default_factory=dict)
    # block argument -> its width: cut along its last dimension with the column-parallel linear it meets (Gemma 4's
    # per-layer input; :mod:`lightning_4d.tensor_parallel.block_inputs`)
    feature_inputs: dict[ArgKey, int] = field(default_factory=dict)


@dataclass
class ModelPlan:
    """Layout of the modules around the blocks (names relative to the LightningModule).

    Example:
        >>> ModelPlan().head is None
        True
    """

    embedding: Optional[str] = None
    head: Optional[str] = None
    vocab_size: Optional[int] = None


def check_divisible(owner: str, attr: str, value: int, tp: int) -> None:
    """Raise ``ValueError`` naming ``owner.attr`` unless ``value`` splits evenly over ``tp`` ranks (pure). The one
    rule for every width the plan shards (heads, features, vocabulary); the recipes' fail-fast check calls it too.

    Example:
        >>> check_divisible("model", "vocab_size", 64, 2)
    """
    _divisible(owner, attr, value, tp)


def _divisible(owner: str, attr: str, value: int, tp: int) -> None:
    if value % tp != 0:
        raise ValueError(
            f"{owner}.{attr}={value} is not divisible by tp={tp}: tensor parallelism splits it evenly across ranks. "
            f"Choose tp among the divisors of {value}, or give an explicit plan with {_HOOK}."
        )


def _role(block_name: str, name: str, trace: Optional[ModelTrace]) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in COLWISE_NAMES:
        return "colwise"
    if leaf in ROWWISE_NAMES:
        return "rowwise"
    if trace is not None:
        if name in trace.takes_block_input:
            return "colwise"
        if trace.last_linear.get(name.rpartition(".")[0]) == name:
            return "rowwise"
    raise ValueError(
        f"{block_name}.{name} is a linear layer whose role is unknown: its name {leaf!r} matches no tensor-parallel "
        f"convention (column: {', '.join(sorted(COLWISE_NAMES))}; row: {', '.join(sorted(ROWWISE_NAMES))}) and it "
        f"neither reads its module's input (column-parallel) nor is the last linear its module calls (row-parallel). "
        f"Rename it or implement {_HOOK}."
    )


def low_rank_pairs(trace: Optional[ModelTrace], block: Optional[nn.Module] = None) -> dict[str, str]:
    """``{up: down}`` low-rank projection pairs of the first block, by dataflow (pure): ``down`` reads its
    region's input and ``up`` reads only what ``down`` produced (through norms, splits, views), inside the same
    region, and ``up`` is not the region's output projection (the last linear its module calls, unless the model
    views ``up``'s output in heads, which no output projection's is: Kimi-Linear's forget gate, a module of its own
    whose ``f_b_proj(f_a_proj(x))`` is viewed per head). DeepSeek's multi-head latent attention is the
    case: ``kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj`` and ``q_a_proj -> q_a_layernorm -> q_b_proj``.
    Tensor parallelism keeps ``down`` (and what lies between) replicated and shards ``up`` by columns.

    A pair held alone in containers (``nn.Sequential`` in an ``nn.ModuleList``: Zamba2's per-use adapters
    ``linear_q_adapter_list.<i>.0/1``, ``up(down(h))`` added to ``q_proj(h)``) belongs to the module holding the
    containers (``block`` tells them apart); ``up`` then shards like the projection its output is added to.

    Example:
        >>> low_rank_pairs(None)
        {}
    """
    if trace is None:
        return {}

    def owner(path: str) -> str:
        # climb out of lists and of sequences of linears only (Zamba2's adapter lists of ``Sequential(down, up)``):
        # a ``Sequential(Linear, GELU, Linear)`` is an MLP whose last linear is its output projection
        parent = path.rpartition(".")[0]
        while parent and block is not None:
            mod = block.get_submodule(parent)
            linears_only = isinstance(mod, nn.Sequential) and all(
                isinstance(c, (nn.Linear, nn.Identity, nn.Dropout)) for c in mod)
            if not (isinstance(mod, nn.ModuleList) or linears_only):
                break
            parent = parent.rpartition(".")[0]
        return parent

    pairs: dict[str, str] = {}
    for up, sources in trace.sources.items():
        if len(sources) != 1:
            continue
        (down,) = sources
        region = owner(up)
        layout = trace.columns.get(up)
        output = trace.last_linear.get(region) == up and not (layout is not None and layout.units)
        if (owner(down) != region or down not in trace.takes_block_input
                or output or up.rsplit(".", 1)[-1] in ROWWISE_NAMES
                or up in trace.takes_block_input):
            continue
        pairs[up] = down
    return pairs


@dataclass(frozen=True)
class Piece:
    """A range of a column-parallel linear's output features: ``heads`` groups of ``unit`` features (``None`` for
    features used one by one, e.g. an MLP's ``gate | up``); ``sharded`` (split over the ranks) or replicated (each
    rank computes the one group its heads use: multi-query / fewer KV heads than ``tp``).

    Example:
        >>> Piece(32, 40, 8, sharded=False).heads
        1
    """

    start: int
    stop: int
    unit: Optional[int] = None
    sharded: bool = True
    interleaved: bool = False

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def heads(self) -> Optional[int]:
        return self.size // self.unit if self.unit else None

    def rows(self, rank: int, tp: int) -> list[int]:
        """The features of this piece that rank ``rank`` computes."""
        if self.sharded:
            chunk = self.size // tp
            return list(range(self.start + rank * chunk, self.start + (rank + 1) * chunk))
        assert self.unit is not None and self.heads is not None
        head = rank * self.heads // tp
        return list(range(self.start + head * self.unit, self.start + (head + 1) * self.unit))


def _pieces(block_name: str, name: str, width: int, trace: Optional[ModelTrace], tp: int) -> list[Piece]:
    """How the output features of column-parallel linear ``name`` are sharded, from the traced cuts and head views
    (see :class:`~lightning_4d.analysis.trace.ColumnLayout`); raises naming the linear when no exact sharding exists."""
    layout = trace.columns.get(name) if trace is not None else None
    raw = layout.pieces() if layout is not None else [(0, width, None)]
    known = {u for *_, u in raw if u}
    # pieces of one fused projection share its head width (a key used without a view); not a mixer's projection,
    # whose pieces the trace follows through its convolution (Mamba-2's ``dt`` is one feature per head)
    if len(known) == 1 and not (layout is not None and layout.depthwise):
        (u,) = known
        raw = [(a, b, unit or (u if (b - a) % u == 0 else None)) for a, b, unit in raw]
    where = f"{block_name}.{name}"
    grouped = {r for r, g in (layout.groups.items() if layout is not None else ()) if g}
    pieces: list[Piece] = []
    for a, b, unit in raw:
        heads = (b - a) // unit if unit else None
        interleaved = any(lo <= a and b <= hi for lo, hi in grouped)
        if (heads if heads is not None else b - a) % tp == 0:
            pieces.append(Piece(a, b, unit, True, interleaved))
        elif heads is not None and tp % heads == 0 and not interleaved:
            pieces.append(Piece(a, b, unit, False))
        else:
            what = (f"features {a}:{b} form {heads} interleaved groups of {unit} (a fused projection viewed per KV "
                    f"group: each group's query heads, key and value)" if interleaved else
                    f"features {a}:{b} form {heads} heads of {unit}" if heads is not None else
                    f"features {a}:{b} ({b - a} of them)")
            fix = (f"use a tp that divides {heads}" if interleaved else
                   f"use a tp that divides {heads} or is a multiple of it" if heads is not None else
                   f"use a tp that divides {b - a}")
            raise ValueError(
                f"{where}: its {what}, which cannot be split evenly over tp={tp} ranks. Fix: {fix}, or implement "
                f"{_HOOK}."
            )
    return pieces


def _check_linear_forward(where: str, module: nn.Module) -> None:
    """A subclass of ``nn.Linear`` with its own ``forward`` (TorchTitan's ``Linear`` family) is sharded like a linear
    only if it computes one: its output on a random input must be ``x @ weight.T + bias``. Skipped on the meta
    device (a dry run); raises naming the module otherwise."""
    if not isinstance(module, nn.Linear) or type(module).forward is nn.Linear.forward:
        return
    w = module.weight
    if w.is_meta or not isinstance(w, torch.Tensor) or type(w.data) is not torch.Tensor:
        return
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, module.in_features, generator=gen).to(device=w.device, dtype=w.dtype)  # (3, in)
    with torch.no_grad():
        got = module(x)
        want = torch.nn.functional.linear(x, w, module.bias)
    diff, scale = max_difference(got, want) or (0.0, 0.0)
    if not isinstance(got, torch.Tensor) or diff > allowed_difference(want, scale):
        raise ValueError(
            f"{where} ({type(module).__name__}) subclasses nn.Linear with its own forward, which does not compute "
            f"x @ weight.T + bias on a test input, so it cannot be sharded as a column- or row-parallel linear. "
            f"Implement {_HOOK} for this model, or use tp=1."
        )


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    out: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _assign_regions(plan: BlockPlan, trace: Optional[ModelTrace]) -> dict[str, str]:
    """``{linear: region}``: the smallest module holding a row-parallel linear and the column-parallel linears that
    feed it (traced dataflow); TorchTitan keeps ``wqkv`` one level below the attention (``attention.qkv_linear``) and
    ``wo`` beside it. ``""``: linears held directly by the block (OPT's ``fc1`` / ``fc2``)."""
    region: dict[str, str] = {}
    kinds = plan.linears
    for name, kind in kinds.items():
        if kind != "rowwise":
            continue
        feeding = [s for s in (trace.sources.get(name, ()) if trace is not None else ())
                   if kinds.get(s) == "colwise"]
        where = _common_prefix([_parent(name)] + [_parent(s) for s in feeding]) if feeding else _parent(name)
        region[name] = where
        for s in feeding:
            if s not in region or len(where) < len(region[s]):
                region[s] = where
    for name in kinds:
        region.setdefault(name, _parent(name))
    # a region inside another one is the outer one
    for name, where in list(region.items()):
        outer = [r for r in set(region.values()) if r and where != r and (where + ".").startswith(r + ".")]
        if outer:
            region[name] = min(outer, key=len)
    return region


def _in_norm_list(block: nn.Module, name: str) -> bool:
    """Whether ``name`` is an entry of a list (or dict) of norms held by the block (LongCat-Flash's
    ``input_layernorm[0]`` / ``[1]`` before its two attention sublayers): a norm of the block like a direct one.

    Example:
        >>> b = nn.Module(); b.norms = nn.ModuleList([nn.LayerNorm(4), nn.LayerNorm(4)])
        >>> _in_norm_list(b, "norms.1"), _in_norm_list(b, "norms")
        (True, False)
    """
    owner, dot, _ = name.rpartition(".")
    if not dot or "." in owner:
        return False
    container = block.get_submodule(owner)
    return isinstance(container, (nn.ModuleList, nn.ModuleDict)) and all(is_norm(c) for c in container.children())


def block_plan(block: nn.Module, block_name: str, tp: int, trace: Optional[ModelTrace] = None,
               sequence_parallel: bool = False) -> BlockPlan:
    """Plan one block; raise naming the module when it does not fit.

    ``trace`` (from :func:`~lightning_4d.analysis.trace.trace_model`) adds what names cannot tell: roles by
    dataflow, concatenated fused outputs (``split``, slices) and the head widths the region views them in, which
    module feeds each norm, and the input rank of each module.

    Example:
        >>> from lightning_4d.models import GPT2, GPT2Config
        >>> b = GPT2(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, block_size=8)).h[0]
        >>> block_plan(b, "h.0", tp=2).regions
        ['attn', 'mlp']
    """
    plan = BlockPlan()
    plan.low_rank = low_rank_pairs(trace, block)
    downs = set(plan.low_rank.values())
    gates = feature_gates(block, trace)  # meet a block argument feature by feature: column-parallel, it is cut
    indexed = trace.index_modules if trace is not None else frozenset()  # DeepSeek-V3.2's indexer: kept whole
    moe_prefixes: list[str] = []
    own_moe = plan.block_moe = _block_level_moe(block)
    if own_moe and sequence_parallel:
        raise ValueError(
            f"{block_name} holds its experts and router itself ({', '.join(f'{block_name}.{n}' for n in own_moe)}, "
            f"beside its attention and MLP, as Gemma 4's MoE layers do), which sequence parallelism does not support "
            f"yet (its gradients would be wrong). Set sequence_parallel=False (tensor parallelism without it, and "
            f"ep, hold), or implement {_HOOK}.")
    for name, module in block.named_modules():
        if not name:
            continue
        if any(name == p or name.startswith(p + ".") for p in moe_prefixes):
            continue  # expert weights are never treated as dense layers
        if name in own_moe or holds_routed_experts(module):
            moe_prefixes.append(name)
            plan.moe.append(name)
            continue
        if is_linear(module):
            _check_linear_forward(f"{block_name}.{name}", module)
            plan.linears[name] = ("replicate" if name in downs or whole_linears([name], indexed)
                                  else "colwise" if name in plan.low_rank or name in gates
                                  else _role(block_name, name, trace))
        elif is_norm(module) and ("." not in name or _in_norm_list(block, name)):
            plan.norms.append(name)
    plan.whole = _whole_linears(plan, trace)
    for name in plan.whole:
        del plan.linears[name]
        if sequence_parallel:
            plan.partial_params += [f"{name}.{n}" for n, _ in block.get_submodule(name).named_parameters()]
    regions = _assign_regions(plan, trace)
    cut_sizes: dict[str, set[int]] = {}
    pieces_of: dict[str, list[Piece]] = {}
    for name, role in plan.linears.items():
        fan_in, fan_out = linear_features(block.get_submodule(name))
        region = regions[name]
        if role == "colwise":
            pieces = _pieces(block_name, name, fan_out, trace, tp)
            pieces_of[name] = pieces
            sizes = [p.size for p in pieces]
            if all(p.sharded for p in pieces):
                if len(pieces) > 1:
                    plan.permutations[name] = concat_permutation(sizes, tp)
            else:
                plan.gathered[name] = [[r for p in pieces for r in p.rows(rank, tp)] for rank in range(tp)]
                plan.partial_params += [f"{name}.{n}" for n, _ in block.get_submodule(name).named_parameters()]
            cut_sizes.setdefault(region, set()).update(p.size for p in pieces if p.sharded)
        elif role == "rowwise":
            _divisible(f"{block_name}.{name}", "in_features", fan_in, tp)
            cut_sizes.setdefault(region, set()).add(fan_in)
        else:  # a low-rank down-projection: replicated, its gradient a partial sum over the ranks' heads
            plan.partial_params += [f"{name}.{n}" for n, _ in block.get_submodule(name).named_parameters()]
    _check_replicated_heads(block_name, plan, regions, pieces_of)
    plan.feature_inputs = feature_cuts(block_name, block, plan.linears, [*plan.permutations, *plan.gathered], trace,
                                       tp)
    plan.direct = sorted(n for n, r in regions.items() if r == "" and plan.linears[n] != "replicate")
    plan.regions = sorted({r for n, r in regions.items() if r and plan.linears[n] == "colwise"})
    for region in plan.regions:
        module = block.get_submodule(region)
        members = [n for n, r in regions.items() if r == region]
        heads = _region_heads(members, pieces_of)
        widths = cut_sizes.get(region, set())
        attrs, local = _local_attrs(f"{block_name}.{region}", module, heads, widths, tp)
        if attrs:
            plan.head_attrs[region] = attrs
            plan.local_attrs[region] = local
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, (int, float, str, bool)) and not isinstance(config, nn.Module):
            # The config holds the whole model's sizes: its head counts matter only where this region has heads.
            names = (HEAD_ATTRS + CONFIG_HEAD_ATTRS if heads.sharded or heads.replicated else ()) \
                + WIDTH_ATTRS + CONFIG_WIDTH_ATTRS + GROUP_ATTRS
            _, conf_local = _local_attrs(f"{block_name}.{region}.config", config, heads, widths, tp, names=names)
            if conf_local:
                plan.config_attrs[region] = conf_local
        mixer = plan_mixer(block_name, block, region, plan, pieces_of, trace, tp)
        _read_head_counts(f"{block_name}.{region}", plan, region, trace.int_reads.get(region, {}) if trace else {},
                          heads, {p.unit for n in members for p in pieces_of.get(n, ()) if p.unit}, tp)
        if mixer.rows:
            plan.channel_rows[region] = mixer.rows
        plan.partial_params += _region_params(block_name, block, region, plan, heads, trace, tp, mixer.handled)
        biases = _score_bias_heads(trace.score_biases.get(region, {}) if trace is not None else {}, heads, tp)
        if biases:
            plan.head_inputs[region] = biases
    plan.partial_params += _moe_params(block, plan, sequence_parallel)
    if sequence_parallel:
        ndim = trace.input_ndim if trace is not None else {}
        plan.local_norms = [n for n in plan.norms if ndim.get(n, 3) != 3]
        plan.partial_params += [f"{n}.{p}" for n in plan.local_norms
                                for p, _ in block.get_submodule(n).named_parameters()]
    plan.partial_params += _block_params(block_name, block, plan, sequence_parallel)
    return plan


def _whole_linears(plan: BlockPlan, trace: Optional[ModelTrace]) -> list[str]:
    """Linears held by the block itself, row-parallel only by dataflow (the last linear the block calls, no
    row-parallel name) with no column-parallel linear of the block feeding them: nothing sharded reaches them, so
    they stay whole (Zamba2's ``linear`` on the shared block's output)."""
    if trace is None:
        return []
    return [n for n, role in plan.linears.items() if role == "rowwise" and "." not in n and n not in ROWWISE_NAMES
            and not any(plan.linears.get(s) == "colwise" for s in trace.sources.get(n, ()))]


@dataclass
class _Heads:
    """Head counts of a region: ``sharded`` (split over the ranks, e.g. query heads) and ``replicated`` (fewer than
    ``tp``: one per rank, e.g. a multi-query KV head), with the width of one head of each."""

    sharded: set[int] = field(default_factory=set)
    replicated: dict[int, int] = field(default_factory=dict)  # heads -> unit


def _region_heads(members: list[str], pieces_of: dict[str, list[Piece]]) -> _Heads:
    heads = _Heads()
    for name in members:
        for p in pieces_of.get(name, ()):
            if p.heads is None:
                continue
            if p.sharded:
                heads.sharded.add(p.heads)
            else:
                heads.replicated[p.heads] = p.unit or 0
    return heads


def _check_replicated_heads(block_name: str, plan: BlockPlan, regions: dict[str, str],
                            pieces_of: dict[str, list[Piece]]) -> None:
    """Replicated heads (a KV head shared by several query heads) are exact only next to sharded heads that
    outnumber them: each rank's output then comes from its own query heads."""
    for name, pieces in pieces_of.items():
        for p in pieces:
            if p.sharded:
                continue
            heads = _region_heads([n for n, r in regions.items() if r == regions[name]], pieces_of)
            if not any(h > (p.heads or 0) for h in heads.sharded):
                raise ValueError(
                    f"{block_name}.{name}: its features {p.start}:{p.stop} form {p.heads} head(s) of {p.unit}, fewer "
                    f"than tp, and no other projection of {block_name}.{regions[name] or '(the block)'} has more "
                    f"heads that split over the ranks, so replicating them would compute the same output on several "
                    f"ranks. Fix: use a tp that divides {p.heads}, or implement {_HOOK}."
                )


def _local_attrs(owner: str, obj: object, heads: _Heads, widths: set[int], tp: int,
                 names: tuple[str, ...] = ()) -> tuple[dict[str, int], dict[str, int]]:
    """``(global, local)`` values of the head counts and cut widths ``obj`` holds as int attributes: a head count
    that splits over the ranks (or any other divisible one) is divided by ``tp``; a replicated head count becomes 1
    (each rank computes one such head); a group ratio (query heads per KV head) becomes the local query heads; a
    width the region cuts its sharded outputs by is divided, a replicated head's width is kept."""
    found: dict[str, int] = {}
    local: dict[str, int] = {}
    for attr in names or HEAD_ATTRS + WIDTH_ATTRS + GROUP_ATTRS:
        value = getattr(obj, attr, None)
        if not isinstance(value, int) or isinstance(value, bool) or attr in found:
            continue
        if attr in GROUP_ATTRS + CONFIG_GROUP_ATTRS:
            ratios = {q // kv: q // tp for q in heads.sharded for kv in heads.replicated if kv and q % kv == 0}
            if value in ratios:
                found[attr], local[attr] = value, ratios[value]
            continue
        if attr in HEAD_ATTRS + CONFIG_HEAD_ATTRS:
            if value in heads.replicated and value not in heads.sharded:
                found[attr], local[attr] = value, 1
            else:
                _divisible(owner, attr, value, tp)
                found[attr], local[attr] = value, value // tp
        elif attr in WIDTH_ATTRS + CONFIG_WIDTH_ATTRS:
            if value in widths:
                _divisible(owner, attr, value, tp)
                found[attr], local[attr] = value, value // tp
            elif any(value == h * u for h, u in heads.replicated.items()) and value not in widths:
                found[attr], local[attr] = value, value // next(h for h, u in heads.replicated.items()
                                                                 if value == h * u)
    return found, local


def _read_head_counts(owner: str, plan: BlockPlan, region: str, reads: dict[str, int], heads: _Heads,
                      units: set[int], tp: int) -> None:
    """Per-rank values of the integers the region's forward read and used as a count of groups in a shape (the
    trace's :mod:`~lightning_4d.analysis.int_reads`, whatever their names) that are head counts of its projections
    (LitGPT's ``config.n_query_groups``): a count split over the ranks is divided by
    ``tp``, one replicated (fewer heads than ``tp``) becomes 1, the ratio of query heads to replicated KV heads
    becomes the local query heads. Completes the name lists: a name they know (``num_key_value_groups``, a ratio
    that may equal a head count) is theirs to decide, and a value that is also a head's width may be either. A
    value taken for what it is not makes the region's forward fail or differ at the set-up check, which names it.

    Example:
        >>> plan = BlockPlan()
        >>> _read_head_counts("h.0.attn", plan, "attn", {"config.n_query_groups": 2, "config.n_head": 4},
        ...                   _Heads(sharded={4, 2}), {8}, 2)
        >>> plan.config_attrs
        {'attn': {'n_query_groups': 1}}
    """
    from lightning_4d.analysis.int_reads import CONFIG_PREFIX

    ratios = {q // kv: q // tp for q in heads.sharded for kv in heads.replicated if kv and q % kv == 0}
    for key, value in reads.items():
        on_config = key.startswith(CONFIG_PREFIX)
        attr = key[len(CONFIG_PREFIX):] if on_config else key
        found = plan.config_attrs.get(region, {}) if on_config else plan.head_attrs.get(region, {})
        if attr in found or attr in _NAMED or value in units:
            continue
        if value in heads.sharded:
            _divisible(f"{owner}.{key}", "value", value, tp)
            local = value // tp
        elif value in heads.replicated:
            local = 1
        elif value in ratios:
            local = ratios[value]
        else:
            continue
        if local == value:
            continue
        if on_config:
            plan.config_attrs.setdefault(region, {})[attr] = local
        else:
            plan.head_attrs.setdefault(region, {})[attr] = value
            plan.local_attrs.setdefault(region, {})[attr] = local


def _head_slices(count: int, heads: _Heads, tp: int) -> Optional[list[tuple[int, int]]]:
    """Per rank, the ``[lo, hi)`` slice of ``count`` per-head entries that rank's heads use (``None`` when ``count``
    is no head count of the region).

    Example:
        >>> _head_slices(4, _Heads(sharded={4}, replicated={1: 8}), 2), _head_slices(1, _Heads({4}, {1: 8}), 2)
        ([(0, 2), (2, 4)], [(0, 1), (0, 1)])
    """
    if count in heads.replicated:
        return [(r * count // tp, r * count // tp + 1) for r in range(tp)]
    if count in heads.sharded:
        return [(r * count // tp, (r + 1) * count // tp) for r in range(tp)]
    return None


def _score_bias_heads(found: dict[ArgKey, tuple[tuple[int, ...], int]], heads: _Heads,
                      tp: int) -> dict[ArgKey, tuple[int, list[tuple[int, int]]]]:
    """The traced score biases of a region (:mod:`lightning_4d.analysis.head_bias`) whose dimension ``-3`` holds one of its
    sharded head counts, directly ``(..., H, Q, K)`` or folded with the batch ``(B·H, Q, K)``: ``{argument: (heads,
    per-rank slices)}``. Others are left whole (the set-up comparison shows whether that is right).

    Example:
        >>> _score_bias_heads({"alibi": ((8, 1, 8), 2)}, _Heads(sharded={4}), 2)
        {'alibi': (4, [(0, 2), (2, 4)])}
    """
    out: dict[ArgKey, tuple[int, list[tuple[int, int]]]] = {}
    for key, (shape, batch) in found.items():
        size = shape[-3]
        count = size if size in heads.sharded else size // batch if batch and size % batch == 0 else None
        if count in heads.sharded:
            slices = _head_slices(count, heads, tp)
            assert slices is not None
            out[key] = (count, slices)
    return out


def _region_params(block_name: str, block: nn.Module, region: str, plan: BlockPlan, heads: _Heads,
                   trace: Optional[ModelTrace], tp: int, handled: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Parameters inside a region besides its linears: per-head norms (``q_norm`` over ``head_dim``), per-head
    module lists (StableLM's ``norms`` zipped with the heads) and per-head parameters (attention sinks) are used
    per rank on that rank's heads and get their gradients summed over ``tp``; a norm over the full sharded width of
    one column-parallel projection (OLMo 2's ``q_norm``) becomes a distributed norm. Anything else with
    parameters is refused, naming it."""
    out: list[str] = []
    module = block.get_submodule(region)
    members = {n[len(region) + 1:] for n in plan.linears if n.startswith(region + ".")}
    widths = {linear_features(module.get_submodule(n))[1] for n in members
              if plan.linears[f"{region}.{n}"] == "colwise"}
    latent = {linear_features(module.get_submodule(d[len(region) + 1:]))[1] for d in plan.low_rank.values()
              if d.startswith(region + ".")}
    counts = heads.sharded | set(heads.replicated) | {v for k, v in plan.head_attrs.get(region, {}).items()
                                                      if k in HEAD_ATTRS and v % tp == 0}
    known = _Heads(sharded=counts - set(heads.replicated), replicated=heads.replicated)
    done: list[str] = []  # per-head lists: their members are handled with them
    for sub_name, sub in module.named_modules():
        path = f"{region}.{sub_name}" if sub_name else region
        if path in plan.linears or path in handled or any(sub_name.startswith(d + ".") for d in done):
            continue
        if sub_name and isinstance(sub, nn.ModuleList) and all(
                f"{path}.{n}".rpartition(".")[0] in plan.linears for n, _ in sub.named_parameters()):
            continue  # a list of linears (Zamba2's per-use adapters), each planned as a linear
        if sub_name and isinstance(sub, nn.ModuleList) and len(sub) > 1 and any(
                True for _ in sub.parameters()):
            slices = _head_slices(len(sub), known, tp)
            if slices is None or len({type(m) for m in sub.children()}) != 1:
                raise ValueError(
                    f"{block_name}.{path} is a list of {len(sub)} modules with parameters inside the tensor-parallel "
                    f"region {block_name}.{region}; only a list with one module per head (here "
                    f"{sorted(counts) or 'no head count'}) can follow the heads over the ranks. Implement {_HOOK} "
                    f"for this model, or use tp=1."
                )
            plan.head_lists[path] = slices
            out += [f"{path}.{n}" for n, _ in sub.named_parameters()]
            done.append(sub_name)
            continue
        own = {n: p for n, p in sub.named_parameters(recurse=False) if f"{path}.{n}" not in handled}
        if not own:
            continue
        size = getattr(sub, "weight", None)
        size = int(size.shape[-1]) if isinstance(size, torch.Tensor) and size.dim() >= 1 else None
        if sub_name and is_norm(sub) and all(p.dim() >= 2 and _head_slices(int(p.shape[0]), known, tp) is not None
                                             for p in own.values()):
            # A norm per head with its own weight row per head, (heads, head_dim) (Cohere's q_norm / k_norm): each
            # rank uses its heads' rows, like a per-head parameter.
            for n, p in own.items():
                plan.head_params[f"{path}.{n}"] = _head_slices(int(p.shape[0]), known, tp)  # type: ignore[assignment]
                out.append(f"{path}.{n}")
            continue
        if sub_name and is_norm(sub):
            # A per-head norm, or one on a replicated low-rank latent (its width at most the down-projection's).
            if size not in widths or any(size is not None and size <= w for w in latent):
                out += [f"{path}.{n}" for n in own]
                continue
            plan.dist_norms[path] = _norm_source(block_name, block, path, size, plan, trace)
            continue
        sources = sorted(trace.module_sources.get(path, ())) if trace is not None else []
        scalars = all(p.numel() == 1 for p in own.values())
        if scalars and sources and all(plan.linears.get(s) == "colwise" and s not in plan.gathered for s in sources):
            # Scalars applied to this rank's features only (Apertus' xIELU ``alpha_p`` / ``alpha_n`` on the
            # column-parallel ``up_proj`` output): each rank's gradient is its features' part of the whole.
            out += [f"{path}.{n}" for n in own]
            continue
        per_head = {n: _head_slices(int(p.shape[head_axis(p.shape)]), known, tp) for n, p in own.items()
                    if p.dim() >= 1}
        if own and all(per_head.get(n) is not None for n in own):
            for n in own:
                plan.head_params[f"{path}.{n}"] = per_head[n]  # type: ignore[assignment]
                out.append(f"{path}.{n}")
            continue
        firsts = sorted({int(p.shape[head_axis(p.shape)]) for p in own.values() if p.dim() >= 1})
        why = (f"normalises over {size} features, a full width that tensor parallelism splits across ranks"
               if is_norm(sub) else
               f"holds only scalars, but its input does not come only from column-parallel projections of the region "
               f"(traced: {sources or 'unknown'}), so whether a rank's gradient is a part of the whole or all of it "
               f"is unknown" if scalars else
               f"is not a linear layer or a norm, and is not indexed by the heads the region's "
               f"projections are viewed in: per-head parameters follow those heads over the ranks, but these have "
               f"{' / '.join(map(str, firsts)) or 'no'} entries along their head dimension and the projections' "
               f"head counts are {sorted(counts) or 'unknown'} (a linear-attention or state-space mixer's per-head "
               f"`dt_bias` / `A_log` count heads inside a fused, grouped projection that the trace does not cut), so "
               f"which rank's heads they belong to is unknown")
        raise ValueError(
            f"{block_name}.{path} holds parameters ({', '.join(own)}) inside the tensor-parallel region "
            f"{block_name}.{region} and {why}. Use tp=1 for this model (pipeline, data and expert parallelism do "
            f"not cut heads), or implement {_HOOK}."
        )
    return out


def _norm_source(block_name: str, block: nn.Module, path: str, size: Optional[int], plan: BlockPlan,
                 trace: Optional[ModelTrace]) -> str:
    """The one column-parallel linear whose whole output a full-width norm normalises (it then runs distributed:
    statistics all-reduced over ``tp``, weight sharded like the features); raises naming the norm otherwise."""
    sources = sorted(trace.module_sources.get(path, ())) if trace is not None else []
    fix = f"Implement {_HOOK} for this model, or use tp=1."
    if len(sources) != 1:
        raise ValueError(
            f"{block_name}.{path} normalises over {size} features, a full width that tensor parallelism splits "
            f"across ranks, and its input does not come from exactly one column-parallel projection "
            f"(traced: {sources or 'unknown'}), so it cannot run as a distributed norm. {fix}"
        )
    (source,) = sources
    width = linear_features(block.get_submodule(source))[1] if source in plan.linears else None
    if source in plan.gathered:
        raise ValueError(
            f"{block_name}.{path} normalises over {size} features, the output of {block_name}.{source}, whose heads "
            f"are fewer than tp and replicated (each rank computes one), so no rank holds the full width to run it as "
            f"a distributed norm. Fix: use a tp that divides {block_name}.{source}'s number of heads, or implement "
            f"{_HOOK}."
        )
    if plan.linears.get(source) != "colwise" or source in plan.permutations or width != size:
        why = ("that projection's output is permuted (a fused projection cut into pieces)"
               if source in plan.permutations else "it is not the column-parallel output of exactly that width")
        raise ValueError(
            f"{block_name}.{path} normalises over {size} features, the output of {block_name}.{source}, which "
            f"tensor parallelism splits across ranks, and cannot run as a distributed norm: {why}. {fix}"
        )
    return source


def _block_level_moe(block: nn.Module) -> list[str]:
    """The experts module and its router when a block holds them itself, beside its attention and MLP (Gemma 4's
    ``experts`` and ``router``, whose ``proj`` scores the experts): handled as a mixture-of-experts layer, the router
    whole (never a row- or column-parallel linear). Empty for a block whose experts sit in a sublayer.

    Example:
        >>> _block_level_moe(nn.Linear(2, 2))
        []
    """
    from lightning_4d.expert_parallel.inplace import inspect_experts

    experts = getattr(block, "experts", None)
    name = next((n for n, m in block.named_children() if m is experts), None) if experts is not None else None
    if name is None:
        return []
    spec = inspect_experts(experts, name, block)
    if isinstance(spec, str) or not spec.router or spec.router.startswith("../"):
        return [name]
    return [name, spec.router.partition(".")[0]]


def _moe_params(block: nn.Module, plan: BlockPlan, sequence_parallel: bool) -> list[str]:
    """Under SP a mixture-of-experts layer sees this rank's tokens, so the gradients of its parameters that every
    rank holds whole are partial sums over ``tp``: all of them when expert parallelism did not take the layer over
    (Llama 4's every-token experts run as the model's own code), its router and shared experts otherwise
    (wherever the router sits in the layer: TorchTitan's ``moe.router`` is beside ``moe.routed_experts``).
    Experts that expert parallelism shards, and the package's own MoE layer, are accounted for by the expert
    rewrite."""
    if not sequence_parallel:
        return []
    from lightning_4d.expert_parallel.inplace import is_inplace_experts
    from lightning_4d.expert_parallel.moe import MoE

    out: list[str] = []
    for name in plan.moe:
        layer = block.get_submodule(name)
        if any(isinstance(m, MoE) for m in layer.modules()):
            continue
        experts = {id(p) for m in layer.modules() if is_inplace_experts(m) for p in m.parameters()}
        out += [f"{name}.{n}" for n, p in layer.named_parameters() if id(p) not in experts]
    return out


def _block_params(block_name: str, block: nn.Module, plan: BlockPlan, sequence_parallel: bool) -> list[str]:
    """Under SP, plain parameters of a block outside its regions, linears and norms see sequence shards: refused
    (their math along the sequence is unknown)."""
    if not sequence_parallel:
        return []
    handled = set(plan.regions) | set(plan.norms) | set(plan.moe) | set(plan.linears) | set(plan.whole)
    for sub_name, sub in block.named_modules():
        if any(sub_name == h or sub_name.startswith(h + ".") for h in handled):
            continue
        own = [n for n, _ in sub.named_parameters(recurse=False)]
        if own:
            where = f"{block_name}.{sub_name}" if sub_name else block_name
            raise ValueError(
                f"{where} holds parameters ({', '.join(own)}) outside the attention/MLP regions and norms of the block; "
                f"with sequence_parallel=True they would see only this rank's part of the sequence. Set "
                f"sequence_parallel=False or implement {_HOOK}."
            )
    return []


def model_plan(root: nn.Module, trace: ModelTrace, tp: int) -> ModelPlan:
    """The token embedding (first ``nn.Embedding`` to run before the blocks) and the output head (last
    linear to run after them, when its outputs are a vocabulary that an embedding before the blocks
    reads), found from the execution order, wherever they are registered. An embedding subclass with
    its own ``forward`` (scaling, casts) stays replicated: exact, not sharded.

    Example:
        >>> import torch
        >>> from lightning_4d.models import Llama, LlamaConfig
        >>> from lightning_4d.analysis.trace import trace_model
        >>> m = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4))
        >>> p = model_plan(m, trace_model(m, "layers", torch.zeros(1, 4, dtype=torch.long)), tp=2)
        >>> (p.embedding, p.head)
        ('tok_embeddings', 'output')
    """
    plan = ModelPlan()
    embeddings = [p for p in (trace.first_of(root, (pre,), (nn.Embedding,)) for pre in trace.pre) if p]
    vocab = {root.get_submodule(p).num_embeddings for p in embeddings}
    head = trace.first_of(root, trace.post, (nn.Linear,), last=True)
    # Only an output over the vocabulary is sharded (for the parallel cross-entropy); another output (a
    # regression head) stays whole, and exact.
    if head is not None and linear_features(root.get_submodule(head))[1] in vocab:
        plan.head = head
        plan.vocab_size = linear_features(root.get_submodule(head))[1]
        _divisible(head, "out_features", plan.vocab_size, tp)
    matching = [p for p in embeddings if plan.vocab_size is None
                or root.get_submodule(p).num_embeddings == plan.vocab_size]
    if matching:
        table = root.get_submodule(matching[0])
        if type(table).forward is nn.Embedding.forward:
            plan.embedding = matching[0]
            _divisible(plan.embedding, "num_embeddings", table.num_embeddings, tp)
        elif plan.head is not None and root.get_submodule(plan.head).weight is table.weight:
            plan.head = None  # tied to an embedding whose own forward stays replicated: keep both whole
    return plan
