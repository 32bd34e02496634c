"""The pure rules of ``compile`` and ``float8``: options refused early by name, which linears Float8 converts, the plan
recording both, and a block whose graph breaks falling back to a compile without ``fullgraph`` on its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_4d.config import FourDConfig
from lightning_4d.layout.derive_plan import plan_layout
from lightning_4d.mesh import ParallelDims
from lightning_4d.models import CausalLM, Llama, LlamaConfig
from lightning_4d.models.moe import MoEConfig, MoETransformer
from lightning_4d.plan import LayoutPlan
from lightning_4d.speed.compile import apply_compile, compile_backend, compiled_mode
from lightning_4d.speed.float8 import EXPERTS_NOTE, check_float8, float8_linear_names


@pytest.fixture
def torchao_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules are pure: they run whether or not torchao is installed (only applying Float8 needs it)."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else find(name, *a))


def _llama(dim: int = 32, vocab: int = 64) -> CausalLM:
    return CausalLM(Llama(LlamaConfig(vocab_size=vocab, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                      max_seq_len=16)))


@pytest.mark.parametrize("options, needles", [
    (dict(compile="no-such-backend"), ["compile='no-such-backend'", "not a torch.compile backend", "True (Inductor)"]),
    (dict(compile=3), ["compile=3", "True (Inductor), False, or a torch.compile backend"]),
    (dict(float8=False, float8_recipe="blockwise"), ["float8_recipe='blockwise'", "'tensorwise'", "'rowwise'"]),
    (dict(float8="yes"), ["float8='yes' must be True or False"]),
    (dict(compile=True, tp=2), ["compile=True (Inductor) with tp=2", "compile='aot_eager'"]),
])
def test_bad_options_are_refused_by_name(options: dict, needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        FourDConfig(**options)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_compile_values() -> None:
    assert compile_backend(True) == "inductor" and compile_backend(False) is None
    assert FourDConfig(compile="aot_eager", pp=2, schedule="zbv").compile == "aot_eager"  # every schedule runs


def test_missing_torchao_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"float8=True needs torchao.*lightning-4d\[float8\]"):
        check_float8(True, "tensorwise")


def test_float8_rule_skips_the_head_and_odd_sizes(torchao_present: None) -> None:
    lm = _llama(vocab=64)
    plan = plan_layout(lm, ParallelDims(world_size=1), FourDConfig(float8=True))
    names = plan.float8_linears
    assert names and all(n.startswith("model.layers.") for n in names)  # the head (model.output) is not converted
    assert "model.output" in {n for n, m in lm.named_modules() if isinstance(m, nn.Linear)}
    assert plan.float8 == "tensorwise" and plan.float8_experts == ""
    # both dimensions divisible by 16: a 24-wide model keeps the projections whose sizes are not
    odd = float8_linear_names(nn.ModuleDict({"a": nn.Linear(24, 32), "b": nn.Linear(32, 24), "c": nn.Linear(32, 48)}))
    assert odd == ("c",)


def test_float8_rule_keeps_moe_experts_and_router(torchao_present: None) -> None:
    moe = CausalLM(MoETransformer(MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                            ffn_hidden=32, max_seq_len=16, num_experts=16, top_k=2,
                                            expert_hidden=32, shared_experts=1)))
    plan = plan_layout(moe, ParallelDims(world_size=1), FourDConfig(float8=True))
    experts = [e.experts_path for e in plan.experts]
    assert experts and not any(n.startswith(tuple(experts)) for n in plan.float8_linears)
    assert not any("router" in n or "gate" == n.rsplit(".", 1)[-1] for n in plan.float8_linears)
    assert plan.float8_experts == EXPERTS_NOTE
    assert "float8 experts: experts kept in the trainer's precision" in str(plan)


def test_plan_records_compile_and_float8(torchao_present: None) -> None:
    lm = _llama()
    plan = plan_layout(lm, ParallelDims(world_size=1), FourDConfig(compile="aot_eager", float8=True,
                                                                   float8_recipe="rowwise"))
    assert plan.compile == "aot_eager" and plan.float8 == "rowwise"
    assert LayoutPlan.from_json(plan.to_json()) == plan
    text = str(plan)
    assert "compile: each block, torch.compile(backend='aot_eager'" in text and "Float8Linear(rowwise)" in text
    with pytest.raises(ValueError, match=r"it was made for compile='aot_eager' but this run's options say "
                                         r"compile='none'"):
        plan.check_options(FourDConfig(float8=True, float8_recipe="rowwise"), ParallelDims(world_size=1))
    eager = plan_layout(lm, ParallelDims(world_size=1), FourDConfig())
    assert eager.compile == "none" and eager.float8 == "none" and eager.float8_linears == ()


@torch.compiler.disable
def _eager_step(y: torch.Tensor) -> torch.Tensor:  # run outside the graph: a graph break
    return y + 1


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(_eager_step(self.w(x)))


class _Whole(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.w(x))


def test_a_graph_break_falls_back_per_block() -> None:
    torch.manual_seed(0)
    broken, whole = _Breaks(), _Whole()
    x = torch.randn(2, 4)
    expected = (broken(x), whole(x))
    assert apply_compile([broken, whole], "eager") == 2
    got = (broken(x), whole(x))
    assert compiled_mode(broken) == "graph breaks" and compiled_mode(whole) == "fullgraph"
    assert all(torch.allclose(a, b) for a, b in zip(got, expected))
    assert [n for n, _ in broken.named_parameters()] == ["w.weight", "w.bias"]  # names unchanged
