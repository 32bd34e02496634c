"""The planner's communication formulas against the collectives of the real rewriting
(``lightning_4d.layout.parallelize.parallelize_module``) traced on torch's ``fake`` process group, in one process:
dense TP / SP / DP / PP layouts, activation checkpointing, bf16, GPT-2 and MoE models, and the reference 1T MoE."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from lightning_4d.mesh import ParallelDims
from lightning_4d.models import GPT2, CausalLM, GPT2Config, Llama, LlamaConfig
from lightning_4d.planner import TrainSpec, TransformerSpec
from lightning_4d.planner.comm import expert_padding
from lightning_4d.planner.dry_run import dry_run, representative_ranks, uniform_experts, uniform_routing

pytestmark = pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a process group")

LLAMA = dict(vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32)


def _check(result, axes):
    assert result.ok, result.format()
    for r in result.ranks:
        assert set(r.traced) == set(r.analytic), result.format()
        for axis, kinds in r.analytic.items():
            for kind, value in kinds.items():
                assert r.traced[axis][kind] == pytest.approx(value, rel=1e-9), (r.rank, axis, kind)
    assert set().union(*(r.traced for r in result.ranks)) == set(axes)


# ---------------------------------------------------------------------------------------------- dense
DENSE = {
    "tp+sp, fsdp": (4, dict(tp=2), dict(), 2, {"tp", "dp"}),
    "tp without sp, replicate, full AC": (
        4, dict(tp=2, sequence_parallel=False), dict(data_parallel="replicate", activation_checkpointing="full"), 2,
        {"tp", "dp"}),
    "tp+sp, pp 1f1b, fsdp, bf16-mixed": (8, dict(tp=2, pp=2), dict(microbatches=4, precision="bf16-mixed"), 2,
                                         {"tp", "dp", "pp"}),
    "interleaved pp, tp+sp, selective AC": (
        4, dict(tp=2, pp=2, virtual_stages=2), dict(microbatches=2, schedule="interleaved_1f1b",
                                                   activation_checkpointing="selective"), 4, {"tp", "pp"}),
    "zbv, dp": (4, dict(pp=2, virtual_stages=2), dict(microbatches=4, schedule="zbv"), 4, {"dp", "pp"}),
    # dp = 1: the SP norms' gradients stay Partial DTensors until the strategy resolves them, once per step
    "tp+sp without dp": (2, dict(tp=2), dict(), 2, {"tp"}),
    # dp = 3 divides no dimension: FSDP2 pads every tensor's dim 0 to a multiple of 3 (the formulas too)
    "tp+sp, fsdp over dp=3 (padded)": (6, dict(tp=2), dict(), 2, {"tp", "dp"}),
    "pp 1f1b, fsdp over dp=3 (padded)": (6, dict(pp=2), dict(microbatches=2), 2, {"dp", "pp"}),
    # HSDP: reduce-scatter / all-gather inside dp_shard, the gradient shard all-reduced over dp_replicate (the
    # global loss's scalars over the whole dp group)
    "hsdp 2x2, tp+sp": (8, dict(tp=2, dp_shard=2), dict(data_parallel="hsdp"), 2,
                        {"tp", "dp", "dp_shard", "dp_replicate"}),
    "hsdp 3x2 (padded), pp 1f1b": (12, dict(pp=2, dp_shard=2), dict(data_parallel="hsdp", microbatches=2), 2,
                                   {"pp", "dp", "dp_shard", "dp_replicate"}),
}


# Context parallelism: the sequence cut in zigzag chunks (lightning_4d.context_parallel), K/V all-gathered over cp in
# every attention call (reduce-scatter backward), parameters data-parallel over dp × cp (with dp = 1 the dp × cp
# group is the cp group: FSDP's traffic is named cp; cp × tp: test_context_parallel_kv_bytes_by_hand)
DENSE.update({
    "cp=2, fsdp over dp×cp": (4, dict(cp=2), dict(), 2, {"cp", "dp_cp"}),
    "cp=2 × pp=2, fsdp over dp×cp": (8, dict(pp=2, cp=2), dict(microbatches=2), 2, {"pp", "cp", "dp_cp"}),
})


def test_context_parallel_kv_bytes_by_hand():
    """The K/V all-gather of every attention call on the fake cp group against the bytes worked out by hand: the
    package's Llama repeats its 2 K/V heads to the 4 query heads before attention, so K and V are gathered 4 heads
    wide (``TransformerSpec.gathered_kv_width``, not the ``kv_width`` of the projections); Ulysses' all-to-alls and the
    ring's sends."""
    cfg = LlamaConfig(n_layers=2, **LLAMA)
    b, T, heads, hd, fp32 = 1, 32, 4, 16, 4
    for tp, ac, passes in ((1, None, 1), (2, "full", 2)):  # full AC gathers again in the recomputed forward
        dims = ParallelDims.from_world(4 * tp, tp=tp, cp=2)  # dp = 2: FSDP's dp × cp group is not the cp group
        train = TrainSpec(global_batch_size=dims.dp, precision="32-true", activation_checkpointing=ac,
                          cp_algorithm="allgather")
        result = dry_run(lambda: CausalLM(Llama(cfg)), TransformerSpec.from_config(cfg, seq_len=T), dims, train)
        assert result.ok, result.format()
        gathered = 2 * b * T * heads * hd // tp * fp32  # K and V stacked, the whole sequence, this tp rank's heads
        for r in result.ranks:
            assert r.traced["cp"]["all_gather"] == 2 * passes * gathered / 2  # 2 layers, (cp − 1)/cp of it sent
            assert r.traced["cp"]["reduce_scatter"] == 2 * gathered / 2
            assert r.traced_calls["cp"] == {"all_gather": 2 * passes, "reduce_scatter": 2}
        # Ulysses ("auto": this tp rank's heads divide by cp): q|k|v stacked (3 tensors) and the output, all-to-all
        # in forward (again when recomputed) and backward; each sends (cp − 1)/cp of the rank's T/cp tokens.
        result = dry_run(lambda: CausalLM(Llama(cfg)), TransformerSpec.from_config(cfg, seq_len=T), dims,
                         train.with_(cp_algorithm="auto"))
        assert result.ok, result.format()
        local = b * T // 2 * heads * hd // tp * fp32  # one of q, k, v or the output on this rank
        for r in result.ranks:
            assert r.traced["cp"] == {"all_to_all": 2 * (passes + 1) * (3 + 1) * local / 2}
        # The ring: this rank's K and V (one message) to the next rank once per forward (again when recomputed) and
        # backward, and their gradients twice (cp = 2: one hop, one home), point-to-point, 2 layers.
        result = dry_run(lambda: CausalLM(Llama(cfg)), TransformerSpec.from_config(cfg, seq_len=T), dims,
                         train.with_(cp_algorithm="ring"))
        assert result.ok, result.format()
        for r in result.ranks:
            assert r.traced["cp"] == {"send": 2 * (passes + 1 + 2) * 2 * local}
            assert r.traced_calls["cp"] == {"send": 2 * (passes + 1 + 2)}


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_layouts_trace_to_the_formulas(name):
    world, degrees, train_kw, layers, axes = DENSE[name]
    cfg = LlamaConfig(n_layers=layers, **LLAMA)
    dims = ParallelDims.from_world(world, **degrees)
    train_kw = {"precision": "32-true", **train_kw}
    m = train_kw.get("microbatches") or 1
    train = TrainSpec(global_batch_size=dims.dp * m, **train_kw)
    result = dry_run(lambda: CausalLM(Llama(cfg)), TransformerSpec.from_config(cfg, seq_len=32), dims, train)
    _check(result, axes)
    assert [r.rank for r in result.ranks] == representative_ranks(dims)


def test_gpt2_learned_positions_biases_and_tied_head():
    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, block_size=32)
    dims = ParallelDims.from_world(8, tp=2, pp=2)
    result = dry_run(lambda: CausalLM(GPT2(cfg)), TransformerSpec.from_config(cfg, seq_len=32), dims,
                     TrainSpec(global_batch_size=8, microbatches=4, precision="32-true"))
    _check(result, {"tp", "dp", "pp"})


def test_moe_under_hsdp_keeps_experts_fsdp_over_edp():
    from lightning_4d.models.moe import MoEConfig, MoETransformer

    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, n_layers=2, **LLAMA)
    dims = ParallelDims.from_world(8, tp=2, ep=2, dp_shard=2)
    train = TrainSpec(global_batch_size=4, data_parallel="hsdp", precision="32-true")
    result = dry_run(lambda: CausalLM(MoETransformer(cfg)), TransformerSpec.from_config(cfg, seq_len=32), dims, train)
    _check(result, {"tp", "dp", "ep", "edp", "dp_shard", "dp_replicate"})


def test_moe_under_context_parallelism_routes_the_rank_s_sequence_shard():
    from lightning_4d.models.moe import MoEConfig, MoETransformer

    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, n_layers=2, **LLAMA)
    dims = ParallelDims.from_world(4, cp=2, ep=2)  # experts folded over dp × cp × tp: edp = 2·2·1 / 2 = 2
    result = dry_run(lambda: CausalLM(MoETransformer(cfg)), TransformerSpec.from_config(cfg, seq_len=32), dims,
                     TrainSpec(global_batch_size=dims.dp, precision="32-true"))
    _check(result, {"cp", "dp_cp", "ep", "edp"})


def test_gpt2_fused_qkv_and_tied_table_padded_over_dp3():
    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, block_size=32)
    dims = ParallelDims.from_world(6, tp=2)
    result = dry_run(lambda: CausalLM(GPT2(cfg)), TransformerSpec.from_config(cfg, seq_len=32), dims,
                     TrainSpec(global_batch_size=3, precision="32-true"))
    _check(result, {"tp", "dp"})


def test_pipeline_sends_are_the_measured_boundary_tensors():
    cfg = LlamaConfig(n_layers=2, **LLAMA)
    dims = ParallelDims.from_world(4, tp=2, pp=2)
    result = dry_run(lambda: CausalLM(Llama(cfg)), TransformerSpec.from_config(cfg, seq_len=32), dims,
                     TrainSpec(global_batch_size=2, microbatches=2, precision="32-true"))
    shard = 1 * (32 // 2) * 64 * 4  # b · s/tp · h · fp32: a rank sends its sequence shard
    assert [r.traced["pp"]["send"] for r in result.ranks] == [shard, shard]


def test_an_optimizer_step_that_cannot_run_is_said_once_with_its_cause():
    class NeedsTrainer(CausalLM):
        def configure_optimizers(self):
            raise RuntimeError("this optimizer reads self.trainer")

    cfg = LlamaConfig(n_layers=2, **LLAMA)
    dims = ParallelDims.from_world(4, tp=2, pp=2)
    ranks = re.escape(str(representative_ranks(dims)))
    with pytest.warns(UserWarning, match=rf"optimizer step was not traced on ranks {ranks}.*reads self.trainer") as record:
        result = dry_run(lambda: NeedsTrainer(Llama(cfg)), TransformerSpec.from_config(cfg, seq_len=32), dims,
                         TrainSpec(global_batch_size=2, microbatches=2, precision="32-true"))
    assert len([w for w in record if "optimizer step" in str(w.message)]) == 1
    assert all(any("reads self.trainer" in n for n in r.notes) for r in result.ranks)


# ---------------------------------------------------------------------------------------------- MoE
def test_moe_layers_trace_to_the_formulas_under_uniform_routing():
    from lightning_4d.models.moe import MoEConfig, MoETransformer

    cfg = MoEConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32,
                    num_experts=4, top_k=2, expert_hidden=64, first_dense_layers=1, shared_experts=1,
                    aux_loss_coef=0.01)
    dims = ParallelDims.from_world(8, tp=2, pp=2, ep=2)
    train = TrainSpec(global_batch_size=8, microbatches=4, precision="bf16-mixed", activation_checkpointing="full")
    spec = TransformerSpec.from_config(cfg, seq_len=32)
    assert spec.router_aux_loss
    result = dry_run(lambda: CausalLM(MoETransformer(cfg)), spec, dims, train)
    _check(result, {"tp", "dp", "pp", "ep", "edp"})
    for r in result.ranks:  # dispatch + combine, their reverses and the recomputed forward's (6), counts (2)
        n_moe = sum(spec.is_moe_layer(i) for i in r.layers)
        assert r.traced_calls["ep"]["all_to_all"] == r.analytic_calls["ep"]["all_to_all"] == n_moe * (6 + 2)
        assert r.traced["ep"]["all_reduce"] > 0 and r.traced["edp"]["all_reduce"] > 0
    assert "uniform routing" in " ".join(result.assumptions)


def test_seed_moe_1t_one_block_per_stage_on_512_fake_ranks():
    """The reference 1T MoE layout (conf/parallel/moe_1t.yaml: tp=8 + SP, ep=8, pp=4, dp=16) with the real widths, one block per pipeline stage."""
    from lightning_4d.models.moe import MoEConfig, MoETransformer

    cfg = MoEConfig(vocab_size=128256, dim=8192, n_layers=4, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                    max_seq_len=8192, num_experts=64, top_k=2, expert_hidden=16384, aux_loss_coef=0.001)
    dims = ParallelDims.from_world(512, tp=8, pp=4, ep=8)
    train = TrainSpec(global_batch_size=16 * 32, seq_len=256, microbatches=32, activation_checkpointing="full")
    spec = TransformerSpec.from_config(cfg, seq_len=256)
    result = dry_run(lambda: CausalLM(MoETransformer(cfg)), spec, dims, train)
    _check(result, {"tp", "dp", "pp", "ep", "edp"})
    assert [r.rank for r in result.ranks] == [0, 137, 274, 411]
    # 8 local experts sharded over edp = 16 ranks: FSDP2 pads dim 0 to 16 rows, twice the expert bytes.
    assert expert_padding(spec, dims) == 2.0
    experts_local = 64 // 8 * 3 * 8192 * 16384
    assert result.ranks[0].traced["edp"]["reduce_scatter"] == pytest.approx(15 / 16 * 2 * experts_local * 4)


def test_moe_1t_like_layout_without_the_trace_plans_what_the_trace_finds():
    """A moe_1t-shaped layout (every block MoE, top-2, SP, pp > 1, experts FSDP over edp = 2, more ep ranks than a
    rank's routed assignments): the formulas the planner uses without a trace (``TrainSpec`` defaults: experts
    kept gathered under pipelining, as ``lightning_4d.layout.parallelize`` wraps them) agree with the traced bytes."""
    from lightning_4d.layout.data_parallel import reshards_after_forward
    from lightning_4d.models.moe import MoEConfig, MoETransformer
    from lightning_4d.planner.comm import comm_per_rank, summarize

    cfg = MoEConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32,
                    num_experts=8, top_k=2, expert_hidden=64, aux_loss_coef=0.001)
    dims = ParallelDims.from_world(32, tp=2, pp=2, ep=8)  # edp = dp·tp/ep = 2
    train = TrainSpec(global_batch_size=16, seq_len=4, microbatches=2, activation_checkpointing="selective")
    spec = TransformerSpec.from_config(cfg, seq_len=4)
    result = dry_run(lambda: CausalLM(MoETransformer(cfg)), spec, dims, train)
    assert result.ok, result.format()
    # 2 tokens per tp rank × top-2 = 4 assignments < ep = 8: traced with 2 sequences so every ep rank gets one
    assert result.micro_batch_size == 2 and any("so that uniform routing" in a for a in result.assumptions)
    assert result.expert_reshard_after_forward is reshards_after_forward(dims.pp) is False
    untraced = comm_per_rank(spec, dims, train.with_(global_batch_size=2 * dims.dp, microbatches=1))  # no override
    for r in result.ranks:
        formulas = summarize(untraced[r.coordinates["pp"]])
        for axis in ("ep", "edp"):
            for kind, traced in r.traced[axis].items():
                assert formulas[axis][kind] == pytest.approx(traced, rel=0.25), (r.rank, axis, kind)


# ---------------------------------------------------------------------------------------------- pieces
def test_traced_micro_batch_gives_every_ep_rank_the_same_share():
    from lightning_4d.planner.dry_run import traced_micro_batch
    from lightning_4d.planner.spec import seed_moe_1t

    spec = seed_moe_1t()
    wide = ParallelDims.from_world(512, tp=8, pp=8, ep=64)  # conf/parallel/moe_1t_512.yaml
    assert traced_micro_batch(spec, wide, 1, 128) == 2  # 16 tokens · 2 = 32 assignments over 64 ranks
    assert traced_micro_batch(spec, wide, 1, 4096) == 1
    assert traced_micro_batch(spec, ParallelDims.from_world(512, tp=8, pp=4, ep=8), 1, 128) == 1
    n = 2 * 128 // 8 * 2  # the widened micro-batch's assignments per rank
    assert torch.bincount(uniform_experts(n, 64, 64), minlength=64).tolist() == [1] * 64


def test_uniform_experts_spread_over_ranks_then_experts():
    idx = uniform_experts(32, num_experts=64, ep=8)  # fewer assignments than experts: still 4 per ep rank
    assert torch.bincount(idx // 8, minlength=8).tolist() == [4] * 8
    assert torch.bincount(uniform_experts(256, 64, 8), minlength=64).tolist() == [4] * 64
    pairs = uniform_experts(12, 4, 2).view(6, 2)
    assert all(a != b for a, b in pairs.tolist())  # a token's k choices are distinct experts


def test_uniform_routing_runs_the_real_layer_and_resets_the_seam():
    from lightning_4d.expert_parallel import MoE
    from lightning_4d.expert_parallel.permute import FIXED_ROUTING

    torch.manual_seed(0)  # a routing of its own that is not the uniform one
    layer = MoE(8, 16, num_experts=4, top_k=2)
    x = torch.randn(2, 6, 8)
    with uniform_routing():
        out = layer(x)
    assert out.shape == x.shape and layer.tokens_per_expert.tolist() == [6, 6, 6, 6]
    assert FIXED_ROUTING.get() is None
    layer(x)
    assert layer.tokens_per_expert.tolist() != [6, 6, 6, 6]  # the router decides again


def test_recorder_names_a_group_shared_by_two_axes_after_the_dense_one():
    from lightning_4d.mesh import build_mesh
    from lightning_4d.planner.fake_world import CollectiveRecorder, fake_world

    dims = ParallelDims.from_world(4, tp=4)  # tp spans the world: tp, edp and the default group coincide
    with fake_world(4, rank=1):
        mesh = build_mesh(dims, "cpu")
        with CollectiveRecorder(mesh) as rec:
            dist.all_reduce(torch.ones(4), group=mesh["tp"].get_group())
    assert rec.counts() == {"tp": {"all_reduce": 1}}
