"""Learning-rate schedules: warm-up then constant / cosine / linear decay to a floor, checked against the formulas
written out here (not against the module's output), through a real ``LambdaLR`` + AdamW, and the rules' errors."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_4d.models.lr_schedule import SCHEDULES, WarmupDecay, check_schedule, lr_factor
from lightning_4d.recipes.schema import OptimConfig, RecipeConfigError

W, D, R = 4, 12, 0.2  # warm-up steps, decay horizon, floor ratio


def test_warmup_is_linear_from_one_step() -> None:
    for schedule in SCHEDULES:
        assert [lr_factor(s, schedule, W, D, R) for s in range(W)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_values() -> None:
    # p = (s - 4) / 8: s=4 -> p=0 (peak), s=6 -> p=1/4, s=8 -> p=1/2, s=12 -> p=1 (floor), beyond: floor.
    assert lr_factor(4, "cosine", W, D, R) == 1.0
    assert lr_factor(6, "cosine", W, D, R) == pytest.approx(0.2 + 0.8 * (1 + math.sqrt(0.5)) / 2)
    assert lr_factor(8, "cosine", W, D, R) == pytest.approx(0.6)
    assert lr_factor(12, "cosine", W, D, R) == pytest.approx(0.2)
    assert lr_factor(100, "cosine", W, D, R) == pytest.approx(0.2)


def test_linear_values() -> None:
    assert lr_factor(4, "linear", W, D, R) == 1.0
    assert lr_factor(8, "linear", W, D, R) == pytest.approx(0.6)   # halfway: 0.2 + 0.8 / 2
    assert lr_factor(10, "linear", W, D, R) == pytest.approx(0.4)  # three quarters: 0.2 + 0.8 / 4
    assert lr_factor(12, "linear", W, D, R) == pytest.approx(0.2)
    assert lr_factor(0, "linear", 0, 10, 0.0) == 1.0 and lr_factor(10, "linear", 0, 10, 0.0) == 0.0


def test_constant_after_warmup() -> None:
    assert {lr_factor(s, "constant", W, D, R) for s in range(W - 1, 50)} == {1.0}


def test_lambda_lr_applies_the_factor_every_optimizer_step() -> None:
    """The LR the optimizer uses at step k (after k scheduler steps) is lr · factor(k)."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupDecay("cosine", W, D, R))
    seen = []
    for _ in range(14):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [0.01 * (s + 1) / W if s < W else
                0.01 * (R + (1 - R) * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - W) / (D - W))))) for s in range(14)]
    assert seen == pytest.approx(expected)
    assert "lr_lambdas" in sched.state_dict()  # a class, not a closure: kept with the checkpoint


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="step"), r"optim\.schedule='step' is not one of constant, cosine, linear"),
    (dict(schedule="cosine", warmup_steps=10, decay_steps=10),
     r"optim\.decay_steps=10 must exceed optim\.warmup_steps"),
    (dict(min_lr_ratio=1.5), r"optim\.min_lr_ratio=1\.5 must be in \[0, 1\]"),
    (dict(decay_steps=0), r"optim\.decay_steps=0 must be a positive integer"),
])
def test_recipe_rules_name_the_key(kwargs: dict, match: str) -> None:
    with pytest.raises(RecipeConfigError, match=match):
        OptimConfig(**kwargs)


def test_package_rule_without_prefix() -> None:
    with pytest.raises(ValueError, match=r"^warmup_steps=-1 must be an integer >= 0"):
        check_schedule("constant", -1, None, 0.1)


def test_causal_lm_without_a_trainer() -> None:
    """A decay whose horizon is the run's length needs the Trainer; detached (the planner's dry run) the optimizer
    alone comes back; a given decay_steps gives the schedule at once."""
    from lightning_4d.models import CausalLM

    net = torch.nn.Sequential(torch.nn.Embedding(8, 8))
    assert isinstance(CausalLM(net, schedule="cosine", warmup_steps=2).configure_optimizers(), torch.optim.AdamW)
    out = CausalLM(net, lr=0.01, schedule="linear", warmup_steps=0, decay_steps=4,
                   min_lr_ratio=0.0).configure_optimizers()
    sched = out["lr_scheduler"]["scheduler"]
    assert out["lr_scheduler"]["interval"] == "step" and out["lr_scheduler"]["name"] == "lr"
    for _ in range(2):
        out["optimizer"].step()
        sched.step()
    assert out["optimizer"].param_groups[0]["lr"] == pytest.approx(0.005)  # halfway down to 0
    with pytest.raises(ValueError, match=r"schedule='exp' is not one of"):
        CausalLM(net, schedule="exp")
