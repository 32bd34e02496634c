"""More third-party families for "bring your own model": tiny ``transformers`` models built from their config
classes (no downloads) and the real ``torchtitan`` package's models, each written by its own authors.

Every builder returns a plain ``nn.Module`` mapping token ids ``(B, T)`` to logits ``(B, T, V)`` in fp32; the only
user code is :class:`~tests.distributed.byom_models.HFLogits` (``model(input_ids=...).logits``) for transformers
models and :class:`TitanLogits` (``model(tokens)``) for TorchTitan's.

Weights are perturbed away from their initial symmetry, as a loaded checkpoint would be: every norm weight (and
bias), per-head parameter (attention sinks) and MoE router is redrawn, so a rewrite that pairs a head with another
head's norm, or drops a factor that is 1 at initialisation, changes the output at step 0.

Families (``kind``: what it exercises under tensor parallelism):

- ``hf-stablelm``: per-head LayerNorms kept in an ``nn.ModuleList`` and applied with ``zip(norms, heads)``
  (``qk_layernorm``), partial rotary, q/k/v biases.
- ``hf-gemma2`` / ``hf-gemma3``: norms on the attention / MLP *outputs* before the residual add (sandwich norms),
  ``1 + weight`` RMSNorms, a scaled embedding subclass, soft-capping (Gemma 2, eager attention), per-head q/k norms
  and sliding windows (Gemma 3).
- ``hf-phi3``: fused ``qkv_proj`` sliced as ``qkv[..., :n_q]`` with sizes read from ``config``, and a fused
  ``gate_up_proj`` cut with ``chunk(2)``.
- ``hf-olmo2``: q/k RMSNorms over the full projection width (all heads).
- ``hf-olmoe``: OLMo 2's full-width q/k norms in a mixture-of-experts model.
- ``hf-gptoss``: per-head attention sinks (a parameter indexed by head), biased experts, alternating sliding window.
- ``hf-bigcode``: GPT-BigCode multi-query attention: one fused ``c_attn`` ``[q | k | v]`` with one KV head.
- ``hf-falcon``: Falcon's new decoder architecture (interleaved fused ``query_key_value`` by KV group, parallel
  attention and MLP summed in place: ``mlp_output += attention_output``).
- ``hf-falcon-mq``: Falcon multi-query (``num_heads + 2`` heads in one fused projection).
- ``hf-llama4``: Llama 4 text MoE (3-D experts every token visits, a ``Linear`` subclass router, a shared expert).
- ``hf-opt``: OPT (``fc1`` / ``fc2`` held directly by the decoder layer, learned positions with an offset).
- ``hf-mq``: a Llama with a single KV head (multi-query): KV projections replicated over ``tp``.
- ``hf-bloom`` / ``hf-mpt``: ALiBi: per-head biases built outside the blocks from the whole head count and passed
  into the attention (Bloom's ``alibi`` ``(B·H, 1, K)`` into ``baddbmm``, MPT's ``position_bias`` ``(H, 1, K)``).
- ``hf-qwen3next``: Qwen3-Next, linear attention (gated delta net: per-value-head ``dt_bias`` / ``A_log``, a fused
  ``in_proj_qkvz`` viewed per key-head group, a depthwise conv over ``cat(q, k, v)``) alternating with gated full
  attention, MoE with a shared expert; transformers' PyTorch fallbacks of its kernels run on the CPU.
- ``hf-kimilinear``: Kimi-Linear, KDA linear attention (``cat(q_proj(x), k_proj(x), v_proj(x))`` through one depthwise
  conv, a forget gate ``f_b_proj(f_a_proj(x)) + dt_bias`` in a module of its own with a ``(1, 1, H, 1)`` ``A_log``, a
  low-rank output gate and a gated per-head norm) beside multi-head latent attention, a dense MLP then routed experts
  (sigmoid router with a correction bias) with a shared expert.
- ``hf-mamba2`` / ``hf-mamba2grp``: Mamba-2 (pure state-space): a fused ``in_proj`` (``z | x | B | C | dt``) cut by
  the sizes the forward splits it into after a depthwise ``conv1d`` over ``x | B | C``, per-head ``A_log`` /
  ``dt_bias`` / ``D``, a gated RMSNorm over the inner width; one B/C group (every rank computes it; the norm runs
  distributed) or two (sharded with the groups; the norm per group on each rank).
- ``hf-granite4h`` / ``hf-granite4hmoe``: Granite 4.0-H, Mamba-2 and attention layers in one list (blocks of two
  structures), each with an MLP (and routed experts).
- ``hf-falconh1``: Falcon-H1, attention and a Mamba-2 mixer side by side in every layer, the mixer's input scaled by a
  multiplier and its projection by a per-feature buffer (``mup_vector``).
- ``hf-nemotronh``: Nemotron-H, one mixer per layer (Mamba-2, attention or MLP) at the same path, the model's loop
  reading each layer's ``block_type``.
- ``hf-zamba2``: Zamba2, one shared attention + MLP block used by every hybrid layer (its weights tied across the
  layers), each use adding its own low-rank adapter (``up(down(h))``) to ``q_proj`` / ``k_proj`` / ``v_proj`` and
  to the fused ``gate_up_proj``, beside Mamba-2 mixers; the shared block reads the embeddings concatenated to the
  hidden state. Two layers: both hybrid; four: hybrid and Mamba layers alternating (uses at blocks 0 and 2).
  ``hf-zamba2first``: four layers, the two hybrid ones first (every use of the shared block on the first of two
  pipeline stages).
- ``hf-mamba1``: Mamba-1 (``in_proj`` ``x | z``, a depthwise ``conv1d``, ``x_proj`` ``dt | B | C`` reading the
  whole inner width, ``dt_proj``, per-channel ``A_log`` / ``D``).
- ``hf-lfm2``: LFM2, gated short convolutions (``B, C, x = in_proj(h).transpose(-1, -2).chunk(3, dim=-2)``, a
  depthwise ``conv``) beside attention layers.
- ``hf-jetmoe``: JetMoE, a mixture of attention heads and of MLP experts whose forward splits tokens with a tensor
  of sizes (expert parallelism cannot replay it: refused under ep, run as written at ep=1, e.g. under pp).
- ``hf-longcat``: LongCat-Flash, a router over ``E`` experts and ``Z`` zero (identity) experts, the identities
  computed by the layer itself (the experts module sees weight-0 ids in ``[0, E)`` for them); MLA attention (q/kv
  LoRA with norms), two attention and MLP sublayers per layer and a shortcut MoE.
- ``hf-gemma4`` / ``hf-gemma4ple``: Gemma 4, every layer's type (sliding or global attention), rotary table, mask
  and head width (global layers' heads twice as wide, keys used as values) picked by its index from the config;
  ``hf-gemma4ple`` adds per-layer input embeddings (``embed_tokens_per_layer`` and ``per_layer_model_projection``
  computed before the blocks, a slice fed to each layer and multiplied with its ``per_layer_input_gate`` output).
- ``hf-dsv32``: DeepSeek-V3.2, latent attention with a sparse-attention indexer (its own ``wq_b`` / ``wk`` /
  ``weights_proj`` heads, run without gradients, picking ``index_topk`` keys per query) and DeepSeek's MoE.
- ``tt-llama3`` / ``tt-qwen3moe``: the ``torchtitan`` package's own Llama 3 (fused ``wqkv`` interleaved by KV group)
  and Qwen3 MoE (its ``MoE`` with ``router.gate`` beside ``routed_experts``), with TorchTitan's
  ``ScaledDotProductAttention`` inner attention (its flex attention compiles kernels).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

VOCAB = 64
SEQ = 16
HIDDEN = 32
FFN = 64
HEADS = 4
KV_HEADS = 2
MOE_EXPERTS = 4
MOE_FFN = 32

ZOO_KINDS = ("hf-stablelm", "hf-gemma2", "hf-gemma3", "hf-phi3", "hf-olmo2", "hf-olmoe", "hf-gptoss", "hf-bigcode",
             "hf-falcon-mq", "hf-falcon", "hf-llama4", "hf-opt", "hf-mq", "hf-bloom", "hf-mpt", "hf-qwen3next",
             "hf-xglm", "hf-gptneo", "hf-codegen", "hf-cohere", "hf-apertus", "hf-dbrx", "hf-jetmoe", "hf-mamba2",
             "hf-mamba2grp", "hf-granite4h", "hf-lfm2", "hf-falconh1",
             "hf-nemotronh", "hf-zamba2", "hf-zamba2first", "hf-mamba1", "hf-granite4hmoe", "hf-longcat",
             "hf-kimilinear", "hf-gemma4", "hf-gemma4ple", "hf-gemma4moe", "hf-gemma4kv", "hf-dsv32", "tt-llama3",
             "tt-qwen3moe")
ZOO_MOE_KINDS = ("hf-olmoe", "hf-gptoss", "hf-llama4", "hf-qwen3next", "hf-jetmoe", "hf-granite4hmoe", "hf-longcat",
                 "hf-kimilinear", "hf-gemma4moe", "hf-dsv32", "tt-qwen3moe")
ZERO_EXPERTS = 2  # LongCat-Flash's zero (identity) experts beside its MOE_EXPERTS routed ones


def _common(layers: int) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, max_position_embeddings=SEQ,
                use_cache=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=None)


def _hf(family: str, layers: int) -> nn.Module:
    import transformers as tf

    gqa = dict(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    if family == "stablelm":
        cfg: Any = tf.StableLmConfig(**_common(layers), **gqa, intermediate_size=FFN, qk_layernorm=True,
                                     use_qkv_bias=True)
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**_common(layers), **gqa, head_dim=HIDDEN // HEADS, intermediate_size=FFN,
                              sliding_window=6, query_pre_attn_scalar=HIDDEN // HEADS, attn_logit_softcapping=30.0,
                              final_logit_softcapping=20.0)
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(**_common(layers), **gqa, head_dim=HIDDEN // HEADS, intermediate_size=FFN,
                                  sliding_window=6, query_pre_attn_scalar=HIDDEN // HEADS,
                                  layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                  + ["sliding_attention"] * (layers % 2))
    elif family == "phi3":
        cfg = tf.Phi3Config(**_common(layers), **gqa, intermediate_size=FFN)
    elif family == "olmo2":
        cfg = tf.Olmo2Config(**_common(layers), **gqa, intermediate_size=FFN)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**_common(layers), **gqa, intermediate_size=MOE_FFN, num_experts=MOE_EXPERTS,
                             num_experts_per_tok=2)
    elif family == "gptoss":
        cfg = tf.GptOssConfig(**_common(layers), **gqa, head_dim=HIDDEN // HEADS, intermediate_size=MOE_FFN,
                              num_local_experts=MOE_EXPERTS, num_experts_per_tok=2, sliding_window=6,
                              rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                              layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                              + ["sliding_attention"] * (layers % 2))
    elif family == "bigcode":
        cfg = tf.GPTBigCodeConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
                                  multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                  bos_token_id=0, eos_token_id=1)
    elif family == "falcon":
        cfg = tf.FalconConfig(**_common(layers), num_attention_heads=HEADS, num_kv_heads=KV_HEADS,
                              new_decoder_architecture=True, multi_query=False, parallel_attn=True, bias=False,
                              hidden_dropout=0.0, ffn_hidden_size=FFN)
    elif family == "falcon-mq":
        cfg = tf.FalconConfig(**_common(layers), num_attention_heads=HEADS, new_decoder_architecture=False,
                              multi_query=True, parallel_attn=True, bias=False, hidden_dropout=0.0,
                              ffn_hidden_size=FFN)
    elif family == "llama4":
        cfg = tf.Llama4TextConfig(**_common(layers), **gqa, head_dim=HIDDEN // HEADS, intermediate_size=MOE_FFN,
                                  intermediate_size_mlp=FFN, num_local_experts=MOE_EXPERTS, num_experts_per_tok=1,
                                  interleave_moe_layer_step=1, attention_chunk_size=SEQ,
                                  no_rope_layers=[1] * layers, layer_types=["full_attention"] * layers,
                                  attn_temperature_tuning=False)
    elif family == "opt":
        cfg = tf.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, ffn_dim=FFN,
                           num_attention_heads=HEADS, max_position_embeddings=SEQ, word_embed_proj_dim=HIDDEN,
                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                           use_cache=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    elif family == "bloom":
        cfg = tf.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=layers, n_head=HEADS, use_cache=False,
                             hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=1)
    elif family == "mpt":
        cfg = tf.MptConfig(vocab_size=VOCAB, d_model=HIDDEN, n_layers=layers, n_heads=HEADS, max_seq_len=SEQ,
                           use_cache=False, attn_config=dict(alibi=True, attn_pdrop=0), resid_pdrop=0.0,
                           emb_pdrop=0.0)
    elif family == "qwen3next":
        cfg = tf.Qwen3NextConfig(**_common(layers), **gqa, head_dim=HIDDEN // HEADS, intermediate_size=FFN,
                                 moe_intermediate_size=MOE_FFN, shared_expert_intermediate_size=MOE_FFN,
                                 num_experts=MOE_EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1,
                                 mlp_only_layers=[], linear_num_value_heads=2 * HEADS, linear_num_key_heads=KV_HEADS,
                                 linear_key_head_dim=HIDDEN // HEADS, linear_value_head_dim=HIDDEN // HEADS,
                                 linear_conv_kernel_dim=4,
                                 layer_types=["linear_attention", "full_attention"] * (layers // 2)
                                 + ["linear_attention"] * (layers % 2))
    elif family == "jetmoe":  # mixture of attention heads and of MLP experts; experts split tokens by a tensor
        cfg = tf.JetMoeConfig(**_common(layers), num_key_value_heads=KV_HEADS, kv_channels=HIDDEN // HEADS,
                              intermediate_size=MOE_FFN, num_local_experts=MOE_EXPERTS, num_experts_per_tok=2)
    elif family == "xglm":  # eager attention: bmm(q, k.transpose(1, 2)) hands a transposed gradient to k_proj
        cfg = tf.XGLMConfig(vocab_size=VOCAB, d_model=HIDDEN, ffn_dim=FFN, num_layers=layers, attention_heads=HEADS,
                            max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                            layerdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                            decoder_start_token_id=2)
    elif family == "gptneo":  # the same transposed gradient, local and global attention layers
        cfg = tf.GPTNeoConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=layers, num_heads=HEADS,
                              attention_types=[[["global", "local"], layers // 2]] if layers % 2 == 0
                              else [[["global"], layers]], window_size=6, intermediate_size=FFN,
                              max_position_embeddings=SEQ, resid_dropout=0.0, embed_dropout=0.0,
                              attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=1)
    elif family == "codegen":  # fused qkv_proj as mp_num groups of q | v | k, cut by embed_dim // mp_num
        cfg = tf.CodeGenConfig(vocab_size=VOCAB, n_positions=SEQ, n_ctx=SEQ, n_embd=HIDDEN, n_layer=layers,
                               n_head=HEADS, rotary_dim=4, n_inner=FFN, resid_pdrop=0.0, embd_pdrop=0.0,
                               attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=1)
    elif family == "cohere":  # q_norm / k_norm with a (heads, head_dim) weight; parallel attention + MLP
        cfg = tf.CohereConfig(**_common(layers), **gqa, intermediate_size=FFN, use_qk_norm=True, logit_scale=0.5)
    elif family == "apertus":  # xIELU activation with scalar parameters inside the MLP
        cfg = tf.ApertusConfig(**_common(layers), **gqa, head_dim=HIDDEN // HEADS, intermediate_size=FFN)
    elif family == "dbrx":  # clamp(Wqkv(x)) then split; norms inside a container beside the attention
        cfg = tf.DbrxConfig(vocab_size=VOCAB, d_model=HIDDEN, n_heads=HEADS, n_layers=layers, max_seq_len=SEQ,
                            attn_config=dict(kv_n_heads=KV_HEADS, clip_qkv=8.0, rope_theta=10000.0),
                            ffn_config=dict(ffn_hidden_size=MOE_FFN, moe_num_experts=MOE_EXPERTS, moe_top_k=2),
                            use_cache=False, resid_pdrop=0.0, emb_pdrop=0.0, pad_token_id=None)
    elif family in ("mamba2", "mamba2grp"):  # pure SSM: fused z|x|B|C|dt in_proj, depthwise conv, per-head A_log
        cfg = tf.Mamba2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, expand=2,
                              num_heads=HEADS * 2, head_dim=HIDDEN // HEADS, state_size=12, chunk_size=SEQ // 2,
                              n_groups=1 if family == "mamba2" else 2, conv_kernel=4, use_cache=False,
                              bos_token_id=0, eos_token_id=1, pad_token_id=None)
    elif family == "granite4h":  # Granite 4.0-H: Mamba-2 layers and attention layers in one list, each with an MLP
        cfg = tf.GraniteMoeHybridConfig(**_common(layers), **gqa, intermediate_size=FFN, shared_intermediate_size=FFN,
                                        num_local_experts=0, mamba_n_heads=HEADS * 2, mamba_n_groups=1,
                                        mamba_d_state=12, mamba_d_head=HIDDEN // HEADS, mamba_expand=2,
                                        mamba_chunk_size=SEQ // 2, position_embedding_type="rope",
                                        layer_types=["linear_attention", "attention"] * (layers // 2)
                                        + ["linear_attention"] * (layers % 2))
    elif family == "lfm2":  # LFM2: gated short convolutions (B | C | x in_proj, depthwise conv) beside attention
        cfg = tf.Lfm2Config(**_common(layers), **gqa, intermediate_size=FFN, block_auto_adjust_ff_dim=False,
                            conv_L_cache=3, layer_types=["conv", "full_attention"] * (layers // 2)
                            + ["conv"] * (layers % 2))
    elif family == "falconh1":  # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, then an MLP
        cfg = tf.FalconH1Config(**_common(layers), **gqa, head_dim=HIDDEN // HEADS, intermediate_size=FFN,
                                mamba_d_ssm=2 * HIDDEN, mamba_n_heads=HEADS * 2, mamba_d_head=HIDDEN // HEADS,
                                mamba_n_groups=1, mamba_d_state=12, mamba_d_conv=4, mamba_expand=2,
                                mamba_chunk_size=SEQ // 2, mamba_rms_norm=True)
    elif family == "nemotronh":  # Nemotron-H: one mixer per layer (Mamba-2, attention or MLP) at the same path
        kinds = ["linear_attention", "full_attention", "mlp", "linear_attention"]
        cfg = tf.NemotronHConfig(**_common(layers), **gqa, head_dim=HIDDEN // HEADS, intermediate_size=FFN,
                                 mamba_num_heads=HEADS * 2, mamba_head_dim=HIDDEN // HEADS, ssm_state_size=12,
                                 n_groups=1, expand=2, chunk_size=SEQ // 2, conv_kernel=4, use_mamba_kernels=False,
                                 layers_block_type=(kinds * layers)[:layers])
    elif family == "granite4hmoe":  # Granite 4.0-H with routed experts beside the shared MLP
        cfg = tf.GraniteMoeHybridConfig(**_common(layers), **gqa, intermediate_size=MOE_FFN,
                                        shared_intermediate_size=FFN, num_local_experts=MOE_EXPERTS,
                                        num_experts_per_tok=2, mamba_n_heads=HEADS * 2, mamba_n_groups=1,
                                        mamba_d_state=12, mamba_d_head=HIDDEN // HEADS, mamba_expand=2,
                                        mamba_chunk_size=SEQ // 2, position_embedding_type="rope",
                                        layer_types=["linear_attention", "attention"] * (layers // 2)
                                        + ["linear_attention"] * (layers % 2))
    elif family == "longcat":  # LongCat-Flash: zero (identity) experts in the router, MLA, a shortcut MoE per layer
        common = {k: v for k, v in _common(layers).items() if k != "num_hidden_layers"}
        cfg = tf.LongcatFlashConfig(**common, num_layers=layers, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                                    q_lora_rank=16,
                                    kv_lora_rank=16, qk_nope_head_dim=HIDDEN // HEADS, qk_rope_head_dim=HIDDEN // HEADS,
                                    head_dim=HIDDEN // HEADS, v_head_dim=HIDDEN // HEADS, moe_topk=2,
                                    n_routed_experts=MOE_EXPERTS, zero_expert_num=ZERO_EXPERTS,
                                    expert_ffn_hidden_size=MOE_FFN, routed_scaling_factor=1.5)
    elif family == "kimilinear":  # Kimi-Linear: KDA linear attention beside latent attention, dense then routed MLPs
        cfg = tf.KimiLinearConfig(**_common(layers), num_attention_heads=HEADS, intermediate_size=FFN,
                                  moe_intermediate_size=MOE_FFN,
                                  num_local_experts=MOE_EXPERTS, num_experts_per_tok=2, n_shared_experts=1,
                                  routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=None,
                                  qk_nope_head_dim=HIDDEN // HEADS, qk_rope_head_dim=4, v_head_dim=HIDDEN // HEADS,
                                  linear_num_heads=HEADS, linear_head_dim=HIDDEN // HEADS, linear_conv_kernel_dim=4,
                                  layer_types=["linear_attention", "full_attention"] * (layers // 2)
                                  + ["linear_attention"] * (layers % 2),
                                  mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))
    elif family in ("zamba2", "zamba2first"):  # Zamba2: one shared attention+MLP block reused by every hybrid layer
        cfg = tf.Zamba2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, mamba_d_state=12,
                              mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=HEADS * 2,
                              chunk_size=SEQ // 2, use_mamba_kernels=False, intermediate_size=FFN,
                              num_attention_heads=HEADS, num_key_value_heads=HEADS, attention_dropout=0.0,
                              num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
                              max_position_embeddings=SEQ, use_cache=False, bos_token_id=0, eos_token_id=1,
                              pad_token_id=None,
                              layers_block_type=["hybrid"] * layers if layers < 4 else ["hybrid", "mamba"] * (layers // 2)
                              if family == "zamba2" else ["hybrid"] * (layers // 2) + ["mamba"] * (layers - layers // 2))
    elif family == "mamba1":  # Mamba-1: in_proj (x | z), depthwise conv1d, x_proj (dt | B | C), dt_proj, A_log, D
        cfg = tf.MambaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, state_size=8, expand=2,
                             conv_kernel=4, time_step_rank=4, use_cache=False, use_mambapy=False,
                             bos_token_id=0, eos_token_id=1, pad_token_id=None)
    elif family == "mq":
        cfg = tf.LlamaConfig(**_common(layers), num_attention_heads=HEADS, num_key_value_heads=1,
                             intermediate_size=FFN)
    elif family in ("gemma4", "gemma4ple"):  # Gemma 4: layer types picked by position, wider global heads
        # sliding layers, then a full-attention layer last (as Gemma 4 forces), its heads twice as wide with their own
        # (proportional, partial) rotary table; "gemma4": keys are values in the full layers (attention_k_eq_v);
        # "gemma4ple": per-layer input embeddings computed before the blocks and fed to every layer
        ple = family == "gemma4ple"
        cfg = tf.Gemma4TextConfig(**_common(layers), num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                  head_dim=HIDDEN // HEADS, global_head_dim=2 * HIDDEN // HEADS, intermediate_size=FFN,
                                  sliding_window=6, final_logit_softcapping=30.0,
                                  layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
                                  attention_k_eq_v=not ple, num_global_key_value_heads=None if ple else KV_HEADS,
                                  hidden_size_per_layer_input=8 if ple else 0, vocab_size_per_layer_input=VOCAB)
    elif family in ("gemma4moe", "gemma4kv"):  # Gemma 4 with routed experts / with K and V shared across layers
        # "gemma4moe": an MoE block beside every layer's MLP (26B-A4B); "gemma4kv": the last half of the layers
        # reuse the K and V the last earlier layer of their type stored (num_kv_shared_layers, E2B / E4B; with 2
        # layers both global, the second reusing the first's)
        moe = family == "gemma4moe"
        cfg = tf.Gemma4TextConfig(**_common(layers), num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                  head_dim=HIDDEN // HEADS, global_head_dim=2 * HIDDEN // HEADS, intermediate_size=FFN,
                                  sliding_window=6, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                  if moe or layers > 2 else ["full_attention"] * 2,
                                  hidden_size_per_layer_input=0, enable_moe_block=moe,
                                  num_experts=MOE_EXPERTS if moe else None, top_k_experts=2 if moe else None,
                                  moe_intermediate_size=MOE_FFN if moe else None,
                                  num_kv_shared_layers=0 if moe else layers // 2)
    elif family == "dsv32":  # DeepSeek-V3.2: MLA with a sparse-attention indexer (its own heads, no gradient)
        cfg = tf.DeepseekV32Config(**_common(layers), num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                   intermediate_size=FFN, moe_intermediate_size=MOE_FFN, n_routed_experts=MOE_EXPERTS,
                                   num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                   n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                   kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                   v_head_dim=HIDDEN // HEADS, head_dim=4, index_n_heads=HEADS, index_head_dim=8,
                                   index_topk=SEQ // 4)
    else:
        raise ValueError(f"unknown family {family!r}")
    # Soft-capping (Gemma 2) and attention sinks (GPT-OSS) need transformers' eager attention.
    cfg._attn_implementation = "eager" if family in ("gemma2", "gptoss", "mpt", "bloom", "xglm", "gptneo",
                                                     "codegen", "mamba2", "mamba2grp", "mamba1") else "sdpa"
    from tests.distributed.byom_models import HFLogits

    model = tf.AutoModelForCausalLM.from_config(cfg).float()
    if family == "dsv32":  # a nonzero correction bias changes the winning expert group for some tokens
        with torch.no_grad():
            for mod in model.modules():
                if hasattr(mod, "e_score_correction_bias"):
                    mod.e_score_correction_bias.copy_(torch.randn(MOE_EXPERTS) * 0.1)
    return HFLogits(model)


# ----------------------------------------------------------------------------------------------- TorchTitan
class TitanLogits(nn.Module):
    """The only user code for a ``torchtitan`` model: ``tokens -> logits`` (TorchTitan's decoders take the tokens
    and optional positions / masks; SDPA inner attention is causal without a mask)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def _titan(family: str, layers: int) -> nn.Module:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    head_dim = HIDDEN // HEADS
    init = {"weight": lambda p: nn.init.trunc_normal_(p, std=0.02), "bias": nn.init.zeros_}
    ones = {"weight": nn.init.ones_}
    rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=10000.0)
    norm: Callable[[int], Any] = lambda d: RMSNorm.Config(normalized_shape=d, param_init=ones)  # noqa: E731
    attention = dict(dim=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS, wqkv_param_init=init, wo_param_init=init,
                     inner_attention=ScaledDotProductAttention.Config(), rope=rope, fuse_qkv=True)
    emb = Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN,
                           param_init={"weight": lambda p: nn.init.normal_(p, std=1.0)})
    head = Linear.Config(in_features=HIDDEN, out_features=VOCAB, param_init=init)
    if family == "llama3":
        from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

        blocks = [Llama3TransformerBlock.Config(
            attention_norm=norm(HIDDEN), ffn_norm=norm(HIDDEN), attention=make_gqa_config(**attention),
            feed_forward=make_ffn_config(dim=HIDDEN, hidden_dim=FFN, w1_param_init=init, w2w3_param_init=init))
            for _ in range(layers)]
        cfg: Any = Llama3Model.Config(dim=HIDDEN, vocab_size=VOCAB, tok_embeddings=emb, norm=norm(HIDDEN),
                                      lm_head=head, layers=blocks)
    elif family == "qwen3moe":
        from torchtitan.models.common.config_utils import (
            make_moe_config,
            make_routed_experts_config,
            make_router_config,
        )
        from torchtitan.models.qwen3 import Qwen3Model
        from torchtitan.models.qwen3.model import Qwen3TransformerBlock

        experts_init = {n: (lambda p: nn.init.trunc_normal_(p, std=0.02)) for n in ("w1_EFD", "w2_EDF", "w3_EFD")}
        blocks = [Qwen3TransformerBlock.Config(
            attention_norm=norm(HIDDEN), ffn_norm=norm(HIDDEN),
            attention=make_gqa_config(**attention, head_dim=head_dim, qk_norm=norm(head_dim)),
            moe=make_moe_config(
                num_experts=MOE_EXPERTS, load_balance_coeff=None,
                router=make_router_config(dim=HIDDEN, num_experts=MOE_EXPERTS, gate_param_init=init, top_k=2,
                                          score_func="softmax", route_norm=True),
                routed_experts=make_routed_experts_config(dim=HIDDEN, hidden_dim=MOE_FFN, num_experts=MOE_EXPERTS,
                                                          top_k=2, param_init=experts_init,
                                                          comm_backend="standard")))
            for _ in range(layers)]
        cfg = Qwen3Model.Config(dim=HIDDEN, vocab_size=VOCAB, tok_embeddings=emb, norm=norm(HIDDEN), lm_head=head,
                                layers=blocks)
    else:
        raise ValueError(f"unknown torchtitan family {family!r}")
    model = cfg.build()
    model.init_states()
    return TitanLogits(model)


# ----------------------------------------------------------------------------------------------- perturbation
@torch.no_grad()
def perturb(model: nn.Module, scale: float = 0.2) -> nn.Module:
    """Redraw what initialisation leaves symmetric, as a checkpoint would: norm weights (``w + scale·N(0,1)``, also
    a per-head norm's ``(heads, head_dim)``) and biases, 1-D parameters of attention modules (sinks), router weights
    (std 0.2). Uses the global RNG (seeded by the caller)."""
    from lightning_4d.analysis.layer_kinds import is_norm

    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if (p.dim() == 1 or p.dim() == 2 and is_norm(mod)) and (
                    is_norm(mod) or not isinstance(mod, (nn.Linear, nn.Embedding))):
                p.add_(scale * torch.randn_like(p))
            elif p.dim() == 2 and p.shape[0] in (MOE_EXPERTS, MOE_EXPERTS + ZERO_EXPERTS) and "router" in (
                    f"{name}.{pname}") or (
                    p.dim() == 2 and p.shape[0] == MOE_EXPERTS and name.endswith("gate")):
                nn.init.normal_(p, std=0.2)
    return model


def build_zoo(kind: str, layers: int = 2) -> nn.Module:
    """Build ``kind`` (one of :data:`ZOO_KINDS`) with ``layers`` blocks, perturbed (see :func:`perturb`)."""
    if kind.startswith("hf-"):
        model = _hf(kind[len("hf-"):], layers)
    elif kind.startswith("tt-"):
        model = _titan(kind[len("tt-"):], layers)
    else:
        raise ValueError(f"unknown zoo kind {kind!r}")
    return perturb(model)
