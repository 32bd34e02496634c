"""Automatic tensor/sequence-parallel plans from module names (pure: no process group).

Conventions recognised (DESIGN.md):

- column-parallel (output features split): ``wq wk wv`` / ``q_proj k_proj v_proj`` / ``c_attn``
  (fused, per-head interleaved), ``w1 w3`` / ``gate_proj up_proj`` / ``c_fc``;
- row-parallel (input features split, one reduction): ``wo`` / ``o_proj`` / ``w2`` / ``down_proj`` / ``c_proj``;
- norms (``LayerNorm``, ``RMSNorm``) directly inside a block: sequence-parallel;
- the token embedding (an ``nn.Embedding`` with the vocabulary size): vocab-parallel;
- the output head (the ``nn.Linear`` to the vocabulary after the blocks): column-parallel, with a
  parallel cross-entropy (``loss_parallel``).

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

__all__ = [
    "COLWISE_NAMES",
    "ROWWISE_NAMES",
    "HEAD_ATTRS",
    "BlockPlan",
    "ModelPlan",
    "block_plan",
    "model_plan",
    "is_norm",
    "is_moe",
]

COLWISE_NAMES = frozenset({"wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "c_attn", "w1", "w3", "gate_proj",
                           "up_proj", "c_fc"})
ROWWISE_NAMES = frozenset({"wo", "o_proj", "w2", "down_proj", "c_proj"})
# Per-rank head counts that attention code uses in view/reshape calls.
HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "n_kv_heads", "num_key_value_heads", "num_attention_heads",
              "n_local_heads", "n_local_kv_heads", "num_kv_heads")


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

    linears: dict[str, str] = field(default_factory=dict)  # name -> "colwise" | "rowwise"
    regions: list[str] = field(default_factory=list)  # modules entered with replicated (gathered) input
    norms: list[str] = field(default_factory=list)
    moe: list[str] = field(default_factory=list)
    head_attrs: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> {attr: global value}


@dataclass
class ModelPlan:
    """Layout of the modules around the blocks (names relative to the LightningModule).

    Example:
        >>> ModelPlan().head is None
        True
    """

    embedding: Optional[str] = None
    embedding_parent: Optional[str] = None  # set when the embedding is summed with others (GPT-2 wte + wpe)
    head: Optional[str] = None
    final_norms: list[str] = field(default_factory=list)
    vocab_size: Optional[int] = None


def _divisible(owner: str, attr: str, value: int, tp: int) -> None:
    if value % tp != 0:
        raise ValueError(
            f"{owner}.{attr}={value} is not divisible by tp={tp}: tensor parallelism splits it evenly across ranks. "
            f"Choose tp among the divisors of {value}, or give an explicit plan with `fourd_tp_plan`."
        )


def block_plan(block: nn.Module, block_name: str, tp: int) -> BlockPlan:
    """Plan one block from its module names; raise naming the module when it does not fit.

    Example:
        >>> from lightning_4d.models import GPT2, GPT2Config
        >>> b = GPT2(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, block_size=8)).h[0]
        >>> block_plan(b, "h.0", tp=2).regions
        ['attn', 'mlp']
    """
    plan = BlockPlan()
    moe_prefixes: list[str] = []
    for name, module in block.named_modules():
        if not name:
            continue
        if any(name == p or name.startswith(p + ".") for p in moe_prefixes):
            continue  # expert weights are never treated as dense layers
        if is_moe(module):
            moe_prefixes.append(name)
            plan.moe.append(name)
            continue
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear):
            if leaf in COLWISE_NAMES:
                _divisible(f"{block_name}.{name}", "out_features", module.out_features, tp)
                plan.linears[name] = "colwise"
            elif leaf in ROWWISE_NAMES:
                _divisible(f"{block_name}.{name}", "in_features", module.in_features, tp)
                plan.linears[name] = "rowwise"
            else:
                raise ValueError(
                    f"{block_name}.{name} is an nn.Linear whose name {leaf!r} matches no tensor-parallel convention "
                    f"(column: {', '.join(sorted(COLWISE_NAMES))}; row: {', '.join(sorted(ROWWISE_NAMES))}). "
                    f"Rename it or implement `fourd_tp_plan(self)` on your FourDModule."
                )
        elif is_norm(module) and "." not in name:
            plan.norms.append(name)
    parents = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n, k in plan.linears.items() if k == "colwise"})
    if "" in parents:
        raise ValueError(
            f"{block_name} holds column-parallel linears directly; put attention and MLP in submodules or "
            f"implement `fourd_tp_plan(self)`."
        )
    plan.regions = parents
    for region in parents:
        module = block.get_submodule(region)
        attrs = {a: getattr(module, a) for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)}
        for attr, value in attrs.items():
            _divisible(f"{block_name}.{region}", attr, value, tp)
        if attrs:
            plan.head_attrs[region] = attrs
    return plan


def model_plan(root: nn.Module, blocks_path: str, tp: int) -> ModelPlan:
    """Find the token embedding, final norm(s) and output head around the blocks.

    Example:
        >>> from lightning_4d.models import Llama, LlamaConfig
        >>> m = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4))
        >>> p = model_plan(m, "layers", tp=2); (p.embedding, p.head, p.final_norms)
        ('tok_embeddings', 'output', ['norm'])
    """
    parent_path, _, container_name = blocks_path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    prefix = f"{parent_path}." if parent_path else ""
    names = [n for n, _ in parent.named_children()]
    idx = names.index(container_name)
    before, after = names[:idx], names[idx + 1 :]
    plan = ModelPlan()
    heads = [n for n in after if isinstance(getattr(parent, n), nn.Linear)]
    if heads:
        head = getattr(parent, heads[-1])
        plan.head, plan.vocab_size = prefix + heads[-1], head.out_features
        _divisible(plan.head, "out_features", head.out_features, tp)
    plan.final_norms = [prefix + n for n in after if is_norm(getattr(parent, n))]
    for n in before:
        child = getattr(parent, n)
        candidates = [(sub_name, m) for sub_name, m in child.named_modules() if isinstance(m, nn.Embedding)]
        for sub_name, emb in candidates:
            if plan.vocab_size is None or emb.num_embeddings == plan.vocab_size:
                _divisible(prefix + n + (f".{sub_name}" if sub_name else ""), "num_embeddings", emb.num_embeddings, tp)
                plan.embedding = prefix + n + (f".{sub_name}" if sub_name else "")
                plan.embedding_parent = None if not sub_name else prefix + n
                break
        if plan.embedding:
            break
    return plan
