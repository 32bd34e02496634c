"""``str(plan)`` of seven families, against golden files a person read (``tests/unit/golden/plans/``): one line per
module, TorchTitan-style. Regenerate after an intended change with ``L4D_UPDATE_GOLDEN=1 pytest <this file>`` and
read the diff. Plans are derived on the meta device, without a process group; the JSON form round-trips."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from lightning_4d.config import FourDConfig
from lightning_4d.layout.derive_plan import plan_layout
from lightning_4d.plan import LayoutPlan

GOLDEN = Path(__file__).parent / "golden" / "plans"


def _package(kind: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from tests.distributed.common import build_model

        return build_model(kind)
    return build


def _byom(kind: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from tests.distributed.byom_models import build_byom

        return build_byom(kind)
    return build


def _zoo(kind: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        pytest.importorskip("torchtitan.models.llama3") if kind.startswith("tt-") else None
        from tests.distributed.byom_zoo import build_zoo

        return build_zoo(kind)
    return build


# family -> (builder, layout): dense and MoE, pipeline and experts, a sliding-window family, a TorchTitan model
CASES: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "llama": (_package("llama"), dict(tp=2, pp=2)),
    "gpt2": (_package("gpt2"), dict(tp=2)),
    "hf-llama": (_byom("hf-llama"), dict(tp=2, pp=2)),
    "hf-gpt2": (_byom("hf-gpt2"), dict(tp=2)),  # fused q|k|v in Conv1D: rows permuted per rank
    "hf-qwen3moe": (_byom("hf-qwen3moe"), dict(tp=2, ep=2)),
    "tt-llama3": (_zoo("tt-llama3"), dict(tp=2)),
    "hf-gemma2": (_zoo("hf-gemma2"), dict(tp=2, sequence_parallel=False)),
}


def _plan(family: str) -> LayoutPlan:
    build, layout = CASES[family]
    with torch.device("meta"):
        model = build()
    config = FourDConfig(**layout)
    return plan_layout(model, config.resolve(4), config)


@pytest.mark.parametrize("family", sorted(CASES))
def test_plan_text_matches_its_golden_file(family: str) -> None:
    plan = _plan(family)
    text = str(plan) + "\n"
    path = GOLDEN / f"{family}.txt"
    if os.environ.get("L4D_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{family}: str(plan) changed; if intended, regenerate (see the module doc)"
    # one line per decision: every quoted line names one module path
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    assert lines and all(ln.count('"') == 2 for ln in lines)
    assert LayoutPlan.from_json(plan.to_json()) == plan


def test_a_plan_for_another_mesh_is_refused_naming_the_degree() -> None:
    plan = _plan("gpt2")
    with torch.device("meta"):
        model = CASES["gpt2"][0]()
    with pytest.raises(ValueError, match=r"made for tp=2 but this run has tp=4"):
        plan.check(model, FourDConfig(tp=4).resolve(4))


def test_an_edited_plan_naming_a_missing_module_or_style_is_refused() -> None:
    from lightning_4d.tensor_parallel.specs import StyleSpec

    plan = _plan("gpt2")
    with torch.device("meta"):
        model = CASES["gpt2"][0]()
    dims = FourDConfig(tp=2).resolve(4)
    assert plan.tensor_parallel is not None
    typo = plan.replace(tensor_parallel=plan.tensor_parallel)
    typo.tensor_parallel.styles = {**plan.tensor_parallel.styles, "h.0.atn.c_attn": StyleSpec("Colwise")}
    with pytest.raises(ValueError, match=r"'h.0.atn.c_attn' .* is not a module of"):
        typo.check(model, dims)
    bad = LayoutPlan.from_json(plan.to_json())
    assert bad.tensor_parallel is not None
    name = next(iter(bad.tensor_parallel.styles))
    bad.tensor_parallel.styles[name] = StyleSpec("Diagonal")
    with pytest.raises(ValueError, match="style 'Diagonal' is unknown"):
        bad.check(model, dims)


def test_stages_out_of_order_or_of_another_count_are_refused() -> None:
    with torch.device("meta"):
        model = CASES["llama"][0]()
    config = FourDConfig(tp=2, pp=2)
    dims = config.resolve(4)
    plan = plan_layout(model, dims, config)
    with pytest.raises(ValueError, match="must hold every block .* once, in order"):
        plan.replace(stages=(plan.block_order[1:], plan.block_order[:1])).check(model, dims)
    with pytest.raises(ValueError, match=r"1 stages, but pp·virtual_stages = 2"):
        plan.replace(stages=(plan.block_order,)).check(model, dims)
