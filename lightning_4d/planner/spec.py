"""What the planner knows about a model and a training run: :class:`TransformerSpec`, :class:`TrainSpec`.

A :class:`TransformerSpec` is the handful of numbers that fix a decoder-only transformer's parameter
count, FLOPs and activation sizes (dense or mixture-of-experts). It is built from the package's own
config dataclasses (duck-typed: ``LlamaConfig``, ``GPT2Config``, ``HFStyleConfig``, ``MoEConfig``) with
:meth:`TransformerSpec.from_config`, and its counts equal ``sum(p.numel())`` of the real models.

Parameter counts per component (``h`` hidden, ``a`` heads, ``g`` kv heads, ``d = h/a``, ``V`` vocab,
``F`` dense MLP hidden, ``E`` experts of hidden ``Fe``, ``k`` top-k, ``σ`` = 3 for a gated (SwiGLU)
MLP, 2 otherwise):

- embedding ``V·h`` (+ ``P·h`` learned positions); head ``h·V`` unless tied;
- attention per layer ``h·a·d + 2·h·g·d + a·d·h`` (+ biases);
- dense MLP ``σ·h·F`` (+ biases); MoE layer: experts ``E·σ·h·Fe``, router ``h·E``,
  shared experts ``σ·h·(S·Fe)``;
- norms: two per layer plus the final one, ``h`` each (``2h`` for LayerNorm with bias).

Active parameters per token replace ``E`` by ``k`` in every MoE layer.

Example:
    >>> spec = TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1, ffn_hidden=4)
    >>> spec.total_params(), spec.components()["attention"]
    (188, 64)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_4d.config import DATA_PARALLEL
from lightning_4d.models.flops import training_flops_per_token
from lightning_4d.models.moe import is_moe_layer
from lightning_4d.core.precision import PLANNER_PRECISIONS, precision_info

if TYPE_CHECKING:
    from torch import nn

    from lightning_4d.models.gpt2 import GPT2Config
    from lightning_4d.models.hf_style import HFStyleConfig
    from lightning_4d.models.llama import LlamaConfig

__all__ = ["TransformerSpec", "TrainSpec", "seed_moe_1t", "planner_only", "runtime_speed_notes", "DATA_PARALLEL_MODES",
           "SELECTIVE_POLICIES", "RUNTIME_SELECTIVE_POLICY", "KERNELS", "ATTENTION_KINDS"]

#: Data-parallel modes the planner models (:mod:`lightning_4d.planner.dp_modes`): the runtime's
#: (``lightning_4d.config.DATA_PARALLEL``) plus ZeRO-1/2, which only the planner models.
DATA_PARALLEL_MODES = (*DATA_PARALLEL, "zero1", "zero2")
#: What ``activation_checkpointing="selective"`` saves: the package's policy (``"matmuls"``: every matmul and
#: attention output) or TorchTitan's op-level policy (``"every_other_matmul"``: every second matmul output,
#: attention outputs; the other matmuls are recomputed).
SELECTIVE_POLICIES = ("matmuls", "every_other_matmul")
#: The policy the runtime's ``activation_checkpointing="selective"`` runs (``lightning_4d.layout.parallelize``).
RUNTIME_SELECTIVE_POLICY = "matmuls"
#: What the kernels keep for backward (:func:`lightning_4d.planner.memory.activation_coefficients`): ``"eager"``,
#: PyTorch's eager kernels as the runtime and TorchTitan run them (SwiGLU keeps ``silu(w1 x)`` too; keys and values
#: expanded to every query head before attention; the attention output kept by the kernel and again as the output
#: projection's input), or ``"fused"``, Megatron / Transformer Engine's (Korthikanti et al.'s counts).
KERNELS = ("eager", "fused")


def planner_only(train: "TrainSpec") -> list[str]:
    """The options of ``train`` the planner models but lightning_4d cannot run yet, each with what runs instead
    (plans label them; ``recipes/plan.py`` prints them).

    Example:
        >>> planner_only(TrainSpec(8, activation_checkpointing="selective", selective_policy="every_other_matmul"))
        ... # doctest: +ELLIPSIS
        ["selective_policy=every_other_matmul (TorchTitan's op-level policy): planner only; ...]
        >>> planner_only(TrainSpec(8))
        []
    """
    out = []
    if train.activation_checkpointing == "selective" and train.selective_policy != RUNTIME_SELECTIVE_POLICY:
        out.append(f"selective_policy={train.selective_policy} (TorchTitan's op-level policy): planner only; the "
                   f"runtime's activation_checkpointing=selective saves every matmul and attention output "
                   f"(selective_policy={RUNTIME_SELECTIVE_POLICY})")
    if train.data_parallel not in DATA_PARALLEL:
        out.append(f"data_parallel={train.data_parallel} (sharded optimizer states{' and gradients' if train.data_parallel == 'zero2' else ''}, "
                   f"kept parameters): planner only; the runtime offers {', '.join(DATA_PARALLEL)}")
    if train.kernels == "fused":
        out.append("kernels=fused (Megatron / Transformer Engine: fused SwiGLU, attention on grouped keys and values): "
                   "planner only; the runtime runs PyTorch's eager kernels")
    return out


def runtime_speed_notes(train: "TrainSpec") -> list[str]:
    """What the runtime does for the plan's ``compile`` and ``float8`` (both run: :mod:`lightning_4d.speed`), and
    how the planner models it (plans print them).

    Example:
        >>> [note.split(";")[0] for note in runtime_speed_notes(TrainSpec(8, compile=True))]  # doctest: +ELLIPSIS
        ['compile: the runtime compiles each block with torch.compile (parallel.compile=true) after TP/SP, ...']
        >>> runtime_speed_notes(TrainSpec(8))
        []
    """
    out = []
    if train.compile:
        out.append("compile: the runtime compiles each block with torch.compile (parallel.compile=true) after "
                   "TP/SP, cp, ep and activation checkpointing, before FSDP2; modelled as the memory-bound traffic "
                   "fused to COMPILE_FACTOR of eager's (docs/speed.md compares it with bench/bench_compile.py)")
    if train.float8:
        out.append("float8: the runtime trains the linear layers in Float8 with torchao (parallel.float8=true; "
                   "tensorwise dynamic scaling, not the output head nor MoE experts); modelled on Float8 tensor "
                   "cores, which a CPU emulates (slower there)")
    return out


def _positive(name: str, value: object, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}.")


#: ``TransformerSpec.attention``: plain causal attention or a sliding window (context parallelism splits both: the
#: mask is recomputed from global positions), or what it refuses at set-up
#: (:func:`lightning_4d.context_parallel.check.check_declared`): logit soft-capping, ALiBi's position bias.
ATTENTION_KINDS = ("causal", "sliding_window", "softcap", "alibi")
#: The kinds context parallelism cannot split.
CP_UNSPLITTABLE = ("softcap", "alibi")


@dataclass(frozen=True)
class TransformerSpec:
    """Shape of a decoder-only transformer (see the module docstring for the counting rules).

    ``kv_heads=None`` means ``heads``; ``ffn_hidden=None`` means ``4·hidden``. A model is MoE when
    ``num_experts > 0``: layer ``i`` is MoE when ``i >= first_dense_layers`` and
    ``(i − first_dense_layers) % moe_every == 0`` (the rule of ``lightning_4d.models.moe``).
    ``router_aux_loss``: the routers compute a load-balancing loss from statistics all-reduced over the
    expert groups (``aux_loss_coef > 0``); it only adds small collectives.

    Example:
        >>> moe = TransformerSpec(vocab_size=64, hidden=32, layers=3, heads=4, ffn_hidden=64,
        ...                       num_experts=4, top_k=2, expert_hidden=32, first_dense_layers=1)
        >>> moe.moe_layer_ids, moe.total_params() - moe.active_params_per_token()
        ([1, 2], 12288)
    """

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    num_experts: int = 0
    top_k: int = 0
    expert_hidden: int = 0
    moe_every: int = 1
    first_dense_layers: int = 0
    shared_experts: int = 0
    tied_embeddings: bool = False
    seq_len: int = 2048
    gated_mlp: bool = True
    norm: str = "rmsnorm"
    norm_bias: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    learned_positions: int = 0
    name: str = ""
    router_aux_loss: bool = False
    fused_qkv: bool = False  # one (3·h)-row q|k|v projection (GPT-2's c_attn) instead of three
    head_size: Optional[int] = None  # width of one head when it is not hidden // heads (Qwen3, Gemma)
    qk_norm: bool = False  # a norm of width head_dim on q and on k in every layer (Qwen3, OLMo 2)
    attention: str = "causal"  # ATTENTION_KINDS: whether context parallelism can split it (cp_refusal)

    def __post_init__(self) -> None:
        for n in ("vocab_size", "hidden", "layers", "heads", "seq_len", "moe_every"):
            _positive(n, getattr(self, n))
        for n in ("num_experts", "top_k", "expert_hidden", "first_dense_layers", "shared_experts",
                  "learned_positions"):
            _positive(n, getattr(self, n), allow_zero=True)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if (self.head_size is None and self.hidden % self.heads) or self.heads % self.kv_heads:
            raise ValueError(f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}: hidden must be a "
                             f"multiple of heads (or give head_size) and heads a multiple of kv_heads.")
        _positive("head_size", self.head_size if self.head_size is not None else 1)
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={self.attention!r} must be one of {ATTENTION_KINDS}.")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm={self.norm!r} must be 'rmsnorm' or 'layernorm'.")
        if self.num_experts and not (1 <= self.top_k <= self.num_experts and self.expert_hidden >= 1):
            raise ValueError(f"MoE needs 1 <= top_k <= num_experts and expert_hidden >= 1; got top_k={self.top_k}, "
                             f"num_experts={self.num_experts}, expert_hidden={self.expert_hidden}.")

    def cp_refusal(self, cp: int, seq_len: Optional[int] = None, tp: int = 1) -> Optional[str]:
        """Why context parallelism of degree ``cp`` cannot split this model's attention on sequences of ``seq_len``
        tokens (``None``: the spec's) with sequence parallelism over ``tp``, or ``None`` when it can: the attention
        must not be one the set-up refuses (:data:`CP_UNSPLITTABLE`: logit soft-capping, ALiBi;
        :mod:`lightning_4d.context_parallel.check`) and the sequence must cut into ``2·cp`` zigzag chunks
        (:func:`lightning_4d.context_parallel.zigzag.check_sequence_length`).

        Example:
            >>> spec = TransformerSpec(vocab_size=8, hidden=8, layers=1, heads=2, seq_len=8)
            >>> spec.cp_refusal(2) is None, spec.cp_refusal(8)[:23]
            (True, 'sequence length 8 is no')
            >>> spec.with_(attention="sliding_window").cp_refusal(2) is None
            True
            >>> spec.with_(attention="alibi").cp_refusal(2)[:26]
            'its attention is alibi: co'
        """
        from lightning_4d.context_parallel.zigzag import check_sequence_length

        if cp == 1:
            return None
        if self.attention in CP_UNSPLITTABLE:
            return (f"its attention is {self.attention}: context parallelism recomputes the mask from global "
                    f"positions (causal, per document, sliding window) and cannot split that attention")
        try:
            check_sequence_length(seq_len or self.seq_len, cp, tp)
        except ValueError as err:
            return str(err)
        return None

    # ----------------------------------------------------------------- structure
    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``head_size``, else ``hidden // heads``."""
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the output projection's input), ``heads · head_dim`` (``hidden`` unless
        ``head_size`` says otherwise)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values), ``kv_heads · head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def gathered_kv_width(self) -> int:
        """Width of the keys (and values) context parallelism all-gathers, ``heads · head_dim``: attention reads K/V
        repeated to every query head (a model repeats them before ``scaled_dot_product_attention``, or the cp
        attention does for ``enable_gqa``), so GQA saves nothing on the cp axis (found by the planner's dry run).

        Example:
            >>> TransformerSpec(vocab_size=8, hidden=64, layers=1, heads=4, kv_heads=2).gathered_kv_width
            64
        """
        return self.heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return self.num_experts > 0 and bool(self.moe_layer_ids)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` has an MoE feed-forward."""
        if 0 <= i < self.layers:
            return self._moe_flags[i]
        return self.num_experts > 0 and is_moe_layer(i, self.first_dense_layers, self.moe_every)

    @cached_property
    def _moe_flags(self) -> tuple[bool, ...]:
        """Per layer, whether it is an MoE layer (computed once: the layout search asks for every candidate)."""
        return tuple(self.num_experts > 0 and is_moe_layer(i, self.first_dense_layers, self.moe_every)
                     for i in range(self.layers))

    @property
    def moe_layer_ids(self) -> list[int]:
        """Indices of the MoE layers."""
        return [i for i, moe in enumerate(self._moe_flags) if moe]

    # ----------------------------------------------------------------- counts
    @property
    def norm_params(self) -> int:
        """Parameters of one norm."""
        return self.hidden * (2 if self.norm == "layernorm" and self.norm_bias else 1)

    def attention_params(self) -> int:
        """Parameters of one attention block (projections and their biases)."""
        h, a, g, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        n = h * a * d + 2 * h * g * d + a * d * h
        n += (a * d + 2 * g * d) if self.qkv_bias else 0
        return n + (h if self.out_bias else 0)

    def mlp_params(self, hidden: int, bias: Optional[bool] = None) -> int:
        """Parameters of one (gated or plain) MLP of inner width ``hidden``."""
        bias = self.mlp_bias if bias is None else bias
        up = 2 if self.gated_mlp else 1
        return (up + 1) * self.hidden * hidden + ((up * hidden + self.hidden) if bias else 0)

    def expert_params(self) -> int:
        """Parameters of one routed expert (bias-free, as in ``lightning_4d.expert_parallel.MoE``)."""
        return self.mlp_params(self.expert_hidden, bias=False)

    def layer_params(self, i: int) -> dict[str, int]:
        """Parameters of layer ``i`` by component: attention, norms, dense_mlp, experts, router, shared_experts.

        Example:
            >>> TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1, ffn_hidden=4).layer_params(0)["dense_mlp"]
            48
        """
        return dict(self._layer_kinds[self.is_moe_layer(i)])

    @cached_property
    def _layer_kinds(self) -> dict[bool, dict[str, int]]:
        """Component counts of a dense (``False``) and an MoE (``True``) layer, computed once."""
        out = {}
        for moe in (False, True):
            d = {"attention": self.attention_params(), "norms": 2 * self.norm_params + 2 * self.head_dim * self.qk_norm,
                 "dense_mlp": 0, "experts": 0, "router": 0, "shared_experts": 0}
            if moe and self.num_experts:
                d["experts"] = self.num_experts * self.expert_params()
                d["router"] = self.hidden * self.num_experts
                if self.shared_experts:
                    d["shared_experts"] = self.mlp_params(self.shared_experts * self.expert_hidden, bias=False)
            else:
                d["dense_mlp"] = self.mlp_params(self.ffn_hidden)
            out[moe] = d
        return out

    @property
    def embedding_params(self) -> int:
        """Token table plus learned position table."""
        return (self.vocab_size + self.learned_positions) * self.hidden

    @property
    def head_params(self) -> int:
        """Output head (0 when tied to the token table)."""
        return 0 if self.tied_embeddings else self.hidden * self.vocab_size

    def components(self) -> dict[str, int]:
        """Whole-model parameter counts by component (tied weights counted once, in ``embedding``).

        Example:
            >>> sorted(TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1).components())
            ['attention', 'dense_mlp', 'embedding', 'experts', 'head', 'norms', 'router', 'shared_experts']
        """
        return dict(self._components)

    @cached_property
    def _components(self) -> dict[str, int]:
        """:meth:`components`, computed once (the layout search asks for every candidate)."""
        out = {"embedding": self.embedding_params, "attention": 0, "dense_mlp": 0, "experts": 0, "router": 0,
               "shared_experts": 0, "norms": self.norm_params, "head": self.head_params}
        for i in range(self.layers):
            for k, v in self.layer_params(i).items():
                out[k] += v
        return out

    def total_params(self) -> int:
        """All distinct parameters; equals ``sum(p.numel() for p in model.parameters())``."""
        return sum(self.components().values())

    def active_params_per_token(self, exclude_embeddings: bool = False) -> int:
        """Parameters a token touches: ``top_k`` of the ``E`` routed experts per MoE layer.

        ``exclude_embeddings`` drops the lookup tables (the token table only when it is not tied to the
        head), as the models' ``num_params(exclude_embeddings=True)`` do.
        """
        n = self.total_params() - len(self.moe_layer_ids) * (self.num_experts - self.top_k) * self.expert_params()
        if exclude_embeddings:
            n -= self.learned_positions * self.hidden + (0 if self.tied_embeddings else self.vocab_size * self.hidden)
        return n

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token, ``6·N_active + 12·L·a·d·s``: the package's one formula,
        :func:`lightning_4d.models.flops.training_flops_per_token`, with this spec's counts.

        Example:
            >>> TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1, ffn_hidden=4).flops_per_token(2)
            1032
        """
        s = self.seq_len if seq_len is None else seq_len
        return training_flops_per_token(self.active_params_per_token(True), self.layers, self.heads * self.head_dim, s)

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_config(cls, cfg: Union[LlamaConfig, GPT2Config, HFStyleConfig], seq_len: Optional[int] = None,
                    name: str = "") -> "TransformerSpec":
        """Build from a package config, duck-typed on its field names (MoE, Llama, GPT-2, HF style).

        Example:
            >>> from lightning_4d.models import GPT2Config
            >>> cfg = GPT2Config(vocab_size=8, n_embd=4, n_layer=1, n_head=1, block_size=4)
            >>> TransformerSpec.from_config(cfg).total_params()
            300
        """
        if hasattr(cfg, "n_embd"):  # GPT2Config
            b = bool(getattr(cfg, "bias", True))
            return cls(cfg.vocab_size, cfg.n_embd, cfg.n_layer, cfg.n_head, ffn_hidden=4 * cfg.n_embd,
                       tied_embeddings=cfg.tie_embeddings, seq_len=seq_len or cfg.block_size, gated_mlp=False,
                       norm="layernorm", norm_bias=b, qkv_bias=b, out_bias=b, mlp_bias=b,
                       learned_positions=cfg.block_size, name=name or "gpt2", fused_qkv=True)
        if hasattr(cfg, "hidden_size"):  # HFStyleConfig
            return cls(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.intermediate_size, tied_embeddings=cfg.tie_word_embeddings,
                       seq_len=seq_len or cfg.max_position_embeddings, qkv_bias=bool(cfg.attention_bias),
                       name=name or "hf_style")
        if hasattr(cfg, "dim"):  # LlamaConfig or MoEConfig
            ffn = cfg.ffn_hidden
            if ffn is None and hasattr(cfg, "llama_config"):
                ffn = cfg.llama_config().ffn_hidden
            moe = {}
            if getattr(cfg, "num_experts", 0):
                moe = dict(num_experts=cfg.num_experts, top_k=cfg.top_k, expert_hidden=cfg.expert_hidden,
                           moe_every=cfg.moe_every, first_dense_layers=cfg.first_dense_layers,
                           shared_experts=cfg.shared_experts,
                           router_aux_loss=float(getattr(cfg, "aux_loss_coef", 0.0) or 0.0) > 0)
            return cls(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, ffn,
                       tied_embeddings=cfg.tie_embeddings, seq_len=seq_len or cfg.max_seq_len,
                       name=name or ("moe" if moe else "llama"), **moe)
        raise TypeError(f"{type(cfg).__name__} is not a known model config: the planner reads LlamaConfig / MoEConfig "
                        f"(dim, n_layers, ...), GPT2Config (n_embd, ...) or HFStyleConfig (hidden_size, ...) fields. "
                        f"Build a TransformerSpec by hand for other models.")

    @classmethod
    def from_model(cls, model: nn.Module, seq_len: Optional[int] = None) -> "TransformerSpec":
        """Build from a package model (its ``moe_config`` or ``config`` attribute)."""
        cfg = getattr(model, "moe_config", None) or getattr(model, "config", None)
        if cfg is None:
            raise TypeError(f"{type(model).__name__} has no `config`; pass its config to TransformerSpec.from_config.")
        return cls.from_config(cfg, seq_len)

    def with_(self, **changes: Any) -> "TransformerSpec":
        """A copy with some fields changed."""
        return replace(self, **changes)


def seed_moe_1t(seq_len: int = 8192) -> TransformerSpec:
    """The reference "1T MoE" with the shape of ``conf/model/moe_1t.yaml`` (≈1.04 T parameters, ≈40 B active).

    hidden 8192, 40 blocks (4 pipeline stages of 10: layers 0-9 on stage 0, ...), 64 query /
    8 kv heads, every block MoE with 64 routed experts of hidden 16384 and top-2 routing, vocab 128256.
    Its reference layout is TP=8 + SP and EP=8 inside a node, PP across nodes, DP copies
    (``conf/parallel/moe_1t.yaml``); keep the widths equal to the YAML (``tests/unit/test_planner.py`` checks).

    Example:
        >>> spec = seed_moe_1t()
        >>> spec.total_params(), round(spec.active_params_per_token() / 1e9, 1)
        (1038954930176, 40.4)
    """
    return TransformerSpec(vocab_size=128256, hidden=8192, layers=40, heads=64, kv_heads=8, ffn_hidden=28672,
                           num_experts=64, top_k=2, expert_hidden=16384, seq_len=seq_len, name="seed_moe_1t")


@dataclass(frozen=True)
class TrainSpec:
    """Training options that change memory, communication and time.

    Args:
        global_batch_size: sequences per optimizer step (over all dp replicas).
        seq_len: tokens per sequence (``None``: the model spec's).
        microbatches: pipeline micro-batches per step (``None``: the schedule's default ``pp·v``).
        schedule: pipeline schedule name (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zbv``, ``dualpipev``).
        data_parallel: ``"fsdp"`` (FSDP2 ``fully_shard``), ``"replicate"``, ``"hsdp"`` (FSDP2 over a
            ``(dp_replicate, dp_shard)`` mesh: shard inside groups of ``dp_shard`` ranks, replicate across
            them), ``"zero1"`` / ``"zero2"`` (kept parameters, sharded optimizer states / and gradients:
            Megatron's distributed optimizer). See :mod:`lightning_4d.planner.dp_modes`.
        dp_shard: shard-group size of ``hsdp`` (``None``: the dp ranks of one node).
        precision: ``"bf16-mixed"`` (bf16 compute copies and activations, fp32 master weights,
            gradients and AdamW moments) or ``"32-true"``.
        activation_checkpointing: ``None``, ``"selective"`` or ``"full"``.
        flash_attention: attention kernels that store no ``s×s`` matrices (torch SDPA flash /
            memory-efficient); removes the ``5·a·s/h`` term of the activation formula.
        optimizer_state_bytes: bytes of optimizer state per parameter (AdamW: two fp32 moments = 8).
        expert_imbalance: multiplier (>= 1) on the busiest expert rank's tokens, 1.0 = uniform routing.
        reshard_after_forward: FSDP2 blocks free their gathered parameters after forward (``None``: the
            package's choice, as ``lightning_4d.layout.parallelize`` wraps them,
            :func:`lightning_4d.layout.data_parallel.reshards_after_forward`: ``True`` for all blocks but the
            last without pipelining, ``False`` under pipelining (TorchTitan's choice: one all-gather per
            step instead of one per micro-batch)).
        expert_reshard_after_forward: whether the experts' FSDP2 units free their gathered parameters
            after forward (``None``: as the blocks, ``reshard_after_forward`` or the package's choice).
            :func:`lightning_4d.planner.dry_run.dry_run` compares with what the wrapped model really does.
        compile: ``torch.compile`` fuses the memory-bound kernels (:mod:`lightning_4d.planner.compute`).
        selective_policy: what selective checkpointing saves (:data:`SELECTIVE_POLICIES`).
        float8: the linear layers' GEMMs (not the attention core nor the head) run in Float8 with dynamic
            scaling, as TorchTitan's ``float8`` converter (:mod:`lightning_4d.planner.compute`).
        kernels: what the kernels keep for backward (:data:`KERNELS`): ``"eager"`` (the runtime's) or ``"fused"``.
        meta_built: the model is built on the meta device, so set-up holds only this rank's shards plus one
            chunk of initialisation scratch (:mod:`lightning_4d.planner.setup_memory`); ``False``: built for
            real, every rank holds the whole model at set-up.
        cp_algorithm: the context-parallel attention (``"auto"``, ``"allgather"``, ``"ulysses"``, ``"ring"``: the
            runtime's option, :mod:`lightning_4d.context_parallel.algorithm`); :meth:`cp_algorithm_for` resolves it
            per layout.

    Example:
        >>> TrainSpec(global_batch_size=8).act_bytes
        2
    """

    global_batch_size: int
    seq_len: Optional[int] = None
    microbatches: Optional[int] = None
    schedule: str = "1f1b"
    data_parallel: str = "fsdp"
    precision: str = "bf16-mixed"
    activation_checkpointing: Optional[str] = None
    flash_attention: bool = True
    optimizer_state_bytes: int = 8
    expert_imbalance: float = 1.0
    reshard_after_forward: Optional[bool] = None
    expert_reshard_after_forward: Optional[bool] = None
    dp_shard: Optional[int] = None
    compile: bool = False
    selective_policy: str = "matmuls"
    float8: bool = False
    kernels: str = "eager"
    meta_built: bool = True
    cp_algorithm: str = "auto"

    def __post_init__(self) -> None:
        from lightning_4d.context_parallel.algorithm import CP_ALGORITHMS

        _positive("global_batch_size", self.global_batch_size)
        if self.cp_algorithm not in CP_ALGORITHMS:
            raise ValueError(f"cp_algorithm={self.cp_algorithm!r} must be one of {CP_ALGORITHMS}.")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels={self.kernels!r} must be one of {KERNELS}.")
        if self.precision not in PLANNER_PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not modelled; use one of {PLANNER_PRECISIONS}.")
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(f"data_parallel={self.data_parallel!r} must be one of {DATA_PARALLEL_MODES}.")
        if self.dp_shard is not None:
            _positive("dp_shard", self.dp_shard)
        if self.selective_policy not in SELECTIVE_POLICIES:
            raise ValueError(f"selective_policy={self.selective_policy!r} must be one of {SELECTIVE_POLICIES}.")
        if self.activation_checkpointing not in (None, "selective", "full"):
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r}: use None, 'selective' "
                             f"or 'full'.")
        if not self.expert_imbalance >= 1.0:
            raise ValueError(f"expert_imbalance={self.expert_imbalance} must be >= 1 (1 = uniform routing).")

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation / compute-parameter element (2 for bf16, 4 for fp32)."""
        return precision_info(self.precision).compute_bytes

    def seq(self, spec: TransformerSpec) -> int:
        """Sequence length used (this spec's, else the model's)."""
        return self.seq_len or spec.seq_len

    def cp_algorithm_for(self, spec: TransformerSpec, cp: int, tp: int = 1) -> str:
        """The context-parallel algorithm the runtime runs for ``spec`` under ``cp`` and ``tp`` (``""`` at cp=1):
        :func:`~lightning_4d.context_parallel.algorithm.choose_algorithm` on the spec's heads, K/V repeated to every
        query head as SDPA receives them (what the planner's K/V formulas assume too).

        Raises:
            ValueError: ``cp_algorithm="ulysses"`` with heads per tp rank not divisible by ``cp``.

        Example:
            >>> spec = TransformerSpec(vocab_size=8, hidden=64, layers=1, heads=4, kv_heads=2)
            >>> train = TrainSpec(global_batch_size=8)
            >>> train.cp_algorithm_for(spec, 2), train.cp_algorithm_for(spec, 8), train.cp_algorithm_for(spec, 1)
            ('ulysses', 'ring', '')
        """
        from lightning_4d.context_parallel.algorithm import choose_algorithm

        if cp == 1:
            return ""
        return choose_algorithm(self.cp_algorithm, [("the attention", spec.heads, spec.heads, False)], cp, tp)

    def with_(self, **changes: Any) -> "TrainSpec":
        """A copy with some fields changed."""
        return replace(self, **changes)
