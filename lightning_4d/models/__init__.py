"""Reference plain-torch transformers that lightning_4d parallelises by naming convention.

- :class:`Llama` — TorchTitan names (``tok_embeddings``, ``layers[i].attention.wq/wk/wv/wo``,
  ``feed_forward.w1/w2/w3``, ``norm``, ``output``).
- :class:`GPT2` — nanoGPT names (``embeddings.wte/wpe``, ``h[i].attn.c_attn/c_proj``,
  ``mlp.c_fc/c_proj``, ``ln_f``, ``lm_head``) with a per-head-interleaved fused QKV.
- :class:`HFStyleLM` — Hugging Face names (``embed_tokens``, ``self_attn.q_proj`` ..., ``mlp.gate_proj``
  ..., ``norm``, ``lm_head``).
- :class:`HFLogits` — a real ``transformers`` causal LM (``from_pretrained`` of a local directory, or a
  config) as ``tokens -> logits`` (:mod:`lightning_4d.models.hf`).

All contain no distributed code, read head counts from instance attributes at forward time, and can
be built on the meta device then materialised with ``model.to_empty(device=...)`` and
``model.init_weights(seed)``.

>>> from lightning_4d.models import Llama, LlamaConfig
>>> model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64))
>>> model(torch.randint(0, 64, (1, 4))).shape
torch.Size([1, 4, 64])
"""

import torch  # noqa: F401  (used by the docstring example)

from lightning_4d.models.gpt2 import (
    GPT2,
    MLP,
    Block,
    CausalSelfAttention,
    GPT2Config,
    GPT2Embeddings,
    interleave_qkv,
)
from lightning_4d.models.hf import HFLogits
from lightning_4d.models.hf_style import (
    HFStyleAttention,
    HFStyleConfig,
    HFStyleDecoderLayer,
    HFStyleLM,
    HFStyleMLP,
)
from lightning_4d.models.lm import CausalLM
from lightning_4d.models.llama import (
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    TransformerBlock,
    apply_rope,
    rope_cos_sin,
)

__all__ = [
    "CausalLM",
    "GPT2",
    "MLP",
    "Attention",
    "Block",
    "CausalSelfAttention",
    "FeedForward",
    "GPT2Config",
    "GPT2Embeddings",
    "HFLogits",
    "HFStyleAttention",
    "HFStyleConfig",
    "HFStyleDecoderLayer",
    "HFStyleLM",
    "HFStyleMLP",
    "Llama",
    "LlamaConfig",
    "TransformerBlock",
    "apply_rope",
    "interleave_qkv",
    "rope_cos_sin",
]
