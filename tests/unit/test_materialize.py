"""Materialising a meta-built model tensor by tensor (single process): values equal the whole-model
materialisation for the same seed, memory is bounded by the initialiser calls, uninitialised tensors are named."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_4d import materialize as mat
from lightning_4d._compat import init_calls, materialize_meta_module
from lightning_4d.materialize import UninitializedError, materialize_local_shards, meta_skeleton
from lightning_4d.models import CausalLM
from lightning_4d.reduced_check import perturb_, reduce_depth, reduce_vocabulary
from tests.distributed.common import build_model


def _states(module: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters())
    out.update(dict(module.named_buffers()))
    return out


def _both(build: Any, seed: int = 0) -> tuple[nn.Module, nn.Module, mat.MaterializeReport]:
    """(whole-model reference, tensor-by-tensor result, its report), both from the same seed."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        ref = build()
    materialize_meta_module(ref, torch.device("cpu"))
    torch.manual_seed(seed)
    with torch.device("meta"):
        got = build()
    report = materialize_local_shards(meta_skeleton(got), got, torch.device("cpu"))
    return ref, got, report


@pytest.mark.parametrize("kind", ["llama", "gpt2", "hf", "moe", "hf-llama", "hf-gpt2"])
@pytest.mark.parametrize("budget", [0, 64 << 20])  # 0: every tensor is released as soon as nothing holds it
def test_values_equal_whole_model_materialisation(kind: str, budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mat, "_MIN_BUDGET", budget)
    ref, got, report = _both(lambda: CausalLM(build_model(kind)))
    a, b = _states(ref), _states(got)
    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
    assert report.tensors == len({id(t) for t in a.values()})
    if budget == 0:
        # Released one by one: the largest call never held the whole model.
        largest = max(t.numel() * t.element_size() for t in a.values())
        whole = sum(t.numel() * t.element_size() for t in {id(t): t for t in a.values()}.values())
        assert report.largest_call_bytes < whole / 2, (report.largest_call, report.largest_call_bytes, whole)
        assert report.largest_call_bytes >= largest


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
    assert float(weight[2].abs().sum()) == 0.0 and float(weight.abs().sum()) > 0


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
