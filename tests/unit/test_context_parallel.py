"""Context parallelism without a process group: the zigzag index math, the global masks, batch sharding, the
degrees and their validation, and the set-up refusals that need no forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_4d.batches import PackedInputs, document_ids
from lightning_4d.config import FourDConfig
from lightning_4d.context_parallel import (
    SequenceShard, UnsplittableAttention, causal_mask, check_sequence_length, gathered_order, restore_order,
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
    whole = causal_mask(torch.arange(16), torch.arange(16), docs, docs)  # (1, 1, 16, 16)
    for rank in range(2):
        shard = SequenceShard(None, 2, rank, 16, global_docs=docs)
        local = shard.global_mask(True, torch.device("cpu"))  # (1, 1, 8, 16)
        assert torch.equal(local, whole[:, :, zigzag_indices(16, 2, rank)])
        causal_only = shard.global_mask(False, torch.device("cpu"))
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
    with pytest.raises(ValueError, match="pipeline parallelism"):
        shard_batch(PackedInputs(tokens, positions), targets, None, 2, 1, takes_positions=True, pipelined=True)
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
    (dict(world_size=4, cp=2, dp_shard=1), "data_parallel='hsdp'"),
])
def test_invalid_cp_degrees(kwargs: dict, match: str) -> None:
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        ParallelDims.from_world(world, **kwargs)


class _Windowed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.sliding_window = 128


class _Config:  # a transformers-style config: instance attributes
    def __init__(self) -> None:
        self.position_embedding_type = "absolute"
        self.use_alibi = True


class _BiasedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()


def test_declared_sliding_window_and_alibi_are_refused_naming_the_module() -> None:
    with pytest.raises(UnsplittableAttention, match=r"module 'blocks.1' \(_Windowed\): it declares a sliding window"):
        check_declared(nn.ModuleDict({"blocks": nn.ModuleList([nn.Linear(4, 4), _Windowed()])}))
    with pytest.raises(UnsplittableAttention, match=r"its config uses ALiBi \(use_alibi\)"):
        check_declared(_BiasedModel())
    check_declared(nn.Sequential(nn.Linear(4, 4)))


def test_example_length_avoids_model_dimensions() -> None:
    assert example_length(nn.Linear(8, 8), cp=2) == 12  # 8 is a dimension: (8, 8) would look like scores
    assert example_length(nn.Linear(3, 5), cp=2, tp=2) == 8
    assert example_length(nn.Linear(3, 5), cp=3, tp=2) == 12


def test_planner_counts_context_parallelism() -> None:
    from lightning_4d.context_parallel.cost import kv_gathered_bytes, kv_wire_bytes, mask_bytes
    from lightning_4d.planner.comm import comm_per_rank
    from lightning_4d.planner.memory import layer_activation_bytes, memory_per_rank
    from lightning_4d.planner.spec import TrainSpec, TransformerSpec

    spec = TransformerSpec(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64, seq_len=4096)
    train = TrainSpec(global_batch_size=2)
    one, two = ParallelDims(1), ParallelDims(2, cp=2)
    # Activations: half the tokens, plus the other half of the gathered K/V (repeated to every query head, as SDPA
    # receives them) and the additive (T/2, T) mask SDPA keeps.
    whole, split = (layer_activation_bytes(spec, 0, d, train, b=2) for d in (one, two))
    assert split == (whole / 2 + kv_gathered_bytes(2, 4096, spec.q_width, train.act_bytes) / 2
                     + 2048 * 4096 * train.act_bytes)
    assert mask_bytes(4096, 2, train.act_bytes) == 2048 * 4096 * train.act_bytes
    m1, m2 = memory_per_rank(spec, one, train)[0], memory_per_rank(spec, two, train)[0]
    assert m2.params == m1.params / 2  # FSDP2 over dp × cp
    assert m2.activations == 2 * split  # (hidden 32 at T = 4096: the T² mask outweighs what cp saves)
    # Communication: the K/V all-gathers and reduce-scatters of the formula on the cp axis.
    records = comm_per_rank(spec, two, train)[0]
    sent = sum(r.bytes_sent for r in records if r.axis == "cp")
    assert sent == kv_wire_bytes(2, 4096, spec.q_width, layers=2, cp=2, act_bytes=train.act_bytes)
    assert {r.axis for r in records} >= {"cp", "dp_cp"}


def test_planner_compute_time_falls_with_cp() -> None:
    from lightning_4d.planner.compute import rank_compute_time
    from lightning_4d.planner.hardware import H100
    from lightning_4d.planner.spec import TrainSpec, TransformerSpec

    spec = TransformerSpec(vocab_size=128, hidden=1024, layers=2, heads=8, seq_len=16384)
    one, two = (rank_compute_time(spec, d, TrainSpec(2), H100, [0, 1], True, b=2, microbatches=1)
                for d in (ParallelDims(1), ParallelDims(2, cp=2)))
    assert 0.45 < two.total / one.total < 0.6  # half the tokens and half the (query, key) pairs per rank
