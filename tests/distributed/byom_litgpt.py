"""LitGPT, Lightning's own LLM library, as a user brings it: ``litgpt.GPT(Config.from_name(...))`` inside
:class:`~lightning_4d.models.CausalLM`, no hooks, no wrapper (``GPT.forward(idx)`` maps token ids to logits).

Each family is one of LitGPT's own named configs (:data:`FAMILIES`), shrunk to a tiny size with LitGPT's own
options (:data:`TINY`: layer count, widths, vocabulary, context, experts); nothing is downloaded. What each
exercises:

- ``lit-llama`` (``Llama-3.2-1B``): a fused ``qkv`` split by sizes computed from ``config.n_head`` /
  ``config.n_query_groups`` (grouped queries), SwiGLU ``fc_1 / fc_2 / proj``, Llama 3 rotary scaling.
- ``lit-pythia`` (``pythia-14m``): multi-head attention, partial rotary (a quarter of each head), LayerNorm with
  biases, a parallel residual.
- ``lit-gemma2`` (``Gemma-2-2b``): attention logit soft-capping written by hand (``q @ k.mT``), sandwich norms,
  scaled embeddings, final logit soft-capping, a sliding window on every other layer.
- ``lit-gemma3`` (``Gemma-3-1b-it``): one KV head for four query heads, per-head q/k norms, a local and a global
  rotary table stacked in one buffer and picked per layer (``rope_indices``), a sliding-window mask built by hand.
- ``lit-qwen3`` (``Qwen3-0.6B``): grouped queries with per-head q/k norms.
- ``lit-mixtral`` (``Mixtral-8x7B-v0.1``): ``LLaMAMoE``, a ``gate`` linear and ``experts`` (a list of
  ``LLaMAMLP``), top-k in ``config.n_expert_per_token``, a ``torch.where`` loop over the experts.
- ``lit-qwen3moe`` (``Qwen3-30B-A3B``): the same MoE with its own expert width (``moe_intermediate_size``) and
  per-head q/k norms.

Every model maps token ids ``(B, T)`` to logits ``(B, T, V)`` in fp32; norms and routers are perturbed as a
checkpoint's would be (:func:`tests.distributed.byom_zoo.perturb`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

VOCAB = 64
SEQ = 16
HIDDEN = 32
HEADS = 4
KV_GROUPS = 2
HEAD_SIZE = HIDDEN // HEADS
FFN = 64
MOE_EXPERTS = 4
MOE_FFN = 32
WINDOW = 6  # sliding window (tokens): shorter than SEQ, so it changes the attention

# kind -> LitGPT's own config name
FAMILIES: dict[str, str] = {
    "lit-llama": "Llama-3.2-1B", "lit-pythia": "pythia-14m", "lit-gemma2": "Gemma-2-2b",
    "lit-gemma3": "Gemma-3-1b-it", "lit-qwen3": "Qwen3-0.6B", "lit-mixtral": "Mixtral-8x7B-v0.1",
    "lit-qwen3moe": "Qwen3-30B-A3B",
}
LIT_KINDS = tuple(FAMILIES)
LIT_MOE_KINDS = ("lit-mixtral", "lit-qwen3moe")

# The sizes every family shrinks to (LitGPT's own option names); per family what its full config would not allow.
TINY: dict[str, Any] = dict(block_size=SEQ, n_embd=HIDDEN, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                            n_head=HEADS, head_size=HEAD_SIZE, intermediate_size=FFN)
PER_FAMILY: dict[str, dict[str, Any]] = {
    "lit-llama": dict(n_query_groups=KV_GROUPS),
    "lit-pythia": dict(),
    # attention_scores_scalar: Gemma's query scaling by its head size (256 in the full model)
    "lit-gemma2": dict(n_query_groups=KV_GROUPS, attention_scores_scalar=HEAD_SIZE, sliding_window_size=WINDOW),
    # one KV head (as the 1B model); the first layer local (sliding, local rotary base), the second global
    "lit-gemma3": dict(attention_scores_scalar=HEAD_SIZE, sliding_window_size=WINDOW,
                       sliding_window_indices=[1, 0], rope_indices=[1, 0]),
    "lit-qwen3": dict(n_query_groups=KV_GROUPS),
    "lit-mixtral": dict(n_query_groups=KV_GROUPS, n_expert=MOE_EXPERTS, n_expert_per_token=2,
                        intermediate_size=MOE_FFN),
    "lit-qwen3moe": dict(n_query_groups=KV_GROUPS, n_expert=MOE_EXPERTS, n_expert_per_token=2,
                         moe_intermediate_size=MOE_FFN),
}


def lit_config(kind: str, layers: int = 2) -> Any:
    """The tiny ``litgpt.Config`` of ``kind`` (one of :data:`LIT_KINDS`) with ``layers`` blocks."""
    from litgpt.config import Config

    options = dict(TINY, n_layer=layers, **PER_FAMILY[kind])
    for key in ("sliding_window_indices", "rope_indices"):  # one entry per layer, the pattern repeated
        if key in options:
            options[key] = (options[key] * layers)[:layers]
    return Config.from_name(FAMILIES[kind], **options)


def build_litgpt(kind: str, layers: int = 2) -> nn.Module:
    """``litgpt.GPT`` of ``kind`` with ``layers`` blocks, its weights as ``GPT(config)`` initialises them, then
    perturbed (see the module docstring)."""
    from litgpt.model import GPT

    from tests.distributed.byom_zoo import perturb

    model = GPT(lit_config(kind, layers))
    return perturb(model)
