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
KINDS = HF_KINDS + OTHER_KINDS


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
    if base in HF_KINDS:
        return build_hf(base[len("hf-"):], layers)
    if base in ("nanogpt", "nanogpt-literal"):
        return NanoGPT(NanoGPTConfig(n_layer=layers), literal=base == "nanogpt-literal")
    return Titan(TitanArgs(n_layers=layers, fused_qkv=base == "titan"))
