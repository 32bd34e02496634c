"""The generic rules LitGPT needs, pure (no process group): head counts found by value, expert lists recognised
whatever their linears are called, and the context-parallel set-up check on rotary tables sliced to the input
length and on experts fed a subset of the tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.analysis.trace import trace_model
from lightning_4d.context_parallel.alignment import TokenSubsets
from lightning_4d.context_parallel.check import check_context_parallel
from lightning_4d.core.verify import REWRITES_ATTR, tensor_parallel_failure
from lightning_4d.expert_parallel.expert_lists import layer_top_k, swiglu_roles
from lightning_4d.expert_parallel.rewrite import moe_from_mixtral
from lightning_4d.tensor_parallel.plan import block_plan

litgpt = pytest.importorskip("litgpt.model")


def _gpt(kind: str, layers: int = 2) -> nn.Module:
    from tests.distributed.byom_litgpt import build_litgpt

    torch.manual_seed(0)
    return build_litgpt(kind, layers)


# ----------------------------------------------------------------------------------------------- head counts
@pytest.mark.parametrize("kind, rewritten", [
    ("lit-llama", {"n_head": 2, "n_query_groups": 1}),  # 4 query heads, 2 KV groups: both split
    ("lit-pythia", {"n_head": 2, "n_query_groups": 2}),  # multi-head: n_query_groups equals n_head, split alike
    ("lit-gemma3", {"n_head": 2}),  # one KV head: each rank computes it, n_query_groups stays 1
])
def test_litgpt_head_counts_are_found_by_value(kind: str, rewritten: dict[str, int]) -> None:
    # LitGPT's attention splits its fused qkv by n_head * head_size and n_query_groups * head_size, both read from
    # its config; the name lists knew n_head only, so tp gave a q | k | v split that no longer matched.
    model = _gpt(kind)
    attn_cls, config_cls = type(model.transformer.h[0].attn), type(model.config)
    trace = trace_model(model, "transformer.h", torch.randint(0, 64, (2, 8)))
    counts = trace.int_reads["attn"]  # the ints its forward read and viewed its projections in as groups
    assert counts == {"config.n_head": 4, "config.n_query_groups": model.config.n_query_groups}
    assert type(model.transformer.h[0].attn) is attn_cls and type(model.config) is config_cls  # classes restored
    plan = block_plan(model.transformer.h[0], "transformer.h.0", tp=2, trace=trace)
    config = plan.config_attrs["attn"]
    assert {k: config.get(k) for k in ("n_head", "n_query_groups") if k in config} == rewritten
    assert "head_size" not in config and "rope_n_elem" not in config  # a head's width is the same on every rank


class _Oddly(nn.Module):
    """Attention whose head counts have names no list holds."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(16, 64, bias=False)  # q | k | v: 4 query heads and 2 KV heads of 8
        self.out = nn.Linear(32, 16, bias=False)
        self.zz_many, self.zz_few, self.zz_width = 4, 2, 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.mix(x).split((self.zz_many * self.zz_width, self.zz_few * self.zz_width,
                                     self.zz_few * self.zz_width), dim=-1)
        q = q.view(b, t, self.zz_many, self.zz_width).transpose(1, 2)  # (B, 4, T, 8)
        k = k.view(b, t, self.zz_few, self.zz_width).transpose(1, 2)  # (B, 2, T, 8)
        v = v.view(b, t, self.zz_few, self.zz_width).transpose(1, 2)
        rep = self.zz_many // self.zz_few
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Oddly()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.attn(h)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return h


def test_module_head_counts_of_any_name_are_rewritten() -> None:
    net = _Net()
    trace = trace_model(net, "layers", torch.randint(0, 32, (2, 8)))
    assert trace.int_reads["attn"] == {"zz_many": 4, "zz_few": 2}  # the width is the views' last dimension
    plan = block_plan(net.layers[0], "layers.0", tp=2, trace=trace)
    assert plan.local_attrs["attn"] == {"zz_many": 2, "zz_few": 1}  # the width stays


def test_tensor_parallel_failure_names_the_rewrite_not_a_guess() -> None:
    net = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    net[0].__dict__[REWRITES_ATTR] = {"config.n_head": (4, 2)}
    message = str(tensor_parallel_failure(net, "0.0", RuntimeError("split_with_sizes expects ...")))
    assert "the forward of 0.0 fails" in message and "config.n_head 4 -> 2" in message, message
    assert "C // self.n_head" not in message and "fourd_tp_plan" in message
    bare = str(tensor_parallel_failure(net[0][0], "", RuntimeError("boom")))
    assert "No integer it was traced reading" in bare, bare


# ----------------------------------------------------------------------------------------------- expert lists
def test_litgpt_moe_is_recognised_and_rewritten_exactly() -> None:
    model = _gpt("lit-mixtral")
    moe = model.transformer.h[0].mlp
    # H = F = 32: the roles come from the dataflow, not the shapes; top-k from the layer's own torch.topk
    assert swiglu_roles(moe.experts[0]) == ("fc_1", "proj", "fc_2")
    assert layer_top_k(moe, 4, 32) == 2
    with torch.device("meta"):
        meta = _gpt("lit-qwen3moe").transformer.h[0].mlp
    assert layer_top_k(meta, 4, 32) == 2 and swiglu_roles(meta.experts[0]) == ("fc_1", "proj", "fc_2")
    new = moe_from_mixtral(moe, "h.0.mlp")  # verify=True: both forwards on random tokens must agree
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(new(x), moe(x), rtol=1e-5, atol=1e-6)
    assert new.source_key_map["experts.3.fc_2.weight"] == ("experts.w3", 3)


def test_moe_that_cannot_be_rewritten_says_what_is_missing() -> None:
    model = _gpt("lit-mixtral")
    moe = model.transformer.h[0].mlp
    for expert in moe.experts:  # GELU experts (LitGPT's GemmaMLP): not SwiGLU
        expert.__class__ = litgpt.GemmaMLP
    with pytest.raises(ValueError, match=r"its activation is gelu on fc_1's output, not SiLU.*ep=1") as err:
        moe_from_mixtral(moe, "h.0.mlp")
    assert "explicit expert plan" not in str(err.value)

    class NoTopK(nn.Module):  # routes with argsort, names its k nowhere
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(32, 4, bias=False)
            self.experts = nn.ModuleList(_gpt_mlp() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match=r"its top-k is unknown.*set `mlp.top_k = k`"):
        moe_from_mixtral(NoTopK(), "h.0.mlp")


def _gpt_mlp() -> nn.Module:
    from tests.distributed.byom_litgpt import lit_config

    return litgpt.LLaMAMLP(lit_config("lit-llama"), intermediate_size=16)


def test_expert_lists_are_rewritten_only_under_ep() -> None:
    from lightning_4d.layout.derive_plan import plan_layout
    from lightning_4d.mesh import ParallelDims

    with torch.device("meta"):
        model = _gpt("lit-mixtral")
    assert plan_layout(model, ParallelDims(world_size=2, tp=2)).experts == ()  # run as written
    experts = plan_layout(model, ParallelDims.from_world(2, ep=2)).experts
    assert [e.kind for e in experts] == ["mixtral", "mixtral"]
    assert ("transformer.h.0.mlp.experts.1.fc_1.weight", "transformer.h.0.mlp.experts.w1", 1) in experts[0].renames


# ----------------------------------------------------------------------------------------------- cp set-up check
class _Rotary(nn.Module):
    """LitGPT's pattern: a position table sliced to the input length, no positions argument."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 4)
        self.register_buffer("cos", torch.linspace(-1, 1, 40 * 4).view(40, 4), persistent=False)
        self.head = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens) * self.cos[: tokens.shape[1]])


@pytest.mark.parametrize("rank", [0, 1])
def test_cp_check_hands_a_sliced_table_its_global_rows(rank: int) -> None:
    model = _Rotary()
    tokens = torch.randint(0, 32, (2, 16))
    check_context_parallel(model, tokens, None, cp=2, rank=rank)  # refused before: the rows of cos[:8] differ
    from lightning_4d.context_parallel import ContextParallelAttention, SequenceShard, zigzag_split

    with torch.no_grad(), ContextParallelAttention(SequenceShard(None, cp=2, rank=rank, seq_len=16)):
        local = model(zigzag_split(tokens, 2, rank, dim=1))
    torch.testing.assert_close(local, zigzag_split(model(tokens), 2, rank, dim=1).detach())
    assert model.cos.shape == (40, 4)  # put back after the forward


class _LoopMoE(nn.Module):
    """Two experts in a list, one per token by the sign of its first feature, written with torch.where."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 4)
        with torch.no_grad():  # even token ids -> expert 0, odd ones -> expert 1
            self.emb.weight[:, 0] = torch.tensor([1.0, -1.0]).repeat(16)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.rows: list[int] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        flat = h.reshape(-1, 4)  # (B·T, H)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, = torch.where((flat[:, 0] > 0) == (e == 0))
            self.rows.append(rows.numel())
            out.index_add_(0, rows, expert(flat[rows]))
        return out.view_as(h)


def test_cp_check_does_not_compare_an_experts_tokens_as_a_sequence() -> None:
    # Expert 0 gets the even tokens: T of the B·T in the whole run and T/cp on each rank, so its output looks like a
    # sequence by its shape (what the check compared, refusing the layer); the layer's output is compared.
    model = _LoopMoE()
    tokens = torch.arange(32).view(2, 16)  # even at even positions: each zigzag chunk holds half of them
    check_context_parallel(model, tokens, None, cp=2, rank=0)
    assert model.rows[:2] == [16, 16] and model.rows[2:4] == [8, 8]
    with TokenSubsets() as subsets:
        rows, = torch.where(tokens[0] > 3)
        picked = tokens[0][rows].float()
    assert subsets.touches((picked,), None) and not subsets.touches((tokens.float(),), tokens.float())


def test_tensor_parallel_failure_under_pipeline_names_the_module() -> None:
    # tp × pp: the stage-by-stage check after the rewrite reported a failing forward as the pipeline's ("Pipeline
    # stages run ...; otherwise implement configure_pipeline_split"), naming no module, though pp alone held.
    from lightning_4d.layout.pipeline_glue import check_after_tensor_parallel
    from lightning_4d.models import Llama, LlamaConfig
    from lightning_4d.pipeline.staged import prepare_staged

    lm = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=8))
    tokens = torch.randint(0, 32, (2, 8))
    trace = trace_model(lm, "layers", tokens)
    attention = lm.layers[1].attention
    stages = prepare_staged(lm, trace, num_stages=2)
    attention.__dict__[REWRITES_ATTR] = {"n_heads": (2, 1)}

    def broken(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise RuntimeError("shape '[2, 8, 1, 8]' is invalid for input of size 256")

    attention.forward = broken
    with pytest.raises(ValueError) as err:
        check_after_tensor_parallel(lm, stages, tokens, trace.output)
    message = str(err.value)
    assert "the forward of layers.1.attention fails after the tensor-parallel rewrite" in message, message
    assert "n_heads 2 -> 1" in message and "Pipeline stages run" not in message, message
