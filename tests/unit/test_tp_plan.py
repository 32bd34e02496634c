"""Pure tests of the automatic tensor-parallel plan: conventions, head attributes and clear errors."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_4d.models import GPT2, GPT2Config, HFStyleConfig, HFStyleLM, Llama, LlamaConfig
from lightning_4d.tensor_parallel import block_plan, model_plan
from lightning_4d.analysis.trace import example_tokens, trace_model


def _model_plan(model: nn.Module, blocks: str, tp: int):
    return model_plan(model, trace_model(model, blocks, example_tokens(model)), tp)


def _llama(**kw: int) -> Llama:
    cfg = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    cfg.update(kw)
    return Llama(LlamaConfig(**cfg))


def test_llama_block_plan() -> None:
    plan = block_plan(_llama().layers[0], "layers.0", tp=2)
    assert plan.linears == {"attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
                            "attention.wo": "rowwise", "feed_forward.w1": "colwise", "feed_forward.w2": "rowwise",
                            "feed_forward.w3": "colwise"}
    assert plan.regions == ["attention", "feed_forward"]
    assert plan.norms == ["attention_norm", "ffn_norm"]
    assert plan.head_attrs == {"attention": {"n_heads": 4, "n_kv_heads": 2}}


def test_gpt2_and_hf_conventions() -> None:
    gpt = GPT2(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, block_size=8))
    plan = block_plan(gpt.h[0], "h.0", tp=2)
    assert plan.linears == {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                            "mlp.c_proj": "rowwise"}
    mp = _model_plan(gpt, "h", tp=2)
    assert (mp.embedding, mp.head) == ("embeddings.wte", "lm_head")
    hf = HFStyleLM(HFStyleConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8))
    hp = block_plan(hf.layers[0], "layers.0", tp=2)
    assert hp.regions == ["mlp", "self_attn"]
    assert hp.head_attrs["self_attn"] == {"num_heads": 4, "num_key_value_heads": 2}


def test_indivisible_heads_name_the_module() -> None:
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.n_kv_heads=2 is not divisible by tp=4"):
        block_plan(_llama().layers[0], "layers.0", tp=4)


def test_indivisible_vocab_names_the_head() -> None:
    with pytest.raises(ValueError, match=r"output\.out_features=66 is not divisible by tp=4"):
        _model_plan(_llama(vocab_size=66, n_kv_heads=4), "layers", tp=4)


def test_unknown_linear_names_module_and_hook() -> None:
    block = nn.Module()
    block.mixer = nn.Module()
    block.mixer.in_proj = nn.Linear(4, 8)
    with pytest.raises(ValueError, match=r"blocks\.0\.mixer\.in_proj .*fourd_tp_plan"):
        block_plan(block, "blocks.0", tp=2)


def test_expert_weights_are_not_dense_layers() -> None:
    class MixtralBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 4, bias=False)
            self.experts = nn.ModuleList(nn.ModuleDict({"w1": nn.Linear(8, 16)}) for _ in range(4))

    block = nn.Module()
    block.attention_norm = nn.RMSNorm(8)
    block.feed_forward = MixtralBlock()
    plan = block_plan(block, "layers.0", tp=2)
    assert plan.moe == ["feed_forward"] and plan.linears == {}
