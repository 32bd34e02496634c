"""PipelineBubbleMonitor on the real torch schedules, and the point-to-point traffic the
CommunicationMonitor's recorder sees in a pipeline step.

Nothing here depends on wall time: the recorded actions of a real step, replayed in their recorded
order under the cost model, must give the closed-form bubble; the recorded intervals must respect the
pipeline's data dependencies; and what the monitor logs must equal what its trace shows.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.testing import run_world
from tests.distributed.pipeline_models import assert_causal, replay_recorded

P, DIM, BATCH = 4, 8, 16


class Stage(nn.Module):
    """One pipeline stage ``x ↦ (x + shift) · scale``: ``shift`` makes the first stage need an input
    gradient too, ``scale`` a weight gradient (so zero-bubble schedules split I and W on every stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(DIM))
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.shift) * self.scale


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _runner(rank: int, schedule: str, m: int) -> Any:
    import torch.distributed as dist

    from lightning_4d.pipeline import PipelineRunner, get_schedule_info, stage_ids_for_rank

    info = get_schedule_info(schedule)
    v = 2 if info.multi_stage else 1
    ids = stage_ids_for_rank(rank, P, v, info.style)
    return PipelineRunner([Stage() for _ in ids], dist.group.WORLD, _loss, schedule=schedule, microbatches=m,
                          stage_ids=ids, num_stages=P * v)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)


def _record(rank: int, cases: list[tuple[str, int]]) -> dict[str, Any]:
    """Per case: the gathered events of the second step (the first runs torch's shape inference)."""
    from lightning_4d.pipeline.instrument import PipelineInstrument

    out: dict[str, Any] = {}
    x, y = _batch()
    for schedule, m in cases:
        runner = _runner(rank, schedule, m)
        inst = PipelineInstrument.attach_to(runner)
        for _ in range(2):
            inst.clear()
            runner.train_step(x, y)
        out[f"{schedule}/{m}"] = inst.gather()
        inst.detach()
    return out


# Unit costs F = I = W = 1, B = 2 per stage chunk; p = 4 ranks.
# 1F1B: makespan m + p − 1 (in F + B units), one stage per rank: bubble (p − 1)/(m + p − 1) per rank and stage.
# ZBV, v = 2 (m = 8): makespan max(3·v·m + p − 1, 4·(p + m) − 2) = 51; a rank works 3·v·m = 48 (bubble
# 3/51), a stage 3·m = 24 (idle while its rank runs the other stage: 27/51).
EXPECTED = {"1f1b/4": (3 / 7, 3 / 7), "1f1b/8": (3 / 11, 3 / 11), "zbv/8": (3 / 51, 27 / 51)}


def test_recorded_steps_replay_to_the_schedules_bubble() -> None:
    got = run_world(_record, P, [("1f1b", 4), ("1f1b", 8), ("zbv", 8)], timeout_s=300)[0]
    for case, (rank_bubble, stage_bubble) in EXPECTED.items():
        events = got[case]
        step = events[0].step
        assert_causal(events, step)
        _, per_rank, per_stage = replay_recorded(events, step)
        assert per_rank == pytest.approx(dict.fromkeys(range(P), rank_bubble), abs=1e-12), case
        assert per_stage == pytest.approx(dict.fromkeys(per_stage, stage_bubble), abs=1e-12), case
        assert len(per_stage) == P * (2 if case.startswith("zbv") else 1)


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
    results = run_world(_monitor_glue, P, str(tmp_path), timeout_s=300)
    logged = results[0]["logged"]
    assert all(r["logged"] == logged for r in results)  # already global: identical on every rank
    assert logged["pp/bubble_fraction_theory"] == pytest.approx((P - 1) / (8 + P - 1))  # 1F1B, m = 8
    assert all(r["restored"] for r in results)
    # Batches 1..4 are recorded (batch 0 runs shape inference); traces every 2 batches: 2 and 4.
    written = results[0]["written"]
    assert [os.path.basename(p) for p in written] == [
        "pipeline_step2.json", "pipeline_step2.png", "pipeline_step4.json", "pipeline_step4.png"]
    assert all(r["written"] == [] for r in results[1:])
    with open(written[2]) as fh:  # the last logged step
        trace = json.load(fh)
    actions = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] != "idle"]
    assert len(actions) == P * 8 * 2  # one event per executed F and B on every stage
    assert {e["name"] for e in actions} == {"F", "B"}
    assert {e["pid"] for e in actions} == set(range(P))
    assert trace["otherData"]["schedule"] == "1f1b"
    idle = [e for e in trace["traceEvents"] if e["name"] == "idle"]
    span = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X")
    busy = sum(e["dur"] for e in actions)
    assert sum(e["dur"] for e in idle) == pytest.approx(P * span - busy, rel=1e-6)
    # What is logged is what the trace shows: 1 − busy / makespan per rank (= its one stage), and the mean.
    for r in range(P):
        share = 1 - sum(e["dur"] for e in actions if e["pid"] == r) / span
        assert logged[f"pp/bubble_fraction_rank{r}"] == pytest.approx(share, rel=1e-6)
        assert logged[f"pp/bubble_fraction_stage{r}"] == pytest.approx(share, rel=1e-6)
    assert logged["pp/bubble_fraction"] == pytest.approx(1 - busy / (P * span), rel=1e-6)
    import matplotlib.image as mpl
    img = mpl.imread(written[1])
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 200


def _p2p_counts(rank: int, m: int) -> dict[str, Any]:
    """Point-to-point traffic of one 1F1B step seen by the CommunicationMonitor's recorder."""
    import torch.distributed as dist

    from lightning_4d.callbacks import CommRecorder
    from lightning_4d.core.comm import mesh_axis_groups
    from lightning_4d.mesh import ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims.from_world(P, pp=P), "cpu")
    pp_group = mesh["pp"].get_group()
    from lightning_4d.pipeline import PipelineRunner

    runner = PipelineRunner([Stage()], pp_group, _loss, schedule="1f1b", microbatches=m, stage_ids=[rank],
                            num_stages=P)
    x, y = _batch()
    runner.train_step(x, y)  # shape inference
    with CommRecorder(mesh_axis_groups(mesh)) as rec:
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
