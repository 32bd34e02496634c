"""Pure tests of the tensor-parallel plan for what follows the heads (no process group): how the trace sees a
projection's output features cut and viewed per head, and the plan derived from it — per-head module lists and
parameters, norms over a sharded width, replicated KV heads, sizes read from ``config``, linears held by the
block, regions that span modules — and the refusals that name the module, the cause and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_4d.analysis.discovery import find_blocks
from lightning_4d.tensor_parallel import block_plan
from lightning_4d.tensor_parallel.layouts import concat_permutation
from lightning_4d.analysis.trace import ColumnLayout, trace_model

pytest.importorskip("transformers")

from tests.distributed.byom_zoo import build_zoo  # noqa: E402


def _traced(kind: str, tp: int = 2, sp: bool = True):
    torch.manual_seed(0)
    model = build_zoo(kind)
    path, container = find_blocks(model)
    trace = trace_model(model, path, torch.randint(0, 64, (2, 8)))
    block = next(iter(container.children()))
    return model, trace, block


def _plan(kind: str, tp: int = 2, sp: bool = True):
    _, trace, block = _traced(kind)
    return block_plan(block, "layers.0", tp, trace, sequence_parallel=sp), trace


def test_column_layout_pieces_between_cut_points() -> None:
    layout = ColumnLayout(12, cuts={(0, 8), (8, 12)}, units={(0, 12): 4})
    assert layout.pieces() == [(0, 8, 4), (8, 12, 4)]
    assert ColumnLayout(6).pieces() == [(0, 6, None)]


def test_trace_follows_slices_views_and_chunks() -> None:
    # Phi-3: qkv[..., :n_q] (sizes from config), then .view(..., -1, head_dim); gate_up.chunk(2)
    _, trace, _ = _traced("hf-phi3")
    assert trace.columns["self_attn.qkv_proj"].pieces() == [(0, 32, 8), (32, 48, 8), (48, 64, 8)]
    assert trace.columns["mlp.gate_up_proj"].pieces() == [(0, 64, None), (64, 128, None)]
    # Falcon multi-query: view(B, T, heads + 2, head_dim), then [..., :-2, :], [..., [-2], :], [..., [-1], :]
    _, trace, _ = _traced("hf-falcon-mq")
    assert trace.columns["self_attention.query_key_value"].pieces() == [(0, 32, 8), (32, 40, 8), (40, 48, 8)]
    # Falcon's new decoder: view(B, T, n_kv, q_per_kv + 2, head_dim): interleaved groups of 32
    _, trace, _ = _traced("hf-falcon")
    layout = trace.columns["self_attention.query_key_value"]
    assert layout.pieces() == [(0, 64, 32)] and layout.groups[(0, 64)]
    # One KV head viewed as (B, T, 1, head_dim)
    _, trace, _ = _traced("hf-mq")
    assert trace.columns["self_attn.k_proj"].pieces() == [(0, 8, 8)]


def test_per_head_norm_list_is_sliced_per_rank() -> None:
    plan, _ = _plan("hf-stablelm")
    assert plan.head_lists == {"self_attn.q_layernorm.norms": [(0, 2), (2, 4)],
                               "self_attn.k_layernorm.norms": [(0, 1), (1, 2)]}
    assert "self_attn.q_layernorm.norms.3.weight" in plan.partial_params
    # tp=4: two KV heads, one per pair of ranks
    _, trace, block = _traced("hf-stablelm")
    plan4 = block_plan(block, "layers.0", 4, trace, sequence_parallel=True)
    assert plan4.head_lists["self_attn.k_layernorm.norms"] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert plan4.local_attrs["self_attn"]["num_key_value_heads"] == 1


def test_attention_sinks_are_per_head_parameters() -> None:
    plan, _ = _plan("hf-gptoss")
    assert plan.head_params == {"self_attn.sinks": [(0, 2), (2, 4)]}
    assert "self_attn.sinks" in plan.partial_params


def test_full_width_qk_norms_become_distributed_norms() -> None:
    plan, _ = _plan("hf-olmo2")
    assert plan.dist_norms == {"self_attn.q_norm": "self_attn.q_proj", "self_attn.k_norm": "self_attn.k_proj"}
    # With fewer KV heads than tp no rank holds the full key width: refused, naming the norm, cause and fix.
    _, trace, block = _traced("hf-olmo2")
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_norm normalises over 16 features.*fewer than tp "
                                         r"and replicated.*use a tp that divides.*fourd_tp_plan"):
        block_plan(block, "layers.0", 4, trace, sequence_parallel=True)


def test_one_kv_head_is_replicated_and_its_counts_become_per_rank() -> None:
    plan, _ = _plan("hf-mq")
    assert plan.gathered["self_attn.k_proj"] == [list(range(8)), list(range(8))]
    assert "self_attn.k_proj.weight" in plan.partial_params and "self_attn.q_proj" not in plan.gathered
    assert plan.local_attrs["self_attn"]["num_key_value_groups"] == 2  # 2 local query heads per (1) KV head
    # GPT-BigCode: one fused [q | k | v] with one KV head: each rank computes its query heads, k and v.
    plan, _ = _plan("hf-bigcode")
    rows = plan.gathered["attn.c_attn"]
    assert rows[0] == list(range(16)) + list(range(32, 48)) and rows[1] == list(range(16, 48))
    assert plan.local_attrs["attn"]["embed_dim"] == 16 and plan.local_attrs["attn"]["kv_dim"] == 8


def test_sizes_read_from_config_are_per_rank_in_a_copy() -> None:
    plan, _ = _plan("hf-phi3")
    assert plan.permutations["self_attn.qkv_proj"] == concat_permutation([32, 16, 16], 2)
    assert plan.permutations["mlp.gate_up_proj"] == concat_permutation([64, 64], 2)
    assert plan.config_attrs["self_attn"]["num_attention_heads"] == 2
    assert plan.config_attrs["self_attn"]["num_key_value_heads"] == 1


def test_regions_span_the_projections_that_feed_each_other() -> None:
    pytest.importorskip("torchtitan.models.llama3")
    # TorchTitan keeps wqkv one level below the attention (attention.qkv_linear.wqkv) and wo beside it.
    plan, _ = _plan("tt-llama3")
    assert plan.regions == ["attention", "feed_forward"]
    assert plan.linears["attention.qkv_linear.wqkv"] == "colwise" and plan.linears["attention.wo"] == "rowwise"


def test_linears_held_by_the_block_and_norms_on_flattened_tokens() -> None:
    # OPT: fc1 / fc2 are attributes of the decoder layer, which flattens (B, T, H) to (B·T, H) before them.
    plan, _ = _plan("hf-opt")
    assert plan.direct == ["fc1", "fc2"] and plan.regions == ["self_attn"]
    assert plan.local_norms == ["final_layer_norm"]  # its input is (B·T, H): it runs on local tokens


def test_interleaved_groups_fewer_than_tp_are_refused() -> None:
    _, trace, block = _traced("hf-falcon")
    with pytest.raises(ValueError, match=r"query_key_value: its features 0:64 form 2 interleaved groups of 32.*"
                                         r"tp=4.*use a tp that divides 2"):
        block_plan(block, "layers.0", 4, trace, sequence_parallel=True)


def test_a_module_list_that_is_not_per_head_is_refused() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 4
            self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)
            self.scales = nn.ModuleList(nn.LayerNorm(2) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o_proj(self.q_proj(x))

    block = nn.Module()
    block.attn = Attention()
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.scales is a list of 3 modules.*one module per head.*"
                                         r"fourd_tp_plan"):
        block_plan(block, "blocks.0", 2)


def test_llama4_every_token_experts_are_recognised() -> None:
    # Llama 4's experts take (E·N, H): every expert on every token, scores applied by the layer before them.
    from lightning_4d.expert_parallel.inplace import find_expert_modules, verify_experts

    torch.manual_seed(0)
    model = build_zoo("hf-llama4")
    specs, rejected = find_expert_modules(model)
    assert not rejected and [s.contract for s in specs] == ["dense", "dense"] and specs[0].router == "router"
    verify_experts(model.get_submodule(specs[0].name), specs[0], parts=2)  # the grouped replay reproduces it


def test_a_one_input_forward_is_not_taken_for_experts_unless_named_so() -> None:
    from lightning_4d.expert_parallel.inplace import inspect_experts

    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    layer = nn.Module()
    layer.gate, layer.mixer = nn.Linear(8, 4), Mixer()
    assert "forward takes neither" in inspect_experts(layer.mixer, "mixer", layer)


def test_torchtitan_router_is_found_around_its_experts() -> None:
    pytest.importorskip("torchtitan.models.qwen3")
    from lightning_4d.expert_parallel.inplace import find_expert_modules

    torch.manual_seed(0)
    specs, rejected = find_expert_modules(build_zoo("tt-qwen3moe"))
    assert not rejected and [s.name for s in specs] == [f"model.layers.{i}.moe.routed_experts.inner_experts"
                                                        for i in range(2)]
    assert specs[0].contract == "grouped" and specs[0].router == "../router.gate"


def test_a_linear_subclass_that_computes_something_else_is_refused() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    class Same(nn.Linear):  # its own forward, the same math: sharded like a linear
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.weight, self.bias)

    block = nn.Module()
    block.mlp = nn.Module()
    block.mlp.up_proj, block.mlp.down_proj = Same(8, 16), Same(16, 8)
    assert block_plan(block, "blocks.0", 2).linears == {"mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    block.mlp.up_proj = Scaled(8, 16)
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.up_proj \(Scaled\) subclasses nn\.Linear with its own "
                                         r"forward.*fourd_tp_plan"):
        block_plan(block, "blocks.0", 2)


def test_alibi_biases_are_found_from_the_dataflow_and_cut_with_the_heads() -> None:
    # Bloom passes its attention alibi (B·H, 1, K) into alibi.baddbmm(q, k); MPT adds position_bias (H, 1, K) to
    # the scores. Both are built outside the blocks from the whole head count: each rank takes its heads' rows.
    plan, trace = _plan("hf-bloom")
    assert trace.score_biases == {"self_attention": {"alibi": ((8, 1, 8), 2)}}
    assert plan.head_inputs == {"self_attention": {"alibi": (4, [(0, 2), (2, 4)])}}
    plan, trace = _plan("hf-mpt")
    assert trace.score_biases == {"attn": {"position_bias": ((4, 1, 16), 2)}}
    assert plan.head_inputs == {"attn": {"position_bias": (4, [(0, 2), (2, 4)])}}
    # Rotary tables (multiplied), causal masks (broadcast over heads) and residuals are not score biases.
    for kind in ("hf-mq", "hf-gemma2", "hf-stablelm"):
        plan, trace = _plan(kind)
        assert trace.score_biases == {} and plan.head_inputs == {}


def test_slice_heads_takes_a_ranks_heads_directly_or_folded_with_the_batch() -> None:
    from lightning_4d.analysis.head_bias import slice_heads

    direct = torch.arange(4.0).view(4, 1, 1)  # (H, 1, K)
    assert slice_heads(direct, 4, 2, 4).flatten().tolist() == [2.0, 3.0]
    folded = torch.arange(12.0).view(12, 1, 1)  # (B·H, 1, K), B=3 outer
    assert slice_heads(folded, 4, 0, 2).flatten().tolist() == [0.0, 1.0, 4.0, 5.0, 8.0, 9.0]
    with pytest.raises(ValueError, match=r"shape \(6, 1, 1\) does not hold 4 heads"):
        slice_heads(torch.zeros(6, 1, 1), 4, 0, 2)


def test_linear_attention_follows_key_head_groups_through_its_convolution() -> None:
    # Qwen3-Next's gated delta net: a fused in_proj_qkvz viewed per key-head group (2), q | k | v cut inside each
    # group, flattened and concatenated before a depthwise conv; dt_bias / A_log per value head (8). Under tp=2 each
    # rank holds one key-head group: its share of every concatenated piece is a channel range of the conv.
    _, trace, block = _traced("hf-qwen3next")
    assert trace.columns["linear_attn.in_proj_qkvz"].depthwise_parts == {(16, 16, 64)}
    plan = block_plan(block, "layers.0", 2, trace, sequence_parallel=True)
    rows = plan.channel_rows["linear_attn"]["conv1d.weight"]
    assert rows[1] == list(range(8, 16)) + list(range(24, 32)) + list(range(64, 96))
    assert plan.local_attrs["linear_attn"] == {"num_v_heads": 4, "num_k_heads": 1, "key_dim": 8, "value_dim": 32,
                                               "conv_dim": 48}
    assert plan.head_params["linear_attn.dt_bias"] == [(0, 4), (4, 8)]
    # tp=4 would split two key-head groups: refused, naming the projection, the cause and the fix
    with pytest.raises(ValueError, match=r"linear_attn\.in_proj_qkvz: its features 0:160 form 2 head\(s\) of 80, "
                                         r"fewer than tp.*use a tp that divides 2"):
        block_plan(block, "layers.0", 4, trace, sequence_parallel=True)


def test_kimi_delta_attention_follows_its_heads_through_three_projections() -> None:
    # Kimi-Linear's KDA: cat(q_proj(x), k_proj(x), v_proj(x)) (4 heads of 8 each) through one depthwise conv, then
    # split back; the forget gate f_b_proj(f_a_proj(x)) + dt_bias (a module of its own, viewed per head) with a
    # (1, 1, 4, 1) A_log. Under tp=2 each rank's conv channels are its heads' features of every member.
    _, trace, block = _traced("hf-kimilinear")
    members = (("self_attn.q_proj", 0, 32), ("self_attn.k_proj", 0, 32), ("self_attn.v_proj", 0, 32))
    assert trace.columns["self_attn.k_proj"].depthwise_joined == {members}
    assert trace.columns["self_attn.q_proj"].pieces() == [(0, 32, 8)]  # the split after the conv gives q back
    assert trace.columns["self_attn.forget_gate.f_b_proj"].feature_params == {"self_attn.forget_gate.dt_bias": (0, 32)}
    plan = block_plan(block, "layers.0", 2, trace, sequence_parallel=True)
    rows = plan.channel_rows["self_attn"]
    assert rows["conv1d.weight"][1] == list(range(16, 32)) + list(range(48, 64)) + list(range(80, 96))
    assert rows["forget_gate.dt_bias"] == [list(range(0, 16)), list(range(16, 32))]
    assert plan.head_params["self_attn.forget_gate.A_log"] == [(0, 2), (2, 4)]
    # the gate's down-projection stays whole, its up-projection (its module's last linear) follows the heads
    assert plan.linears["self_attn.forget_gate.f_a_proj"] == "replicate"
    assert plan.linears["self_attn.forget_gate.f_b_proj"] == "colwise"
    assert plan.local_attrs["self_attn"]["qkv_dim"] == 16
    assert {"self_attn.conv1d.weight", "self_attn.forget_gate.dt_bias",
            "self_attn.forget_gate.A_log"} <= set(plan.partial_params)


def test_fused_groups_per_head_norm_rows_and_scalars_follow_the_ranks() -> None:
    # CodeGen: qkv_proj is mp_num groups of q | v | k cut by embed_dim // mp_num: mp_num is per rank like a head count
    plan, _ = _plan("hf-codegen")
    assert plan.local_attrs["attn"]["mp_num"] == 4 // 2 and plan.local_attrs["attn"]["embed_dim"] == 32 // 2
    # Cohere: q_norm / k_norm hold a (heads, head_dim) weight: each rank uses its heads' rows
    plan, _ = _plan("hf-cohere")
    assert plan.head_params["self_attn.q_norm.weight"] == [(0, 2), (2, 4)]
    assert plan.head_params["self_attn.k_norm.weight"] == [(0, 1), (1, 2)]
    # Apertus: xIELU's scalars act on this rank's up_proj features: gradients summed over tp
    plan, _ = _plan("hf-apertus")
    assert {"mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n"} <= set(plan.partial_params)
    # DBRX: clamp(Wqkv(x)) then split into q | k | v: the trace follows the clamp, so the rows are regrouped per rank
    plan, _ = _plan("hf-dbrx", sp=False)
    assert "norm_attn_norm.attn.Wqkv" in plan.permutations


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * x


class _ScaledMLP(nn.Module):
    def __init__(self, on_input: bool) -> None:
        super().__init__()
        self.up_proj, self.down_proj, self.scale, self.on_input = nn.Linear(8, 16), nn.Linear(16, 8), _Scale(), on_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 8)
        if self.on_input:  # the scalar sees the whole (replicated) input: every rank's gradient is all of it
            return self.down_proj(self.up_proj(self.scale(x)))
        return self.down_proj(self.scale(self.up_proj(x)))  # this rank's 16/tp features: a part


class _ScaledBlock(nn.Module):
    def __init__(self, on_input: bool) -> None:
        super().__init__()
        self.mlp = _ScaledMLP(on_input)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)


class _ScaledNet(nn.Module):
    def __init__(self, on_input: bool) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 8), nn.Linear(8, 64)
        self.layers = nn.ModuleList(_ScaledBlock(on_input) for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)  # (B, T, 8)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def test_scalars_are_partial_only_on_column_parallel_features() -> None:
    for on_input in (False, True):
        net = _ScaledNet(on_input)
        trace = trace_model(net, "layers", torch.randint(0, 64, (2, 8)))
        if not on_input:
            plan = block_plan(net.layers[0], "layers.0", 2, trace, sequence_parallel=False)
            assert "mlp.scale.alpha" in plan.partial_params
            continue
        with pytest.raises(ValueError, match=r"layers\.0\.mlp\.scale holds parameters \(alpha\).*holds only scalars, "
                                             r"but its input does not come only from column-parallel projections.*"
                                             r"Use tp=1"):
            block_plan(net.layers[0], "layers.0", 2, trace, sequence_parallel=False)


def test_per_use_adapters_shard_with_the_projection_they_are_added_to() -> None:
    # Zamba2: one shared block run by every hybrid layer, use i adding adapter i (up(down(h))) to q/k/v and to the
    # fused gate|up. Adapter 1 runs only in block 1: its roles come from there. Each up-projection shards (and is
    # permuted) like the projection it is added to; the down-projections stay whole; the block's own linear after
    # the shared block, fed by nothing sharded, stays whole.
    plan, _ = _plan("hf-zamba2", sp=False)
    attn, mlp = "shared_transformer.self_attn", "shared_transformer.feed_forward"
    for i in (0, 1):
        for proj in ("q", "k", "v"):
            assert plan.linears[f"{attn}.linear_{proj}_adapter_list.{i}.0"] == "replicate"
            assert plan.linears[f"{attn}.linear_{proj}_adapter_list.{i}.1"] == "colwise"
        assert plan.linears[f"{mlp}.gate_up_proj_adapter_list.{i}.0"] == "replicate"
        assert plan.permutations[f"{mlp}.gate_up_proj_adapter_list.{i}.1"] == plan.permutations[f"{mlp}.gate_up_proj"]
    assert plan.whole == ["linear"] and "linear" not in plan.linears
    # with sequence parallelism: refused, naming the norm it cannot reach and the fix
    with pytest.raises(ValueError, match=r"mamba_decoder\.input_layernorm holds parameters .* Set sequence_parallel=False"):
        _plan("hf-zamba2", sp=True)
