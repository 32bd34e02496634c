"""Pure tests of what the set-up trace finds in third-party models and the TP plan derived from it
(no process group): Hugging Face Llama / Qwen3 / GPT-2 (transformers, built from configs), the row
permutation of concatenated fused projections, and the clear errors for what cannot be sharded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_4d.analysis.discovery import find_blocks
from lightning_4d.tensor_parallel import block_plan, model_plan
from lightning_4d.tensor_parallel.layouts import (
    canonical_state,
    concat_permutation,
    inverse_permutation,
    sharded_state,
)
from lightning_4d.analysis.trace import example_tokens, trace_model
from tests.distributed.byom_models import build_hf


def _llama() -> nn.Module:
    return build_hf("llama")


def _qwen3() -> nn.Module:
    return build_hf("qwen3")


def _gpt2() -> nn.Module:
    return build_hf("gpt2")


def _trace(model: nn.Module):
    path, _ = find_blocks(model)
    return path, trace_model(model, path, example_tokens(model))


def test_hf_llama_head_embedding_and_block_calls_from_execution_order() -> None:
    model = _llama()
    path, trace = _trace(model)
    assert path == "model.model.layers" and trace.block_order == ("0", "1")
    # lm_head sits beside `model`, not after `model.layers`: found by when it runs.
    assert trace.pre == ("model.model.embed_tokens", "model.model.rotary_emb")
    assert trace.post == ("model.model.norm", "model.lm_head")
    assert trace.hidden.position == 0 and trace.hidden.tuple_out is None
    plan = model_plan(model, trace, tp=2)
    assert (plan.embedding, plan.head) == ("model.model.embed_tokens", "model.lm_head")
    block = block_plan(model.model.model.layers[0], "layers.0", 2, trace, sequence_parallel=True)
    assert block.regions == ["mlp", "self_attn"] and block.norms == ["input_layernorm", "post_attention_layernorm"]
    assert not block.permutations and not block.partial_params


def test_qwen3_per_head_norms_get_their_gradients_summed() -> None:
    model = _qwen3()
    _, trace = _trace(model)
    block = block_plan(model.model.model.layers[0], "layers.0", 2, trace)
    assert block.partial_params == ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]


def test_deepseek_latent_attention_keeps_down_projections_whole_and_shards_up_projections() -> None:
    # MLA: q_a_proj -> q_a_layernorm -> q_b_proj and kv_a_proj_with_mqa -> split -> kv_a_layernorm -> kv_b_proj, the
    # rotary key k_rot (from kv_a_proj_with_mqa) shared by every head. Found from the traced dataflow, not names.
    from tests.distributed.byom_models import build_hf_moe

    torch.manual_seed(0)
    model = build_hf_moe("dsv3")
    _, trace = _trace(model)
    assert trace.sources["self_attn.kv_b_proj"] == {"self_attn.kv_a_proj_with_mqa"}
    assert trace.sources["self_attn.q_b_proj"] == {"self_attn.q_a_proj"}
    block = block_plan(model.model.model.layers[0], "layers.0", 2, trace, sequence_parallel=True)
    assert block.low_rank == {"self_attn.q_b_proj": "self_attn.q_a_proj",
                              "self_attn.kv_b_proj": "self_attn.kv_a_proj_with_mqa"}
    roles = {n: block.linears[f"self_attn.{n}"] for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                         "o_proj")}
    assert roles == {"q_a_proj": "replicate", "q_b_proj": "colwise", "kv_a_proj_with_mqa": "replicate",
                     "kv_b_proj": "colwise", "o_proj": "rowwise"}
    # The replicated chain receives only this rank's heads' share of the gradient: summed over tp.
    assert sorted(block.partial_params) == ["self_attn.kv_a_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight",
                                            "self_attn.q_a_layernorm.weight", "self_attn.q_a_proj.weight"]
    # A plain Llama has no such pair (o_proj reads q, k and v; down_proj reads gate and up).
    _, llama_trace = _trace(_llama())
    assert block_plan(_llama().model.model.layers[0], "layers.0", 2, llama_trace).low_rank == {}


def test_gpt2_conv1d_concatenated_qkv_is_permuted_and_its_split_size_divided() -> None:
    model = _gpt2()
    path, trace = _trace(model)
    assert path == "model.transformer.h"
    assert trace.consumers["attn.c_attn"].pieces(96) == [32, 32, 32]
    block = block_plan(model.model.transformer.h[0], "h.0", 2, trace)
    assert block.linears == {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                             "mlp.c_proj": "rowwise"}
    assert block.permutations["attn.c_attn"] == concat_permutation([32, 32, 32], 2)
    assert block.head_attrs["attn"]["split_size"] == 32 and block.head_attrs["attn"]["num_heads"] == 4
    plan = model_plan(model, trace, tp=2)
    assert (plan.embedding, plan.head) == ("model.transformer.wte", "model.lm_head")


def test_concat_permutation_gives_each_rank_its_piece_of_every_part() -> None:
    perm = concat_permutation([4, 2, 2], tp=2)  # q (4 rows) | k (2) | v (2)
    rows = torch.arange(8)[perm]
    assert rows[:4].tolist() == [0, 1, 4, 6] and rows[4:].tolist() == [2, 3, 5, 7]  # rank 0 | rank 1
    assert torch.equal(rows[inverse_permutation(perm)], torch.arange(8))
    state = {"attn.w": torch.randn(8, 3), "state.attn.w.exp_avg": torch.randn(8, 3), "other": torch.randn(8)}
    perms = {"attn.w": (perm, 0)}
    back = canonical_state(sharded_state(state, perms), perms)
    assert all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="do not all divide by tp=4"):
        concat_permutation([4, 2, 2], tp=4)


def test_full_width_norm_inside_a_region_is_refused_naming_it() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)
            self.q_norm = nn.RMSNorm(8)  # over all heads (OLMo2 style): would need a cross-rank variance

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o_proj(self.q_norm(self.q_proj(x)))

    block = nn.Module()
    block.attn = Attention()
    # Without a trace nothing says which projection it normalises: refused, naming it.
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q_norm normalises over 8 features.*distributed norm"):
        block_plan(block, "blocks.0", tp=2)
    # With one, it normalises q_proj's whole output: a distributed norm (statistics all-reduced over tp).

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.attn(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.blocks = nn.Embedding(16, 8), nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for b in self.blocks:
                h = b(h)
            return h

    net = Net()
    trace = trace_model(net, "blocks", torch.zeros(1, 4, dtype=torch.long))
    assert block_plan(net.blocks[0], "blocks.0", 2, trace).dist_norms == {"attn.q_norm": "attn.q_proj"}


def test_unknown_parameter_inside_a_region_is_refused() -> None:
    block = nn.Module()
    block.attn = nn.Module()
    block.attn.q_proj, block.attn.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)
    block.attn.sinks = nn.Parameter(torch.zeros(4))  # per-head values: sharded or summed? unknown
    with pytest.raises(ValueError, match=r"blocks\.0\.attn holds parameters \(sinks\).*fourd_tp_plan\(self, tp_mesh"):
        block_plan(block, "blocks.0", tp=2)


def test_roles_by_dataflow_when_names_are_unknown() -> None:
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.expand, self.contract = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.contract(torch.relu(self.expand(x)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for b in self.blocks:
                h = b(h)
            return h

    net = Net()
    trace = trace_model(net, "blocks", example_tokens(net))
    assert block_plan(net.blocks[0], "blocks.0", 2, trace).linears == {"mlp.expand": "colwise",
                                                                       "mlp.contract": "rowwise"}


class _Scaled(nn.Embedding):
    """An embedding subclass with its own forward (Gemma-style scaling by a buffer)."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__(n, d)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale.to(self.weight.dtype)


def _net(embedding: nn.Module, tied: bool) -> nn.Module:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Module()
            self.mlp.up_proj, self.mlp.down_proj = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp.down_proj(torch.relu(self.mlp.up_proj(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = embedding
            self.layers = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(8, 16, bias=False)
            if tied:
                self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    return Net()


def test_embedding_subclass_with_its_own_forward_stays_replicated() -> None:
    # Sharding its weight would feed a DTensor into the subclass's own math; replicated it is exact.
    net = _net(_Scaled(16, 8), tied=False)
    plan = model_plan(net, trace_model(net, "layers", example_tokens(net)), tp=2)
    assert plan.embedding is None and plan.head == "head"
    tied = _net(_Scaled(16, 8), tied=True)  # a head tied to it stays whole too
    plan = model_plan(tied, trace_model(tied, "layers", example_tokens(tied)), tp=2)
    assert plan.embedding is None and plan.head is None
    plain = _net(nn.Embedding(16, 8), tied=True)
    plan = model_plan(plain, trace_model(plain, "layers", example_tokens(plain)), tp=2)
    assert (plan.embedding, plan.head) == ("emb", "head")


def test_blocks_without_linears_are_refused_under_tp() -> None:
    from lightning_4d.tensor_parallel import tp_styles

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.layers = nn.ModuleList(nn.LayerNorm(8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for layer in self.layers:
                h = layer(h)
            return h

    net = Net()
    with pytest.raises(ValueError, match="no block of layers has a linear layer to shard"):
        tp_styles(net, trace_model(net, "layers", example_tokens(net)), tp=2, sp=False)


def test_a_head_that_is_not_over_the_vocabulary_stays_whole() -> None:
    # A regression head (mse_loss on one output) is not vocabulary logits: no parallel cross-entropy.
    net = _net(nn.Embedding(16, 8), tied=False)
    net.head = nn.Linear(8, 1)
    plan = model_plan(net, trace_model(net, "layers", example_tokens(net)), tp=2)
    assert (plan.embedding, plan.head) == ("emb", None)
