"""PipelineBubbleMonitor on the real torch schedules with deterministic stage costs (fixed sleeps),
and the point-to-point traffic the CommunicationMonitor's recorder sees in a pipeline step.

Each stage is one block whose forward, input-gradient and weight-gradient passes sleep a fixed time
(``F = I = W = t``, so a full backward is ``B = 2t``); sleeping ranks do not compete for the CPU, so
the measured shares are close to the schedule's ideal. The measured bubble comes only from the
instrumented schedule step; the expected values are the closed forms (uniform) or a hand-computed
makespan (non-uniform).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.testing import run_world

P, DIM, BATCH = 4, 8, 16
T = 0.05  # seconds per F, I and W of a normal stage


class _SleepOnInput(torch.autograd.Function):
    """Identity that sleeps ``f`` in forward and ``i`` in the input-gradient pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, i: float) -> torch.Tensor:
        ctx.i = i
        time.sleep(f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.i)
        return grad, None, None


class _SleepOnWeight(torch.autograd.Function):
    """Identity on a parameter that sleeps ``w`` in its gradient (the weight-gradient pass)."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, w: float) -> torch.Tensor:
        ctx.w = w
        return p.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.w)
        return grad, None


class SleepStage(nn.Module):
    """One pipeline stage ``x ↦ (x + shift) · scale`` costing ``cost · unit`` seconds in each of F, I and W.

    ``shift`` makes the input path need a gradient on the first stage too (its batch input does not),
    so every stage's backward runs the input-path sleep.
    """

    def __init__(self, cost: float, unit: float = T) -> None:
        super().__init__()
        self.t = cost * unit
        self.shift = nn.Parameter(torch.zeros(DIM))
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _SleepOnInput.apply(x + self.shift, self.t, self.t)
        return h * _SleepOnWeight.apply(self.scale, self.t)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _runner(rank: int, schedule: str, m: int, slow_stage: int = -1) -> Any:
    import torch.distributed as dist

    from lightning_4d.pipeline import PipelineRunner, get_schedule_info, stage_ids_for_rank

    info = get_schedule_info(schedule)
    v = 2 if info.multi_stage else 1
    ids = stage_ids_for_rank(rank, P, v, info.style)
    modules = [SleepStage(3.0 if s == slow_stage else 1.0) for s in ids]
    return PipelineRunner(modules, dist.group.WORLD, _loss, schedule=schedule, microbatches=m, stage_ids=ids,
                          num_stages=P * v)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)


def _measure(rank: int, cases: list[tuple[str, int, int]]) -> dict[str, Any]:
    """Per case: instrumented steps (the first skipped: shape inference), stats from the gathered events."""
    import torch.distributed as dist

    from lightning_4d.callbacks.pipeline import bubble_stats
    from lightning_4d.pipeline.instrument import PipelineInstrument

    out: dict[str, Any] = {}
    x, y = _batch()
    for schedule, m, slow in cases:
        runner = _runner(rank, schedule, m, slow)
        inst = PipelineInstrument.attach_to(runner)
        for step in range(3):
            dist.barrier()
            if step == 1:
                inst.clear()
            runner.train_step(x, y)
        stats = bubble_stats(inst.gather())
        inst.detach()
        out[f"{schedule}/{m}/{slow}"] = stats
    return out


def _bubble_failures(got: dict[str, Any]) -> list[str]:
    """What is out of tolerance in one measurement (empty: all good)."""
    from lightning_4d.pipeline import bubble_theory

    failures = []

    def near(name: str, value: float, expected: float, rel: float = 0.10) -> None:
        if abs(value - expected) > rel * abs(expected):
            failures.append(f"{name}: measured {value:.4f}, expected {expected:.4f} ± {rel:.0%}")

    for m in (4, 8):
        near(f"1F1B m={m}", got[f"1f1b/{m}/-1"].overall, bubble_theory("1f1b", P, m))  # (p − 1)/(m + p − 1)
    # Zero bubble V: the weight-gradient passes fill the warm-up and cool-down gaps.
    if not got["zbv/8/-1"].overall < 0.5 * got["1f1b/8/-1"].overall:
        failures.append(f"ZBV {got['zbv/8/-1'].overall:.4f} not below half of 1F1B {got['1f1b/8/-1'].overall:.4f}")
    # Last stage 3× slower (F = I = W = 3t there, t elsewhere), 1F1B, m = 4, in units of t:
    # the slow stage receives micro-batch 0 after 3 fast forwards (3), then runs F + B = 9 per
    # micro-batch back to back (4 · 9 = 36), then the last gradient drains through 3 fast stages
    # (3 · 2 = 6): makespan 45. Busy: 4 · 3 = 12 on each fast rank, 36 on the slow one.
    slow = got[f"1f1b/4/{P - 1}"]
    makespan, fast_busy, slow_busy = 45.0, 12.0, 36.0
    expected_fast, expected_slow = 1 - fast_busy / makespan, 1 - slow_busy / makespan  # 0.733, 0.2
    near("non-uniform overall", slow.overall, (3 * expected_fast + expected_slow) / 4)  # 0.6
    near("non-uniform makespan", slow.makespan, makespan * T)
    for stage in range(P - 1):
        near(f"non-uniform stage {stage}", slow.per_stage[stage], expected_fast)
    near(f"non-uniform stage {P - 1}", slow.per_stage[P - 1], expected_slow, rel=0.25)  # small value: ±0.05
    return failures


def test_measured_bubble_matches_the_schedules() -> None:
    cases = [("1f1b", 4, -1), ("1f1b", 8, -1), ("zbv", 8, -1), ("1f1b", 4, P - 1)]
    failures = _bubble_failures(run_world(_measure, P, cases, timeout_s=300)[0])
    if failures:  # wall-clock timing: other processes on the machine can delay a rank; measure once more
        failures = _bubble_failures(run_world(_measure, P, cases, timeout_s=300)[0])
    assert not failures, failures


class _Module:
    """Stands in for the LightningModule: collects what the monitor logs."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log_dict(self, metrics: dict[str, float], **kwargs: Any) -> None:
        self.logged.update(metrics)


def _monitor_glue(rank: int, outdir: str) -> dict[str, Any]:
    """The Lightning hooks of the monitor around real schedule steps (FourDStrategy-shaped trainer)."""
    import torch.distributed as dist

    from lightning_4d.callbacks import PipelineBubbleMonitor
    from lightning_4d.config import FourDConfig
    from lightning_4d.mesh import ParallelDims, build_mesh

    runner = _runner(rank, "1f1b", 8)
    mesh = build_mesh(ParallelDims.from_world(P, pp=P), "cpu")
    strategy = SimpleNamespace(mesh=mesh, plan=SimpleNamespace(pipeline=runner), config=FourDConfig(pp=P))
    trainer = SimpleNamespace(strategy=strategy, log_every_n_steps=1, log_dir=outdir, default_root_dir=outdir)
    module = _Module()
    monitor = PipelineBubbleMonitor(trace_every_n_steps=2)
    monitor.setup(trainer, module, "fit")
    monitor.on_train_start(trainer, module)
    x, y = _batch()
    for step in range(5):
        dist.barrier()
        monitor.on_train_batch_start(trainer, module, (x, y), step)
        runner.train_step(x, y)
        monitor.on_train_batch_end(trainer, module, None, (x, y), step)
    monitor.on_train_end(trainer, module)
    return {"logged": module.logged, "written": monitor.written,
            "restored": all("forward_one_chunk" not in vars(s) for s in runner.stages)}


def test_monitor_hooks_log_and_write_trace_and_timeline(tmp_path: Any) -> None:
    from lightning_4d.pipeline import bubble_theory

    results = run_world(_monitor_glue, P, str(tmp_path), timeout_s=300)
    logged = results[0]["logged"]
    assert all(r["logged"] == logged for r in results)  # already global: identical on every rank
    theory = bubble_theory("1f1b", P, 8)
    assert logged["pp/bubble_fraction_theory"] == pytest.approx(theory)
    assert logged["pp/bubble_fraction"] == pytest.approx(theory, rel=0.10)
    for i in range(P):
        assert 0.0 < logged[f"pp/bubble_fraction_stage{i}"] < 0.5
        assert f"pp/bubble_fraction_rank{i}" in logged
    assert all(r["restored"] for r in results)
    # Batches 1..4 are recorded (batch 0 runs shape inference); traces every 2 batches: 2 and 4.
    written = results[0]["written"]
    assert [os.path.basename(p) for p in written] == [
        "pipeline_step2.json", "pipeline_step2.png", "pipeline_step4.json", "pipeline_step4.png"]
    assert all(r["written"] == [] for r in results[1:])
    with open(written[0]) as fh:
        trace = json.load(fh)
    actions = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] != "idle"]
    assert len(actions) == P * 8 * 2  # one event per executed F and B on every stage
    assert {e["name"] for e in actions} == {"F", "B"}
    assert {e["pid"] for e in actions} == set(range(P))
    idle = [e for e in trace["traceEvents"] if e["name"] == "idle"]
    span = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X")
    busy = sum(e["dur"] for e in actions)
    assert sum(e["dur"] for e in idle) == pytest.approx(P * span - busy, rel=1e-6)
    assert trace["otherData"]["schedule"] == "1f1b"
    import matplotlib.image as mpl
    img = mpl.imread(written[1])
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 200


def _p2p_counts(rank: int, m: int) -> dict[str, Any]:
    """Point-to-point traffic of one 1F1B step seen by the CommunicationMonitor's recorder."""
    import torch.distributed as dist

    from lightning_4d.callbacks import CommRecorder
    from lightning_4d.callbacks.communication import axis_groups
    from lightning_4d.mesh import ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims.from_world(P, pp=P), "cpu")
    pp_group = mesh["pp"].get_group()
    from lightning_4d.pipeline import PipelineRunner

    runner = PipelineRunner([SleepStage(0.0)], pp_group, _loss, schedule="1f1b", microbatches=m, stage_ids=[rank],
                            num_stages=P)
    x, y = _batch()
    runner.train_step(x, y)  # shape inference
    with CommRecorder(axis_groups(mesh)) as rec:
        runner.train_step(x, y)
    dist.barrier()
    return {k: v for k, v in rec.totals().items()}


def test_pipeline_point_to_point_is_counted_per_microbatch_and_boundary() -> None:
    m = 4
    results = run_world(_p2p_counts, P, m)
    act = BATCH // m * DIM * 4  # one micro-batch activation (fp32) crosses a boundary
    for rank, totals in enumerate(results):
        has_next, has_prev = rank < P - 1, rank > 0
        # Forward: an activation to the next stage per micro-batch; backward: its gradient to the previous one.
        sends = m * (int(has_next) + int(has_prev))
        recvs = m * (int(has_prev) + int(has_next))
        assert totals[("pp", "send")] == pytest.approx({"count": sends, "bytes": sends * act,
                                                        "seconds": totals[("pp", "send")]["seconds"]})
        assert totals[("pp", "recv")]["count"] == recvs and totals[("pp", "recv")]["bytes"] == recvs * act
        # The loss broadcast from the last stage is the only other collective.
        assert set(totals) <= {("pp", "send"), ("pp", "recv"), ("pp", "broadcast")}
    # One send and one receive per micro-batch per boundary each way.
    assert sum(r[("pp", "send")]["count"] for r in results) == 2 * m * (P - 1)
