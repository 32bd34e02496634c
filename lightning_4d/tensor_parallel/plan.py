r"""Automatic tensor/sequence-parallel plans from module names (pure: no process group).

What is recognised (DESIGN.md), by name where a convention exists and by dataflow otherwise (the
:class:`~lightning_4d.trace.ModelTrace` of one forward):

- column-parallel (output features split): ``wq wk wv`` / ``q_proj k_proj v_proj`` / ``c_attn`` / ``wqkv``,
  ``w1 w3`` / ``gate_proj up_proj`` / ``c_fc``, and any linear that reads its region's input;
  ``nn.Linear`` or transformers' ``Conv1D``. A fused projection whose output the model ``split``\s
  (concatenated ``q|k|v``) gets its rows permuted so that each rank holds ``q_r|k_r|v_r``; one the model
  ``view``\s per head (interleaved) is sharded as it is;
- row-parallel (input features split, one reduction): ``wo`` / ``o_proj`` / ``w2`` / ``down_proj`` /
  ``c_proj``, or the last linear its region calls;
- norms (``LayerNorm``, ``RMSNorm``) directly inside a block: sequence-parallel; norms inside a region
  (per-head ``q_norm`` / ``k_norm``) stay replicated and their gradients are summed over ``tp``;
- the token embedding (the first ``nn.Embedding`` to run): vocab-parallel; the output head (the last
  linear to run after the blocks): column-parallel, with a parallel cross-entropy (``loss_parallel``).

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

from torch import nn

from lightning_4d.tensor_parallel.layouts import concat_permutation
from lightning_4d.tensor_parallel.styles import is_linear, linear_features
from lightning_4d.trace import ModelTrace

__all__ = [
    "COLWISE_NAMES",
    "ROWWISE_NAMES",
    "HEAD_ATTRS",
    "WIDTH_ATTRS",
    "BlockPlan",
    "ModelPlan",
    "block_plan",
    "model_plan",
    "is_norm",
    "is_moe",
    "check_divisible",
    "low_rank_pairs",
]

COLWISE_NAMES = frozenset({"wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "c_attn", "w1", "w3", "gate_proj",
                           "up_proj", "c_fc", "wqkv", "qkv_proj", "query_key_value", "gate_up_proj", "w13",
                           "fc1", "fc_in"})
ROWWISE_NAMES = frozenset({"wo", "o_proj", "w2", "down_proj", "c_proj", "out_proj", "fc2", "fc_out"})
# Per-rank head counts that attention code uses in view/reshape calls.
HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "n_kv_heads", "num_key_value_heads", "num_attention_heads",
              "n_local_heads", "n_local_kv_heads", "num_kv_heads")
# Widths a region may use to cut or reshape its sharded activations (``split(self.split_size)``).
WIDTH_ATTRS = ("split_size", "embed_dim", "n_embd", "hidden_size", "all_head_size", "q_size", "kv_size",
               "intermediate_size", "inner_dim")

_HOOK = "`fourd_tp_plan(self, tp_mesh, sequence_parallel)` on your FourDModule (returns {module path: ParallelStyle})"


def is_norm(module: nn.Module) -> bool:
    """LayerNorm / RMSNorm (or a user class whose name ends in ``Norm``)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def is_moe(module: nn.Module) -> bool:
    """A mixture-of-experts module: has an ``experts`` container (Mixtral style or the package's layer)."""
    return hasattr(module, "experts") or type(module).__name__ in ("MoE", "MoELayer")


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
    head_attrs: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> {attr: global value}
    permutations: dict[str, list[int]] = field(default_factory=dict)  # concatenated fused linear -> row order
    partial_params: list[str] = field(default_factory=list)  # replicated params that see sharded activations


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


def low_rank_pairs(trace: Optional[ModelTrace]) -> dict[str, str]:
    """``{up: down}`` low-rank projection pairs of the first block, by dataflow (pure): ``down`` reads its
    region's input and ``up`` reads only what ``down`` produced (through norms, splits, views), inside the same
    region, and ``up`` is not the region's output projection. DeepSeek's multi-head latent attention is the
    case: ``kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj`` and ``q_a_proj -> q_a_layernorm -> q_b_proj``.
    Tensor parallelism keeps ``down`` (and what lies between) replicated and shards ``up`` by columns.

    Example:
        >>> low_rank_pairs(None)
        {}
    """
    if trace is None:
        return {}
    pairs: dict[str, str] = {}
    for up, sources in trace.sources.items():
        if len(sources) != 1:
            continue
        (down,) = sources
        region = up.rpartition(".")[0]
        if (down.rpartition(".")[0] != region or down not in trace.takes_block_input
                or trace.last_linear.get(region) == up or up.rsplit(".", 1)[-1] in ROWWISE_NAMES
                or up in trace.takes_block_input):
            continue
        pairs[up] = down
    return pairs


def _fused_pieces(block_name: str, name: str, width: int, trace: Optional[ModelTrace], tp: int) -> Optional[list[int]]:
    consumer = trace.consumers.get(name) if trace is not None else None
    pieces = consumer.pieces(width) if consumer is not None else None
    if not pieces or len(pieces) < 2:
        return None
    for size in pieces:
        _divisible(f"{block_name}.{name}", f"output piece (of {pieces})", size, tp)
    return pieces


def block_plan(block: nn.Module, block_name: str, tp: int, trace: Optional[ModelTrace] = None,
               sequence_parallel: bool = False) -> BlockPlan:
    """Plan one block; raise naming the module when it does not fit.

    ``trace`` (from :func:`~lightning_4d.trace.trace_model`) adds what names cannot tell: roles by
    dataflow, concatenated fused outputs (``split``) and the sizes the region cuts them into.

    Example:
        >>> from lightning_4d.models import GPT2, GPT2Config
        >>> b = GPT2(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, block_size=8)).h[0]
        >>> block_plan(b, "h.0", tp=2).regions
        ['attn', 'mlp']
    """
    plan = BlockPlan()
    plan.low_rank = low_rank_pairs(trace)
    downs = set(plan.low_rank.values())
    moe_prefixes: list[str] = []
    cut_sizes: dict[str, set[int]] = {}
    for name, module in block.named_modules():
        if not name:
            continue
        if any(name == p or name.startswith(p + ".") for p in moe_prefixes):
            continue  # expert weights are never treated as dense layers
        if is_moe(module):
            moe_prefixes.append(name)
            plan.moe.append(name)
            continue
        if is_linear(module):
            fan_in, fan_out = linear_features(module)
            role = ("replicate" if name in downs else "colwise" if name in plan.low_rank
                    else _role(block_name, name, trace))
            plan.linears[name] = role
            if role == "colwise":
                _divisible(f"{block_name}.{name}", "out_features", fan_out, tp)
                pieces = _fused_pieces(block_name, name, fan_out, trace, tp)
                if pieces is not None:
                    plan.permutations[name] = concat_permutation(pieces, tp)
                    cut_sizes.setdefault(name.rpartition(".")[0], set()).update(pieces)
            elif role == "rowwise":
                _divisible(f"{block_name}.{name}", "in_features", fan_in, tp)
                cut_sizes.setdefault(name.rpartition(".")[0], set()).add(fan_in)
            else:  # a low-rank down-projection: replicated, its gradient a partial sum over the ranks' heads
                plan.partial_params += [f"{name}.{n}" for n, _ in module.named_parameters()]
        elif is_norm(module) and "." not in name:
            plan.norms.append(name)
    parents = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n, k in plan.linears.items() if k == "colwise"})
    if "" in parents:
        raise ValueError(
            f"{block_name} holds column-parallel linears directly; put attention and MLP in submodules or "
            f"implement {_HOOK}."
        )
    plan.regions = parents
    for region in parents:
        module = block.get_submodule(region)
        attrs = {a: getattr(module, a) for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)}
        widths = cut_sizes.get(region, set())
        attrs.update({a: getattr(module, a) for a in WIDTH_ATTRS
                      if isinstance(getattr(module, a, None), int) and getattr(module, a) in widths})
        for attr, value in attrs.items():
            _divisible(f"{block_name}.{region}", attr, value, tp)
        if attrs:
            plan.head_attrs[region] = attrs
        plan.partial_params += _region_params(block_name, region, module, plan)
    plan.partial_params += _block_params(block_name, block, plan, sequence_parallel)
    return plan


def _region_params(block_name: str, region: str, module: nn.Module, plan: BlockPlan) -> list[str]:
    """Replicated parameters inside a region: they see this rank's heads only, so their gradients are
    partial sums (per-head ``q_norm`` / ``k_norm``). Anything else with parameters is refused."""
    out: list[str] = []
    widths = {linear_features(module.get_submodule(n[len(region) + 1:]))[1]
              for n, k in plan.linears.items() if k == "colwise" and n.startswith(region + ".")}
    latent = {linear_features(module.get_submodule(d[len(region) + 1:]))[1] for d in plan.low_rank.values()
              if d.startswith(region + ".")}
    for sub_name, sub in module.named_modules():
        path = f"{region}.{sub_name}" if sub_name else region
        if path in plan.linears:
            continue
        own = [n for n, _ in sub.named_parameters(recurse=False)]
        if not own:
            continue
        size = getattr(sub, "weight", None)
        size = int(size.shape[-1]) if size is not None and size.dim() >= 1 else None
        # A per-head norm, or one on a replicated low-rank latent (its width at most the down-projection's).
        if sub_name and is_norm(sub) and (size not in widths or any(size is not None and size <= w for w in latent)):
            out += [f"{path}.{n}" for n in own]
            continue
        why = (f"normalises over {size} features, a full width that tensor parallelism splits across ranks"
               if is_norm(sub) else "is not a linear layer or a per-head norm, so its sharded layout is unknown")
        raise ValueError(
            f"{block_name}.{path} holds parameters ({', '.join(own)}) inside the tensor-parallel region "
            f"{block_name}.{region} and {why}. Implement {_HOOK} for this model, or use tp=1."
        )
    return out


def _block_params(block_name: str, block: nn.Module, plan: BlockPlan, sequence_parallel: bool) -> list[str]:
    """Under SP, plain parameters of a block outside its regions and norms see sequence shards: refused
    (their math along the sequence is unknown)."""
    if not sequence_parallel:
        return []
    handled = set(plan.regions) | set(plan.norms) | set(plan.moe)
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
        >>> from lightning_4d.trace import trace_model
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
