"""Context parallelism without a process group: the zigzag index math, the global masks, batch sharding, the
degrees and their validation, and the set-up refusals that need no forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_4d.core.batches import PackedInputs, document_ids
from lightning_4d.config import FourDConfig
from lightning_4d.context_parallel import (
    MaskSpec, SequenceShard, UnsplittableAttention, check_sequence_length, gathered_order, restore_order,
    shard_batch, zigzag_indices, zigzag_split,
)
from lightning_4d.context_parallel.check import check_declared, example_length
from lightning_4d.mesh import ParallelDims, rank_coordinates


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_ranks_cover_the_sequence_once(cp: int) -> None:
    T = 2 * cp * 3
    held = torch.cat([zigzag_indices(T, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(T))
    assert torch.equal(gathered_order(T, cp), held)
    assert torch.equal(gathered_order(T, cp)[restore_order(T, cp)], torch.arange(T))


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_balances_causal_work(cp: int) -> None:
    # Under a causal mask every rank's queries see the same number of keys (the reason for head + tail chunks).
    T = 2 * cp * 4
    work = [int((zigzag_indices(T, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work
    contiguous = [sum(range(r * T // cp + 1, (r + 1) * T // cp + 1)) for r in range(cp)]
    assert len(set(contiguous)) == cp  # a plain split would not be balanced


def test_zigzag_chunks_and_split() -> None:
    assert zigzag_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(32).view(2, 16)
    assert torch.equal(zigzag_split(x, 2, 1), x[:, 4:12])
    with pytest.raises(ValueError, match="outside the 2 context-parallel ranks"):
        zigzag_indices(16, 2, 2)


@pytest.mark.parametrize("T, cp, tp, match",
                         [(10, 2, 1, "not divisible by 2·cp = 4"), (12, 2, 4, "not divisible by tp=4")])
def test_sequence_length_rules(T: int, cp: int, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_sequence_length(T, cp, tp)


def test_global_mask_is_the_whole_sequence_mask_restricted_to_local_queries() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7]])  # three packed documents
    docs = document_ids(positions)
    whole = MaskSpec(documents=True).allowed(torch.arange(16), torch.arange(16), docs, docs)  # (1, 1, 16, 16)
    for rank in range(2):
        shard = SequenceShard(None, 2, rank, 16, global_docs=docs)
        local = shard.global_mask(MaskSpec(documents=True), torch.device("cpu"))  # (1, 1, 8, 16)
        assert torch.equal(local, whole[:, :, zigzag_indices(16, 2, rank)])
        causal_only = shard.global_mask(MaskSpec(), torch.device("cpu"))
        assert bool((causal_only >= local).all()) and not torch.equal(causal_only, local)


def test_shard_batch_cuts_tokens_targets_and_positions() -> None:
    tokens, targets = torch.arange(16).view(1, 16), torch.arange(1, 17).view(1, 16)
    x, y, shard = shard_batch(tokens, targets, None, cp=2, rank=0, takes_positions=True)
    assert x.tokens.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] and y.tolist() == [[1, 2, 3, 4, 13, 14, 15, 16]]
    assert x.position_ids.tolist() == x.tokens.tolist()  # global positions for the rotary embeddings
    assert shard.global_docs is None and shard.local_docs.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    plain, _, shard = shard_batch(tokens, targets, None, cp=2, rank=1, takes_positions=False)
    assert plain.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]] and shard.local_docs is None
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    packed, _, shard = shard_batch(PackedInputs(tokens, positions), targets, None, 2, 1, takes_positions=True)
    assert packed.position_ids.tolist() == [[4, 5, 0, 1, 2, 3, 4, 5]]
    assert torch.equal(shard.global_docs, document_ids(positions))
    # packed under pp: the documents are each micro-batch's, learnt when it enters the model
    _, _, per_micro = shard_batch(PackedInputs(tokens, positions), targets, None, 2, 1, takes_positions=True,
                                  pipelined=True)
    assert per_micro.per_microbatch and not shard.per_microbatch
    with pytest.raises(ValueError, match=r"\(batch, sequence, …\)"):
        shard_batch(tokens, targets[:, :8], None, 2, 0, takes_positions=False)


def test_degrees_with_cp() -> None:
    dims = ParallelDims.from_world(16, tp=2, cp=2, pp=2)
    assert (dims.dp, dims.dp_cp, dims.edp) == (2, 4, 8)
    coords = [rank_coordinates(dims, r) for r in range(8)]
    assert [c["tp"] for c in coords] == [0, 1] * 4  # tp innermost, then cp, then dp
    assert [c["cp"] for c in coords] == [0, 0, 1, 1] * 2
    assert [c["dp"] for c in coords] == [0] * 4 + [1] * 4
    assert "cp" not in rank_coordinates(ParallelDims.from_world(4, tp=2), 0)
    assert FourDConfig(cp=2, tp=2).resolve(8).dp == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=6, cp=4), "not divisible by tp·pp·cp"),
    (dict(world_size=8, cp=2, dp=2), r"tp·pp·dp·cp = 1·1·2·2 = 4 does not equal the world size 8"),
    (dict(world_size=4, cp=2, ep=3), "ep=3 does not divide dp·cp·tp"),
    (dict(world_size=4, cp=0), "cp=0 is below 1"),
    (dict(world_size=8, cp=2, dp=4, dp_shard=3), "dp_shard=3 does not divide dp=4"),
])
def test_invalid_cp_degrees(kwargs: dict, match: str) -> None:
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        ParallelDims.from_world(world, **kwargs)


def test_hsdp_with_cp_shards_over_dp_shard_times_cp() -> None:
    from lightning_4d.planner.comm import comm_per_rank
    from lightning_4d.planner.spec import TrainSpec, TransformerSpec

    dims = ParallelDims.from_world(8, cp=2, dp_shard=2)  # dp = 4: 2 replicas of 2 · cp = 4 ranks sharding
    assert (dims.dp, dims.dp_replicate, dims.dp_cp) == (4, 2, 8)
    spec = TransformerSpec(vocab_size=64, hidden=32, layers=2, heads=4, ffn_hidden=64, seq_len=64)
    records = comm_per_rank(spec, dims, TrainSpec(8, data_parallel="hsdp", dp_shard=2))[0]
    assert {r.group for r in records if r.axis == "dp_shard"} == {4}
    assert {r.group for r in records if r.axis == "dp_replicate"} == {2}


class _Windowed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.sliding_window = 128


class _Capped(nn.Module):  # Gemma 2's attention: logits soft-capped
    def __init__(self) -> None:
        super().__init__()
        self.attn_logit_softcapping = 50.0


class _Config:  # a transformers-style config: instance attributes
    def __init__(self, **values: object) -> None:
        self.position_embedding_type = "absolute"
        self.use_alibi = True
        vars(self).update(values)


class _BiasedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()


def test_declared_softcapping_and_alibi_are_refused_naming_the_module_windows_are_not() -> None:
    with pytest.raises(UnsplittableAttention, match=r"module 'blocks.1' \(_Capped\): it caps the attention logits"):
        check_declared(nn.ModuleDict({"blocks": nn.ModuleList([nn.Linear(4, 4), _Capped()])}))
    with pytest.raises(UnsplittableAttention, match=r"its config uses ALiBi \(use_alibi\)"):
        check_declared(_BiasedModel())
    check_declared(nn.Sequential(nn.Linear(4, 4)))
    check_declared(nn.ModuleDict({"blocks": nn.ModuleList([nn.Linear(4, 4), _Windowed()])}))  # supported now


def _with_config(**values: object) -> nn.Module:
    module = nn.Linear(2, 2)
    module.config = _Config(use_alibi=False, **values)  # type: ignore[assignment]
    return module


def test_window_masks_from_global_positions() -> None:
    shard = SequenceShard(None, cp=2, rank=0, seq_len=8)  # holds positions 0, 1, 6, 7
    mask = shard.global_mask(MaskSpec("window", 3), torch.device("cpu"))[0, 0].int().tolist()
    assert mask[3] == [0, 0, 0, 0, 0, 1, 1, 1]  # position 7 sees 5, 6, 7
    assert mask[1] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert shard.ranges() == [(0, 2), (6, 8)]


def test_example_length_avoids_model_dimensions_and_crosses_declared_lengths() -> None:
    assert example_length(nn.Linear(8, 8), cp=2) == 12  # 8 is a dimension: (8, 8) would look like scores
    assert example_length(nn.Linear(3, 5), cp=2, tp=2) == 8
    assert example_length(nn.Linear(3, 5), cp=3, tp=2) == 12
    # a window and a chunk declared (4096, 8192): shrunk to 3 and 5 for the check, which runs on more than 2 · 5
    assert example_length(_with_config(sliding_window=4096, attention_chunk_size=8192), cp=2) == 12


def test_planner_counts_context_parallelism() -> None:
    from lightning_4d.context_parallel.cost import kv_gathered_bytes, kv_wire_bytes, ring_wire_bytes, ulysses_wire_bytes
    from lightning_4d.planner.comm import comm_per_rank
    from lightning_4d.planner.memory import layer_activation_bytes, memory_per_rank
    from lightning_4d.planner.spec import TrainSpec, TransformerSpec

    spec = TransformerSpec(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64, seq_len=4096)
    train = TrainSpec(global_batch_size=2, cp_algorithm="allgather")
    one, two = ParallelDims(1), ParallelDims(2, cp=2)
    # Activations (K/V all-gather): half the tokens, plus the other half of the gathered K/V (repeated to every query
    # head, as SDPA receives them); attention in pieces keeps no mask.
    whole, split = (layer_activation_bytes(spec, 0, d, train, b=2) for d in (one, two))
    assert split == whole / 2 + kv_gathered_bytes(2, 4096, spec.gathered_kv_width, train.act_bytes) / 2
    m1, m2 = memory_per_rank(spec, one, train)[0], memory_per_rank(spec, two, train)[0]
    assert m2.params == m1.params / 2  # FSDP2 over dp × cp
    assert m2.activations == 2 * split
    # Communication: the K/V all-gathers and reduce-scatters of the formula on the cp axis.
    records = comm_per_rank(spec, two, train)[0]
    sent = sum(r.bytes_sent for r in records if r.axis == "cp")
    assert sent == kv_wire_bytes(2, 4096, spec.gathered_kv_width, layers=2, cp=2, act_bytes=train.act_bytes)
    assert {r.axis for r in records} >= {"cp", "dp_cp"}
    # Ulysses ("auto" picks it: 4 heads divide by cp=2): activations exactly half, its all-to-alls on the cp axis.
    ulysses = train.with_(cp_algorithm="auto")
    assert ulysses.cp_algorithm_for(spec, 2) == "ulysses"
    assert layer_activation_bytes(spec, 0, two, ulysses, b=2) == whole / 2
    records = comm_per_rank(spec, two, ulysses)[0]
    assert {r.kind for r in records if r.axis == "cp"} == {"all_to_all"}
    sent = sum(r.bytes_sent for r in records if r.axis == "cp")
    assert sent == ulysses_wire_bytes(2, 4096, spec.q_width, spec.q_width, layers=2, cp=2, act_bytes=train.act_bytes)
    # The ring: activations half (one remote chunk at a time), its sends on the cp axis.
    ring = train.with_(cp_algorithm="ring")
    assert layer_activation_bytes(spec, 0, two, ring, b=2) == whole / 2
    records = comm_per_rank(spec, two, ring)[0]
    assert {r.kind for r in records if r.axis == "cp"} == {"send"}
    sent = sum(r.bytes_sent for r in records if r.axis == "cp")
    assert sent == ring_wire_bytes(2, 4096, spec.gathered_kv_width, layers=2, cp=2, act_bytes=train.act_bytes)


def test_planner_compute_time_falls_with_cp() -> None:
    from lightning_4d.planner.compute import rank_compute_time
    from lightning_4d.planner.hardware import H100
    from lightning_4d.planner.spec import TrainSpec, TransformerSpec

    spec = TransformerSpec(vocab_size=128, hidden=1024, layers=2, heads=8, seq_len=16384)
    one, two = (rank_compute_time(spec, d, TrainSpec(2), H100, [0, 1], True, b=2, microbatches=1)
                for d in (ParallelDims(1), ParallelDims(2, cp=2)))
    assert 0.45 < two.total / one.total < 0.6  # half the tokens and half the (query, key) pairs per rank


# ------------------------------------------------------------------------------------------- the algorithm
def test_algorithm_is_chosen_from_the_heads_per_tp_rank() -> None:
    from lightning_4d.context_parallel.algorithm import choose_algorithm

    calls = [("module 'layers.0.attn' (Attention)", 8, 4, False), ("module 'layers.1.attn' (Attention)", 8, 4, False)]
    assert choose_algorithm("auto", calls, cp=2) == "ulysses"
    assert choose_algorithm("auto", calls, cp=2, tp=2) == "ulysses"  # 4 query and 2 K/V heads per tp rank
    assert choose_algorithm("auto", calls, cp=4, tp=2) == "ring"  # 2 K/V heads per tp rank: not by 4
    assert choose_algorithm("auto", [("m", 8, 4, True)], cp=8) == "ulysses"  # GQA left to SDPA: K/V repeated to 8
    # narrow K/V (8 query heads, 1 K/V head per cp rank): the ring sends fewer bytes than Ulysses' all-to-alls
    assert choose_algorithm("auto", [("m", 16, 2, False)], cp=2) == "ring"
    assert choose_algorithm("allgather", calls, cp=2) == choose_algorithm("auto", [], cp=2) == "allgather"
    assert choose_algorithm("ring", calls, cp=2) == "ring"
    with pytest.raises(ValueError, match=r"module 'layers.0.attn' \(Attention\) .* 2 query and 1 K/V heads .*tp=4.*"
                                         r"cp=2"):
        choose_algorithm("ulysses", calls, cp=2, tp=4)
    with pytest.raises(ValueError, match="cp_algorithm='sparse' is not known"):
        FourDConfig(cp=2, cp_algorithm="sparse")
    assert FourDConfig(cp=2, cp_algorithm="ring").cp_algorithm == "ring"


def _meta_llama(heads: int, kv_heads: int) -> nn.Module:
    from lightning_4d.models import Llama, LlamaConfig

    with torch.device("meta"):
        return Llama(LlamaConfig(vocab_size=32, dim=8 * heads, n_layers=2, n_heads=heads, n_kv_heads=kv_heads,
                                 ffn_hidden=32, max_seq_len=64))


def test_layout_plan_names_the_algorithm() -> None:
    from lightning_4d.layout.derive_plan import plan_layout
    from lightning_4d.plan import LayoutPlan

    lm = _meta_llama(4, 2)
    auto = plan_layout(lm, ParallelDims(2, cp=2), FourDConfig(cp=2))
    assert auto.cp_algorithm == "ulysses" and "context parallel: ulysses: " in str(auto)
    assert LayoutPlan.from_json(auto.to_json()).cp_algorithm == "ulysses"
    assert plan_layout(lm, ParallelDims(4, cp=4), FourDConfig(cp=4)).cp_algorithm == "ulysses"  # K/V repeated
    assert plan_layout(lm, ParallelDims(8, cp=8), FourDConfig(cp=8)).cp_algorithm == "ring"  # 4 heads
    given = plan_layout(lm, ParallelDims(2, cp=2), FourDConfig(cp=2, cp_algorithm="allgather"))
    assert given.cp_algorithm == "allgather"
    assert plan_layout(lm, ParallelDims(1), FourDConfig()).cp_algorithm == ""
    with pytest.raises(ValueError, match=r"cp_algorithm='ulysses': module 'layers.0.attention' .* 4 query and 4 K/V "
                                         r"heads .* cp=8"):
        plan_layout(lm, ParallelDims(8, cp=8), FourDConfig(cp=8, cp_algorithm="ulysses"))
    with pytest.raises(ValueError, match="names no algorithm"):
        auto.replace(context_parallel="sparse").check(lm, ParallelDims(2, cp=2))


def test_ulysses_and_ring_activations_and_bytes() -> None:
    from lightning_4d.context_parallel.cost import activation_bytes_per_rank, ring_wire_bytes, ulysses_wire_bytes

    assert activation_bytes_per_rank(8.0, 1, 64, 16, 2, cp=4, act_bytes=2, algorithm="ulysses") == 2.0
    assert activation_bytes_per_rank(8.0, 1, 64, 16, 2, cp=4, act_bytes=2, algorithm="ring") == 2.0
    # per layer: own K/V (2·32/4 tokens of width 8, fp32) 3 hops forward, 3 (K/V) + 4 (grads) backward
    assert ring_wire_bytes(2, 32, 8, layers=1, cp=4, act_bytes=4) == (3 + 3 + 4) * (2 * 2 * 8 * 8 * 4)
    assert ring_wire_bytes(2, 32, 8, layers=1, cp=4, act_bytes=4, recompute=True) == (6 + 3 + 4) * (2 * 2 * 8 * 8 * 4)
    # per layer: q (w 8), k, v (w 4 each) and the output (w 8) of 2·32/2 tokens, fp32, half of it sent; 2 passes
    assert ulysses_wire_bytes(2, 32, 8, 4, layers=1, cp=2, act_bytes=4) == 2 * (2 * 16 * 24 * 4) / 2
    assert ulysses_wire_bytes(2, 32, 8, 4, layers=1, cp=2, act_bytes=4, recompute=True) == 3 * (2 * 16 * 24 * 4) / 2
