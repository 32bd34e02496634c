"""Expert parallel through the Lightning strategy: the package's MoE transformer and a Mixtral-style user
model, ep ∈ {2, 4}, with TP+SP, TP without SP (ep=1), and DP (FSDP2 / replicate); aux loss and the
aux-loss-free bias update against one process."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_4d.testing import run_world
from tests.distributed.common import assert_parity, fit_spec, world_fit

BASE: dict[str, Any] = dict(steps=5, accumulate=2, clip=0.05, predict=True)
CASES = {
    "moe": BASE,
    "mixtral": BASE,
    # Aux-loss gradients are injected per micro-batch: compared without accumulation. The balancing terms
    # push router scores towards ties, where a top-k choice can flip under fp32 round-off of a different
    # (TP) summation order; after two steps the runs are still on the same routing path.
    "moe-aux": dict(BASE, accumulate=1, steps=2),
    "moe-bias": dict(BASE, accumulate=1, steps=2, buffers=True),
}
LAYOUTS = {
    2: [dict(ep=2), dict(tp=2, ep=2), dict(tp=2), dict(tp=2, sequence_parallel=False)],
    4: [dict(ep=4), dict(ep=2), dict(ep=2, data_parallel="replicate"), dict(tp=2, ep=2), dict(tp=2, ep=4)],
}


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return {m: fit_spec(dict(spec, model=m)) for m, spec in CASES.items()}


def _specs(world: int) -> list[dict[str, Any]]:
    specs = []
    for layout in LAYOUTS[world]:
        for model in ("moe", "mixtral"):
            specs.append(dict(CASES[model], model=model, world=world, strategy=layout))
    # aux loss and bias update on the richest layout of the world
    for model in ("moe-aux", "moe-bias"):
        specs.append(dict(CASES[model], model=model, world=world, strategy=LAYOUTS[world][1]))
    return specs


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_parity(world: int, references: dict[str, Any]) -> None:
    specs = _specs(world)
    results = run_world(world_fit, world, specs, timeout_s=900)
    for spec, got in zip(specs, results[0]):
        assert_parity(got, references[spec["model"]], label=f"{spec['model']} {spec['strategy']}")


def test_expert_gradient_scale_without_clipping() -> None:
    spec = dict(model="moe", steps=1, clip=None)
    ref = fit_spec(spec)
    specs = [dict(spec, world=4, strategy=s) for s in (dict(ep=4), dict(tp=2, ep=2), dict(tp=2, ep=4))]
    for got, s in zip(run_world(world_fit, 4, specs)[0], specs):
        assert_parity(got, ref, label=f"unclipped {s['strategy']}")


def _no_moe(rank: int) -> None:
    fit_spec(dict(model="llama", steps=1, world=2, strategy=dict(ep=2)))


def _bad_experts(rank: int) -> None:
    fit_spec(dict(model="moe", steps=1, world=8, strategy=dict(ep=8)))


def test_invalid_expert_layouts_fail_on_every_rank() -> None:
    for res in run_world(_no_moe, 2, raise_on_error=False, pg_timeout_s=20):
        assert "ep=2 but CausalLM has no mixture-of-experts layer" in res["error"]
    for res in run_world(_bad_experts, 8, raise_on_error=False, pg_timeout_s=20):
        assert "num_experts=4 is not divisible by ep=8" in res["error"]
