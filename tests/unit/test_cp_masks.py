"""Context parallelism's masks without a process group: each kind read back from the mask it makes, the pieces one
attention runs in (exactly the allowed (query, key) pairs, each once; no mask where the structure needs none),
attention in those pieces against SDPA with the whole mask (forward and backward, fused and public kernels), the
declared lengths shrunk and restored, and the reading of a layer's mask (mapped back, or refused naming the
module)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d._compat import kernels
from lightning_4d.context_parallel import UnsplittableAttention, zigzag_ranges
from lightning_4d.context_parallel.blockwise import piecewise_attention
from lightning_4d.context_parallel.lengths import declared_lengths, shrunk
from lightning_4d.context_parallel.masks import MaskSpec, classify_documents, classify_mask, plan_pieces
from lightning_4d.context_parallel.probe import MaskRecord, layer_specs
from lightning_4d.core.batches import document_ids

T = 24
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(T))])
DOCS = document_ids(POSITIONS)  # (2, T): three documents in the first row, one in the second
SPECS = [MaskSpec(), MaskSpec("window", 5), MaskSpec("chunk", 7), MaskSpec("full"), MaskSpec(documents=True),
         MaskSpec("window", 5, True), MaskSpec("chunk", 7, True)]
IDX = torch.arange(T)


@pytest.mark.parametrize("spec", [MaskSpec(), MaskSpec("window", 1), MaskSpec("window", 5), MaskSpec("chunk", 2),
                                  MaskSpec("chunk", 7), MaskSpec("full")])
def test_every_kind_reads_back_from_its_mask(spec: MaskSpec) -> None:
    assert classify_mask(spec.allowed(IDX, IDX)[0, 0]) == spec
    within = MaskSpec(spec.kind, spec.size, True).allowed(IDX, IDX, DOCS, DOCS, POSITIONS, POSITIONS)[:, 0]
    assert classify_documents(within, spec, DOCS, POSITIONS) is True
    plain = spec.allowed(IDX, IDX)[:, 0].expand(2, T, T)
    if not torch.equal(plain, within):  # (a window of 1 is the same mask either way)
        assert classify_documents(plain, spec, DOCS, POSITIONS) is False


def test_unknown_masks_read_as_none() -> None:
    prefix = MaskSpec().allowed(IDX, IDX)[0, 0].clone()
    prefix[:, :4] = True  # a prefix-LM: every query sees the first 4 tokens
    holes = MaskSpec().allowed(IDX, IDX)[0, 0] & (torch.rand(T, T, generator=torch.Generator().manual_seed(0)) > 0.3)
    assert classify_mask(prefix) is None and classify_mask(holes) is None
    # a window longer than the sequence reads as causal: the check's sequence must cross every window
    assert classify_mask(MaskSpec("window", T).allowed(IDX, IDX)[0, 0]) == MaskSpec()


def _covered(pieces: list, queries: list[tuple[int, int]], spec: MaskSpec) -> torch.Tensor:
    """How often each (query, key) pair is attended by ``pieces`` (keys: the whole sequence), ``(Nq, T)``."""
    q_idx = torch.cat([torch.arange(a, b) for a, b in queries])
    count = torch.zeros(len(q_idx), T, dtype=torch.int64)
    for p in pieces:
        q, k = torch.arange(p.q0, p.q0 + p.qe - p.qs), torch.arange(p.k0, p.k0 + p.ke - p.ks)
        assert torch.equal(q_idx[p.qs:p.qe], q)  # a piece's rows are one contiguous range of the sequence
        inside = {"full": torch.ones(len(q), len(k), dtype=torch.bool),
                  "causal": torch.ones(len(q), len(k), dtype=torch.bool).tril(),
                  "masked": spec.allowed(q, k)[0, 0]}[p.kind]
        count[p.qs:p.qe, p.ks:p.ke] += inside.long()
    return count


@pytest.mark.parametrize("cp, rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("spec", [s for s in SPECS if not s.documents])
def test_pieces_cover_the_allowed_pairs_once(spec: MaskSpec, cp: int, rank: int) -> None:
    queries = zigzag_ranges(T, cp, rank)
    for block in (2, 5, 1024):
        pieces = plan_pieces(queries, [(0, T)], spec, block=block)
        q_idx = torch.cat([torch.arange(a, b) for a, b in queries])
        assert torch.equal(_covered(pieces, queries, spec), spec.allowed(q_idx, IDX)[0, 0].long())
        assert all(max(p.qe - p.qs, p.ke - p.ks) <= block for p in pieces if p.kind == "masked")
        if spec.kind in ("causal", "chunk", "full"):  # no mask: keys before a chunk, the diagonal, chunk edges
            assert {p.kind for p in pieces} <= {"full", "causal"}, pieces


def test_pieces_on_documents_mask_every_piece_and_skip_excluded_ones() -> None:
    queries = zigzag_ranges(T, 2, 0)  # 0..5 and 18..23
    pieces = plan_pieces(queries, [(0, T)], MaskSpec("window", 5, True), documents=True, block=4)
    assert {p.kind for p in pieces} == {"masked"}
    keys = {k for p in pieces for k in range(p.k0, p.k0 + p.ke - p.ks)}
    assert keys == set(range(0, 6)) | set(range(14, 24))  # the window excludes keys 6..13 from every query
    # chunks follow each document's positions: only causality skips pieces (every key up to the query is planned)
    pieces = plan_pieces(queries, [(0, T)], MaskSpec("chunk", 7, True), documents=True, block=4)
    assert {k for p in pieces for k in range(p.k0, p.k0 + p.ke - p.ks)} == set(range(T))
    idx = torch.arange(T)  # in packed documents, chunk edges are at multiples of 7 of each document's positions
    mask = MaskSpec("chunk", 7, True).allowed(idx, idx, DOCS, DOCS, POSITIONS, POSITIONS)[0, 0]
    # index 19 is position 7 of the third document (starting at index 12): the first of its second chunk
    assert mask[19, 12:20].tolist() == [False] * 7 + [True] and mask[20, 19:21].tolist() == [True, True]


@pytest.mark.parametrize("kernel", ["fused", "math"])
def test_piecewise_attention_is_sdpa_with_the_whole_mask(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel == "math":
        monkeypatch.setattr(kernels, "_lse_kernel", lambda q: "math")
    gen = torch.Generator().manual_seed(0)
    for spec, (cp, rank) in itertools.product(SPECS, [(1, 0), (2, 1), (3, 0)]):
        q, k, v = (torch.randn(2, 3, T, 4, generator=gen, requires_grad=True) for _ in range(3))
        w = torch.randn(2, 3, T, 4, generator=gen)
        queries = zigzag_ranges(T, cp, rank)
        rows = torch.cat([torch.arange(a, b) for a, b in queries])
        pieces = plan_pieces(queries, [(0, T)], spec, spec.documents, block=4)
        got = piecewise_attention(q[:, :, rows], k, v, pieces, spec, DOCS, positions=POSITIONS)
        mask = spec.allowed(rows, IDX, DOCS[:, rows], DOCS, POSITIONS[:, rows], POSITIONS)
        want = F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=mask)
        grads = torch.autograd.grad((got * w[:, :, rows]).sum(), (q, k, v))
        wants = torch.autograd.grad((want * w[:, :, rows]).sum(), (q, k, v))
        torch.testing.assert_close(got, want, msg=lambda m: f"{spec} cp={cp} rank={rank}: {m}")
        for a, b in zip(grads, wants):
            torch.testing.assert_close(a, b, msg=lambda m: f"{spec} cp={cp} rank={rank} grad: {m}")


class _Config:
    def __init__(self) -> None:
        self.sliding_window, self.attention_chunk_size, self.max_window_layers = 4096, 8192, 2


class _Attn(nn.Module):
    floor_scale = 8192  # a class attribute: shows through again afterwards

    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()
        self.sliding_window = 4096


def test_declared_lengths_shrink_and_come_back() -> None:
    model = nn.Sequential(_Attn())
    found = sorted((name, value) for _, name, value in declared_lengths(model))
    assert found == [("attention_chunk_size", 8192), ("floor_scale", 8192), ("sliding_window", 4096),
                     ("sliding_window", 4096)]  # max_window_layers is a layer count, not a length
    with shrunk(model) as lengths:
        assert (model[0].sliding_window, model[0].config.sliding_window, model[0].config.attention_chunk_size,
                model[0].floor_scale) == (3, 3, 5, 5)
        assert lengths.original(3) == 4096 and lengths.original(5) == 8192 and lengths.original(4) is None
    assert (model[0].sliding_window, model[0].config.attention_chunk_size) == (4096, 8192)
    assert "floor_scale" not in vars(model[0]) and model[0].floor_scale == 8192


def test_layer_masks_read_mapped_back_or_refused() -> None:
    causal = MaskSpec().allowed(IDX, IDX)[:, 0].expand(2, T, T)
    window = MaskSpec("window", 3).allowed(IDX, IDX)[:, 0].expand(2, T, T)
    records = [MaskRecord("a", "module 'a' (A)", causal), MaskRecord("b", "module 'b' (B)", window)]
    with shrunk(nn.Sequential(_Attn())) as lengths:
        specs = layer_specs(records, lengths=lengths)
    assert specs == {"a": (MaskSpec(),), "b": (MaskSpec("window", 4096),)}
    odd = [MaskRecord("c", "module 'c' (C)", MaskSpec("window", 4).allowed(IDX, IDX)[:, 0].expand(2, T, T))]
    with shrunk(nn.Sequential(_Attn())) as lengths, pytest.raises(UnsplittableAttention, match="module 'c'.* 4 tokens"):
        layer_specs(odd, lengths=lengths)
    prefix = causal.clone()
    prefix[:, :, :2] = True
    with pytest.raises(UnsplittableAttention, match="module 'p' .* none of those context parallelism knows"):
        layer_specs([MaskRecord("p", "module 'p' (P)", prefix)])
    docs_records = [MaskRecord("a", "module 'a' (A)", MaskSpec(documents=True).allowed(IDX, IDX, DOCS, DOCS)[:, 0]),
                    MaskRecord("b", "module 'b' (B)", window)]
    assert layer_specs(records, docs_records, POSITIONS) == {"a": (MaskSpec(documents=True),),
                                                             "b": (MaskSpec("window", 3),)}


def test_a_meta_model_over_the_check_budget_declaring_a_window_is_refused() -> None:
    from lightning_4d.context_parallel.refusals import check_unread_masks

    with pytest.raises(UnsplittableAttention, match=r"sliding_window=4096.*reduced_check_budget=<bytes>.*cp=1"):
        check_unread_masks(nn.Sequential(_Attn()), need=2**40, budget=None)
    check_unread_masks(nn.Linear(2, 2), need=2**40, budget=None)  # nothing declared: local masks checked per step
