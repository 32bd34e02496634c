""""Bring your own model": tiny third-party dense models, written the way their authors write them.

Every builder returns a plain ``nn.Module`` mapping token ids ``(B, T)`` to logits ``(B, T, V)``, in fp32,
deterministic under ``torch.manual_seed``. Nothing here knows about lightning_4d: the only user code
allowed is :class:`HFLogits`, the one-line wrapper that turns a Hugging Face ``…ForCausalLM`` output
into logits.

- Hugging Face ``transformers`` models built from their config classes (no downloads): Llama, Mistral,
  Qwen2 (q/k/v biases), Qwen3 (per-head ``q_norm``/``k_norm``), GPT-2 (``Conv1D``, tied ``wte``/``lm_head``,
  learned positions).
- :class:`NanoGPT`: Karpathy's nanoGPT layout (``transformer = ModuleDict(wte, wpe, drop, h, ln_f)``, tied
  ``lm_head``, one concatenated ``c_attn`` split as ``[q | k | v]``), with the attention reading its widths
  from attributes; ``literal=True`` keeps nanoGPT's own attention, which reads them from the input.
- :class:`Titan`: TorchTitan's Llama layout (``tok_embeddings``, ``layers`` ModuleDict, ``norm``, ``output``)
  with a complex ``freqs_cis`` buffer and a boolean mask passed to every block, and a fused ``wqkv``
  (``fused=False``: separate ``wq``/``wk``/``wv``).

Kinds (see :func:`build_byom`): ``hf-llama``, ``hf-mistral``, ``hf-qwen2``, ``hf-qwen3``, ``hf-gpt2``,
``nanogpt``, ``nanogpt-literal``, ``titan``, ``titan-sep``; an optional ``-<layers>`` suffix sets the depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
SEQ = 16
HIDDEN = 32
FFN = 64
HEADS = 4
KV_HEADS = 2

HF_KINDS = ("hf-llama", "hf-mistral", "hf-qwen2", "hf-qwen3", "hf-gpt2")
OTHER_KINDS = ("nanogpt-literal", "nanogpt", "titan-sep", "titan")
HF_MOE_KINDS = ("hf-mixtral", "hf-qwen2moe", "hf-qwen3moe", "hf-dsv3")
TITAN_MOE_KINDS = ("titan-moe-sig", "titan-moe")
MOE_KINDS = HF_MOE_KINDS + TITAN_MOE_KINDS
# More families (Gemma 2/3, Phi-3, OLMo 2, OLMoE, GPT-OSS, StableLM, multi-query, Falcon, Llama 4, OPT, the torchtitan
# package), weights perturbed as a checkpoint's would be: tests.distributed.byom_zoo.
from tests.distributed.byom_zoo import ZOO_KINDS  # noqa: E402

KINDS = HF_KINDS + OTHER_KINDS + MOE_KINDS + ZOO_KINDS


# ----------------------------------------------------------------------------------------------- Hugging Face
class HFLogits(nn.Module):
    """The only user code: a Hugging Face causal LM as ``tokens -> logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def _llama_family_kwargs(layers: int) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
        attention_dropout=0.0, use_cache=False, attn_implementation="sdpa",
    )


def build_hf(family: str, layers: int = 2) -> nn.Module:
    """A tiny ``transformers`` causal LM built from its config class (random init, seeded by the caller)."""
    import transformers as tf

    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**_llama_family_kwargs(layers)))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**_llama_family_kwargs(layers)))
    elif family == "qwen2":
        # Qwen2 hard-codes bias=True on q_proj/k_proj/v_proj.
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**_llama_family_kwargs(layers)))
    elif family == "qwen3":
        # Per-head RMSNorms q_norm/k_norm over head_dim; head_dim set explicitly (Qwen3 decouples it).
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**_llama_family_kwargs(layers), head_dim=HIDDEN // HEADS))
    elif family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, use_cache=False, attn_implementation="sdpa",
        ))
    else:
        raise ValueError(f"unknown Hugging Face family {family!r}")
    return HFLogits(model.float())


# ----------------------------------------------------------------------------------------------- nanoGPT
@dataclass
class NanoGPTConfig:
    block_size: int = SEQ
    vocab_size: int = VOCAB
    n_layer: int = 2
    n_head: int = HEADS
    n_embd: int = HIDDEN
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, with the per-head widths read from attributes (not from ``x``)."""

    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class LiteralCausalSelfAttention(CausalSelfAttention):
    """nanoGPT's attention verbatim: the widths come from ``x.size()``, so they cannot follow a TP split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: NanoGPTConfig, literal: bool = False) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = (LiteralCausalSelfAttention if literal else CausalSelfAttention)(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT`` (forward returns the logits of every position)."""

    def __init__(self, config: NanoGPTConfig, literal: bool = False) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, literal) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, (
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


# ----------------------------------------------------------------------------------------------- TorchTitan
@dataclass
class TitanArgs:
    dim: int = HIDDEN
    n_layers: int = 2
    n_heads: int = HEADS
    n_kv_heads: int = KV_HEADS
    vocab_size: int = VOCAB
    ffn_hidden: int = FFN
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = SEQ
    fused_qkv: bool = True


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    assert freqs_cis.shape == (seqlen, x.shape[-1]), (freqs_cis.shape, x.shape)
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class TitanAttention(nn.Module):
    def __init__(self, args: TitanArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.fused = args.fused_qkv
        if self.fused:
            self.wqkv = nn.Linear(args.dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
            self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_masks: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        if self.fused:
            xq, xk, xv = self.wqkv(x).split(
                [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim], dim=-1
            )
        else:
            xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1 infers the local head count (n_heads or n_kv_heads), so the views follow a TP split
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq = xq.transpose(1, 2)
        xk = keys.transpose(1, 2)
        xv = values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=attention_masks)
        output = output.transpose(1, 2).contiguous()
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanTransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TitanArgs) -> None:
        super().__init__()
        self.attention = TitanAttention(args)
        self.feed_forward = TitanFeedForward(args.dim, args.ffn_hidden)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.layer_id = layer_id

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_masks: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class Titan(nn.Module):
    """TorchTitan's Llama layout: blocks take the rotary table and a mask as extra positional inputs."""

    def __init__(self, args: TitanArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer(
            "freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, args.rope_theta),
            persistent=True,
        )
        self.layers = nn.ModuleDict({str(i): TitanTransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            for name, p in layer.named_parameters():
                if p.dim() == 2:
                    std = 0.02 if name.endswith(("wqkv.weight", "wq.weight", "wk.weight", "wv.weight", "w1.weight"))\
                        else 0.02 / math.sqrt(2 * (layer.layer_id + 1))
                    nn.init.trunc_normal_(p, mean=0.0, std=std)
        final_out_std = self.args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std, a=-3 * final_out_std,
                              b=3 * final_out_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        attention_masks = torch.ones(seqlen, seqlen, dtype=torch.bool, device=tokens.device).tril()
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis[:seqlen], attention_masks)
        h = self.norm(h)
        return self.output(h)


# ----------------------------------------------------------------------------------------------- dispatch
def is_byom_kind(kind: str) -> bool:
    return any(kind == k or kind.startswith(k + "-") for k in KINDS)


def build_byom(kind: str) -> nn.Module:
    """Build ``kind`` (one of :data:`KINDS`, optionally with a ``-<layers>`` suffix, e.g. ``titan-4``)."""
    base = next((k for k in sorted(KINDS, key=len, reverse=True) if kind == k or kind.startswith(k + "-")), None)
    if base is None:
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(KINDS)}")
    rest = kind[len(base) + 1 :]
    if rest and not rest.isdigit():
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(KINDS)} (with an optional -<layers>)")
    layers = int(rest) if rest else 2
    if layers < 2:
        raise ValueError(f"{kind!r}: keep at least 2 layers")
    if base in ZOO_KINDS:
        from tests.distributed.byom_zoo import build_zoo

        return build_zoo(base, layers)
    if base in HF_KINDS:
        return build_hf(base[len("hf-"):], layers)
    if base in HF_MOE_KINDS:
        return build_hf_moe(base[len("hf-"):], layers)
    if base in TITAN_MOE_KINDS:
        return build_titan_moe(base, layers)
    if base in ("nanogpt", "nanogpt-literal"):
        return NanoGPT(NanoGPTConfig(n_layer=layers), literal=base == "nanogpt-literal")
    return Titan(TitanArgs(n_layers=layers, fused_qkv=base == "titan"))


# ======================================================================================= mixture-of-experts models
# Tiny real MoE models for the expert-parallel parity tests (tests/distributed/test_byom_moe.py). Each keeps its
# experts in ONE module holding 3-D parameters [E, ...] next to a router holding an (E, hidden) weight, the layout
# lightning_4d shards in place over ep. All use 4 experts, top-2, fp32. Router weights are drawn with a std that
# gives logits of std ~1 on the RMS-normalised hidden states (ROUTER_STD·√HIDDEN ≈ 1.1), so routing is neither
# uniform nor collapsed and near-ties (which rounding could flip between layouts) are rare.
MOE_EXPERTS = 4
MOE_TOP_K = 2
MOE_FFN = 32  # per-expert intermediate size
ROUTER_STD = 0.2


def _moe_router_init(model: nn.Module) -> None:
    """Redraw every MoE router weight (the ``gate`` next to an ``experts`` module) with :data:`ROUTER_STD`."""
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "experts") and hasattr(mod, "gate"):
                nn.init.normal_(mod.gate.weight, mean=0.0, std=ROUTER_STD)


def build_hf_moe(family: str, layers: int = 2) -> nn.Module:
    """A tiny transformers-5 MoE causal LM (fused ``experts`` module with ``gate_up_proj``/``down_proj``).

    - ``mixtral``: softmax over all experts → top-2 → renormalised.
    - ``qwen2moe``: softmax top-2 without renormalisation, a dense ``shared_expert`` scaled by
      ``sigmoid(shared_expert_gate(x))``, q/k/v biases.
    - ``qwen3moe``: ``norm_topk_prob=True``, per-head ``q_norm``/``k_norm``.
    - ``dsv3``: DeepSeek-V3 — MLA attention (low-rank q and kv: ``q_a_proj → q_a_layernorm → q_b_proj``,
      ``kv_a_proj_with_mqa → kv_a_layernorm → kv_b_proj``), sigmoid scores, grouped routing (``n_group=2``, ``topk_group=1``:
      each token picks one group of 2 experts), a nonzero random ``e_score_correction_bias`` that changes the
      group choice, ``routed_scaling_factor``, one shared expert, and layer 0 dense (``first_k_dense_replace=1``).
    """
    import transformers as tf

    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, max_position_embeddings=SEQ,
                attention_dropout=0.0, use_cache=False, attn_implementation="sdpa")
    gqa = dict(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    if family == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(
            **base, **gqa, intermediate_size=MOE_FFN, num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
            router_jitter_noise=0.0))
    elif family == "qwen2moe":
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **base, **gqa, intermediate_size=FFN, moe_intermediate_size=MOE_FFN, shared_expert_intermediate_size=48,
            num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, decoder_sparse_step=1, norm_topk_prob=False))
    elif family == "qwen3moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **base, **gqa, head_dim=HIDDEN // HEADS, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
            num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, decoder_sparse_step=1, norm_topk_prob=True))
    elif family == "dsv3":
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **base, num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=FFN,
            moe_intermediate_size=MOE_FFN, n_routed_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, n_group=2,
            topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8))
        with torch.no_grad():
            for mod in model.modules():
                if hasattr(mod, "e_score_correction_bias"):
                    # Changes the winning group for ~10-20% of the tokens (measured on the test data) and keeps
                    # both groups busy.
                    mod.e_score_correction_bias.copy_(torch.randn(MOE_EXPERTS) * 0.1)
    else:
        raise ValueError(f"unknown Hugging Face MoE family {family!r}")
    _moe_router_init(model)
    return HFLogits(model.float())


# ------------------------------------------------------------------------------------------ TorchTitan-style MoE
@dataclass
class TitanMoEArgs:
    dim: int = HIDDEN
    n_layers: int = 2
    n_heads: int = HEADS
    n_kv_heads: int = KV_HEADS
    vocab_size: int = VOCAB
    ffn_hidden: int = FFN  # dense blocks
    moe_hidden: int = MOE_FFN  # per expert (and per shared expert)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = SEQ
    num_experts: int = MOE_EXPERTS
    top_k: int = MOE_TOP_K
    num_shared_experts: int = 1
    score_func: str = "softmax"  # or "sigmoid"
    route_norm: bool = False
    route_scale: float = 1.0
    score_before_experts: bool = False
    n_dense_layers: int = 0  # the first blocks keep a dense feed-forward


class TitanGroupedExperts(nn.Module):
    """All experts of a layer as 3-D weights; tokens arrive already sorted by expert with per-expert counts."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # x: (M, H) grouped by expert; one plain matmul chain per expert (the for-loop path, no grouped_mm).
        sizes = [int(n) for n in num_tokens_per_expert.tolist()]
        outs = []
        for e, chunk in enumerate(torch.split(x[: sum(sizes)], sizes, dim=0)):
            h = F.silu(chunk @ self.w1[e].transpose(0, 1)) * (chunk @ self.w3[e].transpose(0, 1))
            outs.append(h @ self.w2[e].transpose(0, 1))
        out = torch.cat(outs, dim=0)
        pad = x.shape[0] - out.shape[0]
        return torch.cat([out, out.new_zeros(pad, out.shape[1])]) if pad else out

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=std)


class TitanTopKRouter(nn.Module):
    """Token-choice top-k routing: a linear ``gate``, softmax or sigmoid scores (in fp32), top-k, optional
    renormalisation and scale; also returns the assignments per expert."""

    def __init__(self, args: TitanMoEArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()  # (N, E)
        if self.score_func == "softmax":
            scores = F.softmax(logits, dim=-1)
        elif self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            raise ValueError(self.score_func)
        top_scores, chosen = torch.topk(scores, k=self.top_k, dim=-1)  # (N, k)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        counts = torch.histc(chosen.reshape(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, chosen, counts


class TitanTokenReorderer(nn.Module):
    """Stateless: order the (token, slot) assignments by expert (stable), count them per expert."""

    def __init__(self, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(self, top_scores: torch.Tensor, chosen: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = chosen.reshape(-1)  # (N·k,)
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)
        order = torch.argsort(flat, stable=True)
        return top_scores.reshape(-1)[order], order // self.top_k, counts


class TitanMoE(nn.Module):
    def __init__(self, args: TitanMoEArgs) -> None:
        super().__init__()
        self.experts = TitanGroupedExperts(args.dim, args.moe_hidden, args.num_experts)
        self.router = TitanTopKRouter(args)
        self.reorderer = TitanTokenReorderer(args.num_experts, args.top_k)
        self.shared_experts = (TitanFeedForward(args.dim, args.moe_hidden * args.num_shared_experts)
                               if args.num_shared_experts > 0 else None)
        self.score_before_experts = args.score_before_experts
        # Usage statistics, accumulated in forward (as TorchTitan does for its load balancing).
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.reshape(-1, dim)  # (N, H)
        top_scores, chosen, counts = self.router(x)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        scores_sorted, token_idx, num_tokens_per_expert = self.reorderer(top_scores, chosen)
        index = token_idx.reshape(-1, 1).expand(-1, dim)  # (N·k, H)
        routed_in = torch.gather(x, 0, index)  # (N·k, H) sorted by expert
        if self.score_before_experts:
            routed_in = (routed_in.float() * scores_sorted.reshape(-1, 1)).to(x.dtype)
        routed_out = self.experts(routed_in, num_tokens_per_expert)  # (N·k, H)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if not self.score_before_experts:
            routed_out = (routed_out.float() * scores_sorted.reshape(-1, 1)).to(x.dtype)
        out = out.scatter_add(0, index, routed_out)
        return out.reshape(bs, slen, dim)

    def init_weights(self, std: float) -> None:
        self.experts.init_weights(std)
        nn.init.normal_(self.router.gate.weight, mean=0.0, std=ROUTER_STD)
        if self.shared_experts is not None:
            nn.init.trunc_normal_(self.shared_experts.w1.weight, mean=0.0, std=0.02)
            for lin in (self.shared_experts.w2, self.shared_experts.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)


class TitanMoEBlock(nn.Module):
    def __init__(self, layer_id: int, args: TitanMoEArgs) -> None:
        super().__init__()
        self.attention = TitanAttention(TitanArgs(dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                                                  max_seq_len=args.max_seq_len, fused_qkv=False))
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = TitanMoE(args)
        else:
            self.feed_forward = TitanFeedForward(args.dim, args.ffn_hidden)
        self.layer_id = layer_id
        self.weight_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor,
                attention_masks: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class TitanMoEModel(nn.Module):
    """TorchTitan's MoE decoder layout (as in its DeepSeek-V3 / Llama 4 models): ``tok_embeddings``, ``layers``
    ModuleDict of blocks called with ``freqs_cis`` and a mask, each with ``attention`` and a ``moe`` (router,
    token reorderer, grouped experts, optional shared experts) or a dense ``feed_forward``; ``norm``, ``output``."""

    def __init__(self, args: TitanMoEArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer(
            "freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, args.rope_theta),
            persistent=True,
        )
        self.layers = nn.ModuleDict({str(i): TitanMoEBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            attn = layer.attention
            for lin in (attn.wq, attn.wk, attn.wv):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
            nn.init.trunc_normal_(attn.wo.weight, mean=0.0, std=layer.weight_init_std)
            if layer.moe_enabled:
                layer.moe.init_weights(layer.weight_init_std)
            else:
                nn.init.trunc_normal_(layer.feed_forward.w1.weight, mean=0.0, std=0.02)
                for lin in (layer.feed_forward.w2, layer.feed_forward.w3):
                    nn.init.trunc_normal_(lin.weight, mean=0.0, std=layer.weight_init_std)
        std = self.args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        attention_masks = torch.ones(seqlen, seqlen, dtype=torch.bool, device=tokens.device).tril()
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis[:seqlen], attention_masks)
        return self.output(self.norm(h))


def build_titan_moe(kind: str, layers: int = 2) -> nn.Module:
    """``titan-moe``: softmax scores applied after the experts, one shared expert, every block MoE.
    ``titan-moe-sig``: sigmoid scores renormalised and scaled by 2, applied to the experts' inputs, no shared
    expert, block 0 dense."""
    if kind == "titan-moe":
        return TitanMoEModel(TitanMoEArgs(n_layers=layers))
    if kind == "titan-moe-sig":
        return TitanMoEModel(TitanMoEArgs(n_layers=layers, score_func="sigmoid", route_norm=True, route_scale=2.0,
                                          num_shared_experts=0, score_before_experts=True, n_dense_layers=1))
    raise ValueError(kind)
