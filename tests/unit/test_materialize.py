"""Materialising a meta-built model piece by piece (single process): every tensor is initialised from recorded,
replayable steps whose values do not depend on how the elements are chunked or in which order they are computed;
calls that need values run on whole tensors; uninitialised tensors are named."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from lightning_4d.materialize import init_pieces
from lightning_4d.materialize import local_shards as mat
from lightning_4d._compat import init_calls
from lightning_4d.materialize.local_shards import UninitializedError, materialize, materialize_local_shards, meta_skeleton
from lightning_4d.models import CausalLM
from lightning_4d.layout.reduced_check import perturb_, reduce_depth, reduce_vocabulary
from tests.distributed.common import build_model


def _states(module: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters())
    out.update(dict(module.named_buffers()))
    return out


def _both(build: Any, seed: int = 0) -> tuple[nn.Module, nn.Module, mat.MaterializeReport]:
    """(one-process reference, the same built again and materialised with 7-element chunks, its report)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        ref = build()
    materialize(ref)
    torch.manual_seed(seed)
    with torch.device("meta"):
        got = build()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mat, "CHUNK_ELEMENTS", 7)  # chunk boundaries everywhere: values must not depend on them
        report = materialize_local_shards(meta_skeleton(got), got, torch.device("cpu"))
    return ref, got, report


@pytest.mark.parametrize("kind", ["llama", "gpt2", "hf", "moe", "hf-llama", "hf-gpt2"])
def test_values_do_not_depend_on_chunking_and_are_drawn_as_specified(kind: str) -> None:
    ref, got, report = _both(lambda: CausalLM(build_model(kind)))
    a, b = _states(ref), _states(got)
    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
    assert report.tensors == len({id(t) for t in a.values()})
    assert report.whole_calls == [] and report.largest_call_bytes == 0  # every initialiser replayed piece by piece
    for name, t in a.items():
        if t.is_floating_point():
            assert torch.isfinite(t).all(), name


def test_another_seed_gives_other_values_and_the_same_seed_the_same() -> None:
    def build() -> nn.Module:
        return nn.Linear(64, 32)

    one, two, _ = _both(build, seed=1)
    torch.manual_seed(2)
    with torch.device("meta"):
        other = build()
    materialize(other)
    assert torch.equal(one.weight, two.weight) and not torch.equal(one.weight, other.weight)


def test_initialisers_keep_their_distributions() -> None:
    """The replayed draws follow the initialiser's own distribution: Linear's kaiming-uniform bound, normal's std,
    trunc_normal's bounds (a large tensor: the sample statistics are within a few standard errors)."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(256, 512)
            self.emb = nn.Embedding(512, 256)
            self.trunc = nn.Parameter(torch.empty(512, 256))

        def init_weights(self) -> None:
            nn.init.normal_(self.emb.weight, std=0.5)
            nn.init.trunc_normal_(self.trunc, std=1.0, a=-0.5, b=1.5)

    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net()
    materialize(net)
    n = net.emb.weight.numel()
    bound = 1 / math.sqrt(256)  # kaiming_uniform_(a=sqrt(5)) on fan_in 256
    w = net.lin.weight.detach()
    assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.99 * bound
    assert abs(float(w.mean())) < 4 * bound / math.sqrt(3 * w.numel())
    e = net.emb.weight.detach()
    assert abs(float(e.std()) - 0.5) < 4 * 0.5 / math.sqrt(2 * n) and abs(float(e.mean())) < 4 * 0.5 / math.sqrt(n)
    t = net.trunc.detach()
    assert float(t.min()) >= -0.5 and float(t.max()) <= 1.5 and float(t.min()) < -0.49 and float(t.max()) > 1.49


def test_counter_draws_are_addressable_and_independent() -> None:
    key = init_pieces.draw_key(b"seed", "w", 0)
    positions = torch.arange(10_000)
    whole = init_pieces.normal01(key, positions)
    shuffled = torch.randperm(10_000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(init_pieces.normal01(key, positions[shuffled]), whole[shuffled])
    other = init_pieces.normal01(init_pieces.draw_key(b"seed", "w", 1), positions)
    assert abs(float(torch.corrcoef(torch.stack([whole, other]))[0, 1])) < 4 / math.sqrt(10_000)


def test_a_call_that_reads_values_runs_whole_and_is_listed() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def init_weights(self) -> None:
            with torch.no_grad():
                self.lin.weight.div_(self.lin.weight.norm())  # needs the values

    ref, got, report = _both(Net, seed=4)
    assert torch.equal(ref.lin.weight, got.lin.weight)
    assert len(report.whole_calls) == 1 and "init_weights" in report.whole_calls[0], report.whole_calls
    assert abs(float(got.lin.weight.detach().norm()) - 1.0) < 1e-5  # the values it read were the replayed ones


def test_hugging_face_init_weights_expanded_per_module() -> None:
    pytest.importorskip("transformers")
    from tests.distributed.byom_models import build_byom

    torch.manual_seed(3)
    with torch.device("meta"):
        model = build_byom("hf-llama")
    labels = [c.label for c in init_calls(model)]
    assert any("._init_weights(" in label for label in labels), labels
    assert not any(label.endswith(".init_weights()") and "ForCausalLM" in label for label in labels), labels


class _HandRMSNorm(nn.Module):
    """A norm written by hand, as most are: no reset_parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_uninitialised_parameter_fails_by_name() -> None:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), _HandRMSNorm(4))
    with pytest.raises(UninitializedError, match=r"nothing initialised 1\.weight .*reset_parameters\(\)"):
        materialize_local_shards(meta_skeleton(net), net, torch.device("cpu"))


def test_partially_written_tensor_keeps_earlier_values() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(6, 3)

        def init_weights(self) -> None:  # after Embedding.reset_parameters: zero one row only
            with torch.no_grad():
                self.emb.weight[2].zero_()

    ref, got, _ = _both(Net, seed=5)
    assert torch.equal(ref.emb.weight, got.emb.weight)
    weight = got.emb.weight.detach()
    assert float(weight[2].abs().sum()) == 0.0 and bool((weight[[0, 1, 3, 4, 5]] != 0).all())


def test_a_partly_written_tensor_fails_by_name() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.empty(4, 3))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.table[:2].fill_(1.0)  # rows 2 and 3 never written

    with torch.device("meta"):
        net = Net()
    with pytest.raises(UninitializedError, match="table"):
        materialize(net)


def test_real_tensors_are_kept_and_weight_source_overrides() -> None:
    class Source:
        def names(self) -> list[str]:
            return ["0.weight"]

        def get(self, name: str) -> torch.Tensor:
            return torch.full((2, 2), 7.0)

    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net.register_buffer("table", torch.arange(3.0))  # made for real
    net.fourd_weight_source = Source()
    report = materialize_local_shards(meta_skeleton(net), net, torch.device("cpu"))
    assert net[0].weight.eq(7.0).all() and report.loaded == 1
    assert net.table.tolist() == [0.0, 1.0, 2.0]


def test_write_to_a_meta_tensor_outside_the_model_fails_loudly() -> None:
    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.scratch = [torch.empty(3)]  # on the meta device, and not a parameter or buffer

        def init_weights(self) -> None:
            self.scratch[0].normal_()  # a draw the meta device would silently skip

    with torch.device("meta"):
        net = Cached()
    with pytest.raises(RuntimeError, match="writes a tensor on the meta device that is none of"):
        materialize_local_shards(meta_skeleton(net), net, torch.device("cpu"))


def test_reduced_copy_keeps_each_block_kind_and_cuts_the_vocabulary() -> None:
    with torch.device("meta"):
        lm = CausalLM(build_model("moe"))  # the MoE reference model: dense and MoE layers alternate? any
    kinds = reduce_depth(copy.deepcopy(lm), "model.layers", 1)
    assert kinds[0] == 0
    with torch.device("meta"):
        net = nn.Sequential(nn.Embedding(100, 4), nn.Linear(4, 100, bias=False))
    net[1].weight = net[0].weight  # tied
    assert reduce_vocabulary(net, 8) == 100
    assert net[1].weight is net[0].weight and tuple(net[0].weight.shape) == (8, 4)


def test_perturbation_breaks_symmetry() -> None:
    norm = nn.LayerNorm(6)
    perturb_(norm, torch.Generator().manual_seed(0))
    assert len(set(norm.weight.tolist())) == 6 and len(set(norm.bias.tolist())) == 6


def test_coverage_of_blocks_matches_a_per_element_count() -> None:
    """``init_pieces.covers`` (grid of block boundaries) against the positions the views really touch, on random
    slices, selects and transposes (transposes are not blocks: ``None``)."""
    from lightning_4d.materialize.init_pieces import Region, covers

    gen = torch.Generator().manual_seed(0)
    decided = 0
    for trial in range(200):
        shape = tuple(int(s) for s in torch.randint(1, 5, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                                    generator=gen))
        full = torch.empty(shape)
        views = []
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
            v = full
            for d, size in enumerate(shape):
                a = int(torch.randint(0, size, (1,), generator=gen))
                b = int(torch.randint(a + 1, size + 1, (1,), generator=gen))
                v = v.narrow(d, a, b - a) if d < v.dim() else v
            if trial % 7 == 0 and v.dim() >= 2:
                v = v.transpose(0, 1)
            views.append(v)
        regions = [Region(v.storage_offset(), tuple(v.shape), tuple(v.stride()), full.numel()) for v in views]
        touched = torch.zeros(full.numel(), dtype=torch.bool)
        for v in views:
            idx = torch.arange(full.numel()).view(shape).as_strided(v.shape, v.stride(), v.storage_offset())
            touched[idx.reshape(-1)] = True
        got = covers(regions, shape)
        if got is not None:
            decided += 1
            assert got == bool(touched.all()), (shape, regions)
        for v, r in zip(views, regions):
            box = r.box(shape)
            if box is not None:
                idx = torch.arange(full.numel()).view(shape)[tuple(slice(a, b) for a, b in box)]
                want = torch.arange(full.numel()).view(shape).as_strided(v.shape, v.stride(), v.storage_offset())
                assert sorted(idx.reshape(-1).tolist()) == sorted(want.reshape(-1).tolist())
    assert decided > 150


@pytest.mark.parametrize("kind", ["llama", "hf-llama"])
def test_superseded_draws_are_not_computed_and_change_no_bit(kind: str) -> None:
    """The package's Llama draws every weight three times (nn.Linear's kaiming-uniform, Attention.reset_parameters,
    init_weights): only the last draw is computed, and the values are those of replaying every step."""
    evaluated: list[list[str]] = []
    original = mat.evaluate

    def counting(steps: Any, positions: torch.Tensor, values: torch.Tensor) -> None:
        evaluated.append([s.kind for s in steps])
        original(steps, positions, values)

    def build() -> nn.Module:
        torch.manual_seed(0)
        with torch.device("meta"):
            return CausalLM(build_model(kind))

    pruned = build()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mat, "evaluate", counting)
        report = materialize_local_shards(meta_skeleton(pruned), pruned, torch.device("cpu"))
    every = build()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mat, "live_steps", list)  # no pruning: every recorded step replayed
        full = materialize_local_shards(meta_skeleton(every), every, torch.device("cpu"))
    assert full.superseded_steps == 0 < report.superseded_steps
    a, b = _states(pruned), _states(every)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    draws = ("uniform", "normal", "trunc_normal")
    assert max(sum(kind in draws for kind in kinds) for kinds in evaluated) == 1  # one draw per tensor
    if kind == "llama":
        assert report.superseded_steps >= 2 * sum(isinstance(m, nn.Linear) for m in pruned.modules())
