"""Pure tests of the dry-run planner (``lightning_4d.planner``): counts against the real models, memory and
communication against hand-computed figures, bubble formulas, layout search, reports."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_4d.mesh import ParallelDims, rank_coordinates
from lightning_4d.models import GPT2, GPT2Config, HFStyleConfig, HFStyleLM, Llama, LlamaConfig
from lightning_4d.planner import (
    CPU_TOY,
    H100,
    ClusterSpec,
    NoLayoutFits,
    TrainSpec,
    TransformerSpec,
    collective_bytes,
    comm_per_rank,
    format_table,
    in_flight_microbatches,
    make_plan,
    memory_per_rank,
    search,
    seed_moe_1t,
    summarize,
    write_plan,
)
from lightning_4d.pipeline.bubble import bubble_from_actions
from lightning_4d.pipeline.schedules import bubble_theory
from lightning_4d.planner.hardware import axes_crossing_nodes, axis_group
from lightning_4d.planner.search import enumerate_layouts


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


# ---------------------------------------------------------------- parameter counts
@pytest.mark.parametrize("kw", [dict(), dict(n_kv_heads=2), dict(tie_embeddings=True)])
def test_counts_match_llama(kw):
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=16, **kw)
    model, spec = Llama(cfg), TransformerSpec.from_config(cfg)
    assert spec.total_params() == n_params(model) == model.num_params()
    assert spec.active_params_per_token(True) == model.num_params(exclude_embeddings=True)
    assert spec.flops_per_token(16) == model.flops_per_token(16)


@pytest.mark.parametrize("kw", [dict(), dict(bias=False), dict(tie_embeddings=False)])
def test_counts_match_gpt2(kw):
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, block_size=16, **kw)
    model, spec = GPT2(cfg), TransformerSpec.from_config(cfg)
    assert spec.total_params() == n_params(model)
    assert spec.flops_per_token(16) == model.flops_per_token(16)


@pytest.mark.parametrize("bias", [False, True])
def test_counts_match_hf_style(bias):
    cfg = HFStyleConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, attention_bias=bias)
    assert TransformerSpec.from_config(cfg).total_params() == n_params(HFStyleLM(cfg))


@pytest.mark.parametrize("kw", [dict(), dict(first_dense_layers=1, moe_every=2, shared_experts=1, n_kv_heads=2)])
def test_counts_match_moe(kw):
    from lightning_4d.models.moe import MoEConfig, MoETransformer

    cfg = MoEConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_hidden=48, num_experts=4, top_k=2,
                    expert_hidden=16, **kw)
    model, spec = MoETransformer(cfg), TransformerSpec.from_model(MoETransformer(cfg))
    assert spec.total_params() == n_params(model)
    assert spec.active_params_per_token() == model.num_active_params()
    assert spec.flops_per_token(16) == model.flops_per_token(16)
    comps = spec.components()
    assert comps["experts"] == sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-1] in
                                   ("w1", "w2", "w3") and "feed_forward" in n and p.dim() == 3)
    assert comps["router"] == sum(p.numel() for n, p in model.named_parameters() if "router" in n)


def test_hand_count():
    # V=10, h=8, L=3, a=2, g=1 (d=4), F=12, gated, untied.
    spec = TransformerSpec(vocab_size=10, hidden=8, layers=3, heads=2, kv_heads=1, ffn_hidden=12)
    attention = 8 * 8 + 2 * 8 * 4 + 8 * 8  # q, k, v, o
    mlp = 3 * 8 * 12
    assert spec.components() == {"embedding": 80, "attention": 3 * attention, "dense_mlp": 3 * mlp, "experts": 0,
                                 "router": 0, "shared_experts": 0, "norms": 3 * 2 * 8 + 8, "head": 80}
    moe = spec.with_(num_experts=4, top_k=1, expert_hidden=6, first_dense_layers=1)
    per_expert = 3 * 8 * 6
    assert moe.components()["experts"] == 2 * 4 * per_expert and moe.components()["router"] == 2 * 8 * 4
    assert moe.total_params() - moe.active_params_per_token() == 2 * 3 * per_expert


def test_seed_preset_matches_the_recipe_config():
    from pathlib import Path

    yaml = pytest.importorskip("yaml")
    from lightning_4d.models.moe import MoEConfig

    path = Path(__file__).resolve().parents[2] / "conf" / "model" / "moe_1t.yaml"
    if not path.exists():
        pytest.skip("conf/model/moe_1t.yaml is not in this checkout")
    fields = set(MoEConfig.__dataclass_fields__)
    cfg = MoEConfig(**{k: v for k, v in yaml.safe_load(path.read_text()).items() if k in fields})
    spec = TransformerSpec.from_config(cfg)
    assert spec.total_params() == seed_moe_1t().total_params() == 1_038_954_930_176  # the YAML's arithmetic
    assert spec.active_params_per_token() == seed_moe_1t().active_params_per_token()


# ---------------------------------------------------------------- memory
TINY = TransformerSpec(vocab_size=64, hidden=32, layers=4, heads=4, ffn_hidden=128, gated_mlp=False, seq_len=16)


def test_memory_hand_computed_sp_fsdp_1f1b():
    dims = ParallelDims.from_world(8, tp=2, pp=2)  # dp = 2
    mem = memory_per_rank(TINY, dims, TrainSpec(global_batch_size=8, microbatches=2))  # b = 8 / (2·2) = 2
    s, b, h, V, t = 16, 2, 32, 64, 2
    layer_tp = (4 * h * h + 2 * h * 128) // t + 2 * h  # matmuls / tp, two norms replicated
    dense0 = 2 * layer_tp + V * h // t  # layers 0-1 + vocab-parallel embedding
    dense1 = 2 * layer_tp + h + V * h // t  # layers 2-3 + final norm + head
    sbh = s * b * h
    # Eager kernels under DTensor SP: the gathered QKV / MLP inputs (4) whole, the rest (norm inputs and dropout masks
    # 6, q k v 6, the attention output kept twice 4, GeLU 4F/h) / t; flash: no 5as/h term; bf16 bytes.
    per_layer = sbh * (4 + (6 + 10 + 4 * 128 / h) / t)
    for r, dense, inflight in ((0, dense0, 2), (1, dense1, 1)):
        m = mem[r]
        assert (m.dense_params, m.expert_params, m.micro_batch_size, m.in_flight) == (dense, 0, b, inflight)
        held = -(-dense // 2)
        assert (m.params, m.grads, m.optimizer) == (4 * held, 4 * held, 8 * held)
        assert m.unsharded == (2 + 4) * dense  # pp > 1: gathered bf16 params + fp32 grad accumulators
        assert m.activations == inflight * 2 * per_layer
        # loss: bf16 logits held (2) + fp32 log-softmax saved (4) + its fp32 grad (4) + the bf16 cast (2) per
        # vocab-parallel element, plus the head's gathered bf16 input and its gradient (2·2·s·b·h)
        assert m.logits == ((s * b * V / t) * (2 + 4 + 4 + 2) + 2 * 2 * s * b * h if r == 1 else 0)
        assert m.total == m.params + m.grads + m.optimizer + m.unsharded + m.activations + m.logits


def test_activation_formula_variants():
    from lightning_4d.planner.memory import layer_activation_bytes

    s, b, h, a, t = 16, 2, 32, 4, 2
    sbh, scores = s * b * h, 5 * a * s / h
    no_flash = TrainSpec(1, flash_attention=False, kernels="fused")  # Megatron's kernels: Korthikanti's counts
    assert layer_activation_bytes(TINY, 0, ParallelDims(1), no_flash, b) == sbh * (34 + scores)  # Korthikanti
    tp_only = ParallelDims(2, tp=2, sequence_parallel=False)
    assert layer_activation_bytes(TINY, 0, tp_only, no_flash, b) == sbh * (10 + 24 / t + scores / t)
    assert layer_activation_bytes(TINY, 0, ParallelDims(2, tp=2), no_flash, b) == sbh * (34 + scores) / t
    assert layer_activation_bytes(TINY, 0, ParallelDims(1), no_flash.with_(precision="32-true"), b) == \
        2 * sbh * (34 + scores)
    full = memory_per_rank(TINY, ParallelDims(1), TrainSpec(2, activation_checkpointing="full", kernels="fused"))[0]
    assert full.activations == 4 * 2 * sbh + sbh * 34  # 2sbh per layer stored + one layer's working set
    # PyTorch's eager kernels (the runtime's): the attention output kept twice (+2), and under SP the gathered
    # QKV / MLP inputs (4) whole.
    eager = no_flash.with_(kernels="eager")
    assert layer_activation_bytes(TINY, 0, ParallelDims(1), eager, b) == sbh * (36 + scores)
    assert layer_activation_bytes(TINY, 0, ParallelDims(2, tp=2), eager, b) == sbh * (4 + (32 + scores) / t)
    gqa_glu = TINY.with_(kv_heads=2, gated_mlp=True)  # keys / values repeated to all heads; silu(w1 x) kept too
    assert layer_activation_bytes(gqa_glu, 0, ParallelDims(1), eager, b) == sbh * (10 + 10 + 8 * 128 / h + scores)
    assert layer_activation_bytes(gqa_glu, 0, ParallelDims(1), no_flash, b) == sbh * (10 + 6 + 6 * 128 / h + scores)


def test_memory_replicate_and_no_pp():
    dims = ParallelDims.from_world(2, tp=1)  # dp = 2, one micro-batch
    rep = memory_per_rank(TINY, dims, TrainSpec(4, data_parallel="replicate"))[0]
    fsdp = memory_per_rank(TINY, dims, TrainSpec(4))[0]
    total = TINY.total_params()
    assert rep.dense_params == total and rep.params == 4 * total and fsdp.params == 4 * (total // 2)
    layer = 4 * 32 * 32 + 2 * 32 * 128 + 2 * 32
    root = 2 * 64 * 32 + 32
    assert fsdp.unsharded == (2 * 2 + 4) * layer + 2 * root and rep.unsharded == 2 * 2 * layer


# ---------------------------------------------------------------- communication
def test_collective_formulas():
    assert collective_bytes("all_reduce", 8, 800) == 2 * 7 / 8 * 800
    assert collective_bytes("all_gather", 8, 800) == collective_bytes("reduce_scatter", 8, 800) == 700
    assert collective_bytes("all_to_all", 8, 800) == 700 and collective_bytes("all_reduce", 1, 800) == 0


@pytest.mark.parametrize("sp", [False, True])
def test_tp_comm_hand_computed(sp):
    spec = TransformerSpec(vocab_size=64, hidden=32, layers=2, heads=4, seq_len=16)
    dims = ParallelDims(2, tp=2, sequence_parallel=sp)
    out = summarize(comm_per_rank(spec, dims, TrainSpec(global_batch_size=2))[0])
    A = 2 * 16 * 32 * 2  # b·s·h·bf16
    loss = 3 * 2 * (1 / 2) * (2 * 16 * 4)  # 3 all-reduces of b·s fp32 numbers
    # dp = 1: the SP norms' grads stay Partial DTensors; the strategy all-reduces them (fp32) once per step
    repl = 2 * (1 / 2) * (2 * 2 * 32) * 4  # 2 norms per layer; the final norm sees the full sequence
    if sp:  # 2 layers × 4 pairs; the sequence is split at the first block (AG bwd) and gathered after the last
        # (AG fwd); the embedding's output and the head's input gradient are all-reduced
        assert out["tp"] == {"all_gather": 10 * A / 2, "reduce_scatter": 8 * A / 2,
                             "all_reduce": loss + repl + 2 * 2 * (1 / 2) * A}
    else:  # 2 layers × 4 all-reduces, embedding fwd, head bwd; without SP the norms see replicated
        # activations, so their gradients need no all-reduce (checked by tracing: test_planner_dry_run.py)
        assert out["tp"] == {"all_reduce": 10 * 2 * (1 / 2) * A + loss}
    assert set(out) == {"tp"}


def test_pp_ep_dp_comm_hand_computed():
    spec = TransformerSpec(vocab_size=64, hidden=32, layers=4, heads=4, seq_len=16, num_experts=4, top_k=2,
                           expert_hidden=16)
    dims = ParallelDims.from_world(8, tp=2, pp=2, ep=2)  # dp = 2, edp = 2
    recs = comm_per_rank(spec, dims, TrainSpec(global_batch_size=8, microbatches=2))  # b = 2
    b, s, h, t, m = 2, 16, 32, 2, 2
    first, last = summarize(recs[0]), summarize(recs[1])
    # SP shard, one boundary each way; the last stage's loss (1 fp32) broadcast over pp once per step
    assert first["pp"] == last["pp"] == {"send": m * b * s * h * 2 / t, "broadcast": (1 / 2) * 4}
    tokens = b * s / t
    a2a = 4 * m * 2 * (1 / 2) * tokens * 2 * h * 2 + m * 2 * (1 / 2) * 8 * 4  # 2 MoE layers; + counts
    assert first["ep"] == {"all_to_all": a2a}
    experts_local = 2 * 4 * 3 * h * 16 // 2  # 2 layers, E/ep experts each
    # under pipelining the experts stay gathered from the first forward to the last backward (as
    # lightning_4d.layout.parallelize wraps them): one all-gather per step
    assert first["edp"]["all_gather"] == (1 / 2) * experts_local * 2
    assert first["edp"]["reduce_scatter"] == (1 / 2) * experts_local * 4
    # experts that reshard after forward: m + in_flight gathers under 1F1B (rank 0 holds 2 in flight)
    resharding = TrainSpec(global_batch_size=8, microbatches=2, expert_reshard_after_forward=True)
    assert summarize(comm_per_rank(spec, dims, resharding)[0])["edp"]["all_gather"] == (
        (m + 2) * (1 / 2) * experts_local * 2)


# ---------------------------------------------------------------- bubble
def test_bubble_formulas():
    """The one bubble formula against the textbook ones (Narayanan et al. 2021; Qi et al. 2024)."""
    for p, m in ((2, 4), (4, 8), (8, 8)):
        assert bubble_theory("1f1b", p, m) == bubble_theory("gpipe", p, m) == pytest.approx((p - 1) / (m + p - 1))
        assert bubble_theory("interleaved_1f1b", p, m, 2) == pytest.approx((p - 1) / (2 * m + p - 1))
        # ZBV with m >= 2p: only the p − 1 start-up chunk forwards idle, against 3·v·m chunk passes of work.
        if m >= 2 * p:
            assert bubble_theory("zbv", p, m, 2) == pytest.approx((p - 1) / (6 * m + p - 1))
        assert bubble_theory("zbv", p, m, 2) > 0.0
    assert [in_flight_microbatches("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches("gpipe", 4, 8, 3) == 8 and in_flight_microbatches("1f1b", 4, 2, 0) == 2
    with pytest.raises(ValueError, match="exactly 2 stage"):
        bubble_theory("zbv", 4, 8, 1)
    with pytest.raises(ValueError, match="exactly 2 stage"):
        in_flight_microbatches("zbv", 4, 8, 0, v=1)


# (schedule, stages per rank): every schedule the runtime accepts (lightning_4d.config.SCHEDULES)
_RUNTIME_SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zbv", 2),
                      ("dualpipev", 2)]


@pytest.mark.parametrize("schedule,v", _RUNTIME_SCHEDULES)
def test_planner_bubble_equals_the_replay(schedule, v):
    """One owner for the bubble: the planner's number is the replay of torch's own action table."""
    from lightning_4d.config import SCHEDULES
    from lightning_4d.pipeline.schedules import validate_microbatches
    from lightning_4d.planner.bubble import replayed_bubble

    assert {s for s, _ in _RUNTIME_SCHEDULES} == set(SCHEDULES)
    checked = 0
    for p in (2, 3, 4, 6, 8):
        for m in range(1, 3 * p + 2):
            try:
                validate_microbatches(schedule, p, v, m)
            except ValueError:
                continue
            replay = bubble_from_actions(schedule, p, v, m)
            assert bubble_theory(schedule, p, m, v) == pytest.approx(replay, abs=1e-12), (p, m)
            assert replayed_bubble(schedule, p, m, v) == replay
            checked += 1
    assert checked >= 10


def test_zbv_bubble_with_few_microbatches_is_large():
    # p = 8 ranks, 1 micro-batch: each rank works 6 chunk passes (F, I, W on its 2 chunks) in a makespan of
    # 34 passes (F down the 16 chunks, I back up them, then rank 0's two deferred W): 28/34 idle.
    assert bubble_from_actions("zbv", 8, 2, 1) == pytest.approx(28 / 34)
    assert bubble_theory("zbv", 8, 1, 2) == pytest.approx(28 / 34)


# ---------------------------------------------------------------- hardware
def test_axis_groups_and_node_crossing():
    dims = ParallelDims.from_world(16, tp=4, pp=2, ep=4)  # dp = 2, edp = 2
    same = {"tp": ("pp", "dp"), "dp": ("pp", "tp"), "pp": ("dp", "tp"), "ep": ("pp", "edp"), "edp": ("pp", "ep")}
    for axis, fixed in same.items():
        for r in range(16):
            group = axis_group(dims, axis, r)
            assert r in group and len(group) == getattr(dims, axis)
            coords = [rank_coordinates(dims, x) for x in group]
            assert sorted(c[axis] for c in coords) == list(range(len(group)))
            assert all(c[k] == coords[0][k] for c in coords for k in fixed)
    cross = axes_crossing_nodes(dims, ClusterSpec(2, 8))
    assert cross == {"tp": False, "dp": False, "pp": True, "ep": False, "edp": False}
    assert axes_crossing_nodes(dims, ClusterSpec(4, 4))["dp"] is True


# ---------------------------------------------------------------- search
def test_enumerated_layouts_are_valid():
    spec = TransformerSpec(vocab_size=64, hidden=32, layers=4, heads=4, seq_len=16, num_experts=4, top_k=1,
                           expert_hidden=16)
    cluster = ClusterSpec(2, 4)
    seen = list(enumerate_layouts(spec, cluster, TrainSpec(global_batch_size=16)))
    assert len({(d.tp, d.pp, d.ep) for d, _ in seen}) > 5
    for dims, train in seen:
        ParallelDims.from_world(8, tp=dims.tp, pp=dims.pp, ep=dims.ep, virtual_stages=dims.virtual_stages)
        assert dims.tp <= 4 and spec.heads % dims.tp == 0 and spec.num_experts % dims.ep == 0
        assert dims.num_stages <= spec.layers and (16 // dims.dp) % train.microbatches == 0
        assert dims.pp > 1 or train.schedule == "1f1b"


def test_search_ranks_pure_dp_first_on_a_toy_cluster():
    spec = TransformerSpec(vocab_size=256, hidden=64, layers=4, heads=4, seq_len=32)
    res = search(spec, ClusterSpec(1, 4, CPU_TOY), TrainSpec(global_batch_size=16))
    assert (res[0].dims.tp, res[0].dims.pp, res[0].dims.dp) == (1, 1, 4)
    assert res[0].reason.startswith("fastest") and len(res) == 5
    times = [c.estimate.step_s for c in res]
    assert times == sorted(times) and all(c.fits and c.reason for c in res)
    assert all("slower than #1" in c.reason or "as fast as #1" in c.reason for c in res[1:])


def test_search_prefers_model_parallel_when_memory_forces_it():
    # Wide enough that the training step, not set-up's fixed scratch, sets every layout's peak.
    spec = TransformerSpec(vocab_size=256, hidden=256, layers=4, heads=4, seq_len=256)
    every = search(spec, ClusterSpec(1, 4, CPU_TOY), TrainSpec(32), top=1000, distinct=False)
    cap = min(c.peak_memory for c in every if c.dims.dp == 4) - 1  # pure data parallelism no longer fits
    expected = min((c for c in every if c.peak_memory <= cap), key=lambda c: (c.estimate.step_s, c.peak_memory))
    res = search(spec, ClusterSpec(1, 4, CPU_TOY.with_(memory_bytes=cap)), TrainSpec(32))
    assert res[0].label == expected.label and res[0].dims.tp * res[0].dims.pp * res[0].dims.cp > 1
    assert all(c.peak_memory <= cap for c in res)


def test_impossible_request_names_the_smallest_memory():
    with pytest.raises(NoLayoutFits, match=r"smallest peak memory is [0-9.]+ GB per device \(tp=") as err:
        search(seed_moe_1t(), ClusterSpec(1, 8, H100), TrainSpec(global_batch_size=8))
    assert "Needs a device with at least" in str(err.value)
    with pytest.raises(ValueError, match="No valid layout"):
        search(TransformerSpec(vocab_size=8, hidden=8, layers=1, heads=1), ClusterSpec(1, 3), TrainSpec(2))


# ---------------------------------------------------------------- report
def test_make_plan_and_write(tmp_path):
    spec, dims = seed_moe_1t(), ParallelDims.from_world(512, tp=8, pp=4, ep=8)  # conf/parallel/moe_1t.yaml
    train = TrainSpec(512, microbatches=32, activation_checkpointing="full")
    plan = make_plan(spec, dims, ClusterSpec(64, 8, H100), train)
    for key in ("total_params", "active_params_per_token", "memory", "communication", "bubble", "step_time_s",
                "mfu", "assumptions"):
        assert key in plan
    assert plan["bubble"]["theory"] == 3 / 35
    assert len(plan["memory"]["per_role"]) == 4 and set(plan["communication"]["busiest_rank"]) == {
        "tp", "pp", "ep", "dp", "edp"}
    # Under pipelining torch keeps FSDP parameters gathered and fp32 gradients unsharded between
    # micro-batches: 6 bytes per local parameter (~32.5 B of them) on top of the sharded states.
    assert not plan["memory"]["fits"] and plan["memory"]["per_role"][0]["unsharded"] > 190e9
    assert "uniform routing" in " ".join(plan["assumptions"])
    assert "bytes sent per step" in format_table(plan)
    path = write_plan(plan, tmp_path / "out" / "plan.json")
    assert json.load(open(path))["total_params"] == spec.total_params()


# ---------------------------------------------------------------- search over the strategy's options
def test_search_winners_bubble_equals_the_replay():
    from lightning_4d.planner.bubble import replayed_bubble

    spec = TransformerSpec(vocab_size=256, hidden=64, layers=8, heads=4, seq_len=32)
    every = search(spec, ClusterSpec(1, 8, CPU_TOY), TrainSpec(32), top=100000, distinct=False,
                   activation_checkpointing=(None,), data_parallel=("fsdp",))
    piped = [c for c in every if c.dims.pp > 1]
    assert piped
    for c in piped:
        m, d = c.train.microbatches, c.dims
        assert c.estimate.bubble == pytest.approx(replayed_bubble(c.train.schedule, d.pp, m, d.virtual_stages),
                                                  abs=1e-12)


def test_search_varies_checkpointing_sp_and_dp_mode_within_what_the_runtime_accepts():
    from lightning_4d.config import DATA_PARALLEL, FourDConfig

    spec = TransformerSpec(vocab_size=64, hidden=32, layers=4, heads=4, seq_len=16)
    seen = list(enumerate_layouts(spec, ClusterSpec(2, 2), TrainSpec(global_batch_size=8)))
    assert {t.activation_checkpointing for _, t in seen} == {None, "selective", "full"}
    assert {d.sp for d, _ in seen if d.tp > 1} == {True, False}
    assert {t.data_parallel for _, t in seen} == set(DATA_PARALLEL)
    for dims, train in seen:  # every proposal passes the strategy's own validation
        FourDConfig(tp=dims.tp, pp=dims.pp, ep=dims.ep, sequence_parallel=dims.sequence_parallel,
                    schedule=train.schedule, data_parallel=train.data_parallel, dp_shard=train.dp_shard,
                    activation_checkpointing=train.activation_checkpointing).resolve(4)
    planned = {t.data_parallel for _, t in enumerate_layouts(spec, ClusterSpec(2, 2), TrainSpec(8), runtime_only=False)}
    assert planned == {"fsdp", "replicate", "hsdp", "zero1", "zero2"}


def test_search_never_proposes_a_tie_across_v_stages_with_dp():
    # The runtime refuses tied embedding/head under ZBV / DualPipeV with dp > 1 (two roots on one rank).
    tied = TransformerSpec(vocab_size=64, hidden=32, layers=4, heads=4, seq_len=16, tied_embeddings=True)
    seen = list(enumerate_layouts(tied, ClusterSpec(1, 8), TrainSpec(global_batch_size=16)))
    assert seen and not [(d, t.schedule) for d, t in seen if t.schedule in ("zbv", "dualpipev") and d.pp > 1
                         and d.dp > 1]
    untied = list(enumerate_layouts(tied.with_(tied_embeddings=False), ClusterSpec(1, 8), TrainSpec(16)))
    assert any(t.schedule == "zbv" and d.dp > 1 for d, t in untied)


def test_a_cluster_that_trained_the_model_finds_a_layout():
    """Llama 3.1 8B on 8 × 80 GB (TorchTitan ran it on 8 H100s, local batch 2 × 8192 tokens): the search
    must find layouts (it needs checkpointing to vary)."""
    llama8b = TransformerSpec(vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn_hidden=14336,
                              seq_len=8192)
    best = search(llama8b, ClusterSpec(1, 8, H100), TrainSpec(16), top=3, schedules=("1f1b",))
    assert best and all(c.fits for c in best)


# ---------------------------------------------------------------- HSDP and ZeRO-1/2
def test_dp_mode_states_and_traffic():
    from lightning_4d.planner.dp_modes import dp_traffic, state_bytes, state_bytes_per_param

    n, P = 8, 800
    # bf16 kept params 2, fp32 master 4 and moments 8 sharded, fp32 grads 4 kept (ZeRO-1) or sharded (ZeRO-2)
    assert state_bytes_per_param("zero1", n) == 2 + 4 + 12 / 8
    assert state_bytes_per_param("zero2", n) == 2 + 16 / 8
    assert state_bytes_per_param("hsdp", 32, shard=8) == 16 / 8 and state_bytes_per_param("replicate", n) == 16
    assert sum(state_bytes("fsdp", P, n).values()) == 16 * P / 8
    # ZeRO-1: one reduce-scatter of fp32 grads and one all-gather of bf16 params per step
    assert dp_traffic("zero1", P, n, microbatches=4).shard_bytes == 7 / 8 * P * (4 + 2)
    assert dp_traffic("zero2", P, n, microbatches=4).shard_bytes == 7 / 8 * P * (4 * 4 + 2)
    # HSDP 4 × 2: FSDP inside groups of 2 (one gather, one reduce-scatter), all-reduce of the fp32 shard over 4
    t = dp_traffic("hsdp", P, 8, gather_passes=1, shard=2)
    assert (t.shard_bytes, t.replica_bytes) == (1 / 2 * P * (2 + 4), 2 * 3 / 4 * 4 * P / 2)


def test_hsdp_memory_shards_inside_the_group_only():
    dims = ParallelDims.from_world(8)  # dp = 8
    fsdp = memory_per_rank(TINY, dims, TrainSpec(8))[0]
    hsdp = memory_per_rank(TINY, dims, TrainSpec(8, data_parallel="hsdp", dp_shard=2))[0]
    full = memory_per_rank(TINY, ParallelDims.from_world(2), TrainSpec(2))[0]
    assert hsdp.params == full.params and hsdp.optimizer == full.optimizer and hsdp.params > fsdp.params
    zero1 = memory_per_rank(TINY, dims, TrainSpec(8, data_parallel="zero1"))[0]
    n = TINY.total_params()
    assert zero1.grads == 4 * n and zero1.unsharded == 0 and zero1.params == 2 * n + 4 * -(-n // 8)


@pytest.mark.parametrize("kw", [dict(), dict(qkv_bias=True, out_bias=True, mlp_bias=True, norm="layernorm",
                                             norm_bias=True, gated_mlp=False, fused_qkv=True),
                                dict(num_experts=4, top_k=2, expert_hidden=16, shared_experts=1)])
def test_fsdp_tensor_shapes_add_up_to_the_local_counts(kw: dict) -> None:
    # Without padding (dims divisible), the per-tensor shapes FSDP2 shards add up to local_params' counts.
    from lightning_4d.planner.comm import block_tensor_shapes, fsdp_elements, root_tensor_shapes
    from lightning_4d.planner.memory import local_params

    spec = TransformerSpec(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64, **kw)
    dims = ParallelDims.from_world(4, tp=2)
    lp = local_params(spec, dims, [0, 1], True, True)
    blocks = [fsdp_elements(block_tensor_shapes(spec, 2, spec.is_moe_layer(i)), 2) for i in (0, 1)]
    assert blocks == lp["layer_dense"]
    assert fsdp_elements(root_tensor_shapes(spec, 2, True, True), 2) == lp["root"]
    assert fsdp_elements([(10, 3)], 4) == 36  # ceil(10/4)=3 rows per rank, 12 rows gathered
