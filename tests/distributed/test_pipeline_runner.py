"""Pipeline parity: every torch schedule, pp=2 and pp=4, against a single-process reference (fp32).

One gloo world per world size runs all layouts; each builds the same seeded full model, splits
it, trains 5 AdamW steps with ignore_index targets (a different number of valid tokens per
micro-batch, one micro-batch fully ignored) and compares losses, final gradients and eval outputs.
The 4-rank world also runs two independent pp=2 pipelines (pp × dp = 2 × 2 mesh) to exercise
group-relative ranks of a pp sub-group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_4d.mesh import ParallelDims, build_mesh
from lightning_4d.pipeline import PipelineRunner, build_pipeline_stages, get_schedule_info
from lightning_4d.testing import run_world
from tests.distributed.pipeline_models import BATCH, batch, build, loss_fn

STEPS = 5
# (pp, schedule, stages per rank, micro-batches, tied embedding/head, loss returns "mean" or "sum")
LAYOUTS = {
    2: [(2, "gpipe", 1, 4, False, "mean"), (2, "1f1b", 1, 4, False, "sum"), (2, "1f1b", 1, 8, True, "mean"),
        (2, "interleaved_1f1b", 2, 4, False, "mean"), (2, "interleaved_1f1b", 3, 2, True, "mean"),
        (2, "zbv", 2, 4, False, "mean"), (2, "zbv", 2, 4, True, "sum"), (2, "dualpipev", 2, 4, False, "mean"),
        (2, "looped_bfs", 2, 4, False, "mean"), (2, "interleaved_zb", 2, 4, False, "mean")],
    4: [(4, "gpipe", 1, 4, False, "mean"), (4, "1f1b", 1, 4, True, "mean"), (4, "interleaved_1f1b", 2, 4, False, "sum"),
        (4, "zbv", 2, 8, False, "mean"), (4, "dualpipev", 2, 8, False, "mean"),
        (4, "interleaved_zb", 2, 4, True, "mean"),
        (2, "1f1b", 1, 4, True, "mean"), (2, "zbv", 2, 4, False, "mean")],
}


def sum_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, valid tokens)`` form of :func:`loss_fn`."""
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


def _reference(tie: bool) -> dict[str, Any]:
    model = build(tie=tie)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = batch(step)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        opt.zero_grad()
    x, y = batch(STEPS)
    with torch.no_grad():
        out = model(x)
    return {"losses": losses, "grads": grads, "eval": out, "eval_loss": float(loss_fn(out, y))}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _run_layout(group: Any, layout: tuple, ref: dict[str, Any]) -> dict[str, Any]:
    pp, name, v, m, tie, mode = layout
    info = get_schedule_info(name)
    model = build(tie=tie)
    parts = build_pipeline_stages(model, group.get_local_rank(), pp, v, info.style)  # group: 1-D DeviceMesh
    runner = PipelineRunner(parts.modules, group, sum_loss_fn if mode == "sum" else loss_fn, schedule=name,
                            microbatches=m, model=parts.model, tied=parts.tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    worst: dict[str, Any] = {"loss": 0.0, "grad": 0.0}
    for step in range(STEPS):
        x, y = batch(step)
        loss = runner.train_step(x, y)
        worst["loss"] = max(worst["loss"], abs(float(loss) - ref["losses"][step]) / abs(ref["losses"][step]))
        if step == STEPS - 1:
            for n, p in model.named_parameters():
                worst["grad"] = max(worst["grad"], _rel(p.grad, ref["grads"][n]))
        opt.step()
        opt.zero_grad()
    x, y = batch(STEPS)
    with torch.no_grad():
        out, eval_loss = runner.eval_step(x, y)
        pred, none_loss = runner.eval_step(x)
    worst["eval"] = max(_rel(out, ref["eval"]), _rel(pred, ref["eval"]))
    worst["eval_loss"] = abs(float(eval_loss) - ref["eval_loss"]) / ref["eval_loss"]
    worst["none_loss"] = none_loss is None
    # Training after eval (mode switch) works; grad_scale scales the gradients, not the returned loss.
    full = runner.train_step(x, y)
    grads = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    half = runner.train_step(x, y, grad_scale=0.5)
    worst["grad_scale"] = max(_rel(2 * p.grad, g) for p, g in zip(model.parameters(), grads))
    worst["scaled_loss"] = abs(float(half) - float(full))
    # A batch that does not split into micro-batches fails on every rank with a clear message.
    try:
        runner.train_step(*batch(0, size=BATCH + 1))
        worst["batch_error"] = "no error"
    except ValueError as err:
        worst["batch_error"] = str(err)
    worst["params"] = sum(p.numel() for p in model.parameters())
    return worst


def _world(rank: int, world: int, layouts: list[tuple]) -> dict[str, Any]:
    refs = {tie: _reference(tie) for tie in (False, True)}
    groups = {pp: build_mesh(ParallelDims.from_world(world, pp=pp), "cpu")["pp"] for pp in {lay[0] for lay in layouts}}
    return {str(layout): _run_layout(groups[layout[0]], layout, refs[layout[4]]) for layout in layouts}


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_parity(world: int) -> None:
    results = run_world(_world, world, world, LAYOUTS[world], timeout_s=300)
    for layout in LAYOUTS[world]:
        pp, name, _, _, tie, _ = layout
        per_rank = [r[str(layout)] for r in results]
        for rank, got in enumerate(per_rank):
            label = f"{layout} rank {rank}"
            for key in ("loss", "grad", "eval", "eval_loss", "grad_scale"):
                assert got[key] < 1e-5, f"{label}: {key} rel diff {got[key]:.2e}"
            assert got["scaled_loss"] < 1e-6 and got["none_loss"], label
            assert "does not divide the local batch size 9" in got["batch_error"], got["batch_error"]
        # Each pipeline holds the model once, plus a second copy of a tied embedding/head when stage 0
        # and the last stage are on different ranks ("loop" placement).
        reference = build(tie=tie)
        full = sum(p.numel() for p in reference.parameters())
        two_owners = tie and get_schedule_info(name).style == "loop"
        held = sum(r["params"] for r in per_rank) * pp // world
        assert held == full + (reference.head.weight.numel() if two_owners else 0)
