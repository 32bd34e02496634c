"""Instrumentation of the real schedule step: events per action, p2p waits, measured bubble."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from lightning_4d.pipeline import PipelineRunner, build_pipeline_stages, get_schedule_info
from lightning_4d.pipeline.instrument import PipelineInstrument, bubble_share
from lightning_4d.testing import run_world
from tests.distributed.pipeline_models import assert_causal, batch, build, loss_fn, replay_recorded


def _world(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for name, v in (("1f1b", 1), ("zbv", 2)):
        model = build()
        parts = build_pipeline_stages(model, rank, 2, v, get_schedule_info(name).style)
        runner = PipelineRunner(parts.modules, dist.group.WORLD, loss_fn, schedule=name, microbatches=4)
        inst = PipelineInstrument.attach_to(runner)
        for step in range(2):
            runner.train_step(*batch(step))
        runner.eval_step(batch(2)[0])
        events = inst.gather()
        inst.detach()
        runner.train_step(*batch(3))  # detached: nothing recorded, torch's methods are back
        out[name] = {
            "kinds": Counter((e.rank, e.stage, e.kind) for e in events if e.kind != "wait"),
            "waits": sum(1 for e in events if e.kind == "wait"),
            "ordered": all(e.t1 >= e.t0 for e in events),
            "bubble": bubble_share(events, by="rank"),
            "events": events,
            "by_stage": bubble_share(events, by="stage", makespan="rank"),
            "recorded_after_detach": len(inst.events) - len([e for e in events if e.rank == rank]),
            "stage_methods_restored": all("forward_one_chunk" not in vars(s) for s in runner.stages),
        }
    return out


def test_instrument_records_the_real_schedule() -> None:
    results = run_world(_world, 2)
    for name, kinds in (("1f1b", ("F", "B")), ("zbv", ("F", "I", "W"))):
        got = results[0][name]
        assert got == results[1][name] or got["kinds"] == results[1][name]["kinds"]
        stages = range(2) if name == "1f1b" else range(4)
        for stage in stages:
            rank = stage if name == "1f1b" else (0 if stage in (0, 3) else 1)
            # 2 train steps of 4 micro-batches each + 1 eval step (forward only).
            assert got["kinds"][(rank, stage, "F")] == 12
            for kind in kinds[1:]:
                assert got["kinds"][(rank, stage, kind)] == 8
        assert got["kinds"][(0, None, "step")] == 3 and got["kinds"][(1, None, "step")] == 3
        assert got["waits"] > 0 and got["ordered"]
        assert set(got["bubble"]) == {0, 1}
        # The second train step (step 1), replayed in its recorded order under unit costs (F = I = W = 1,
        # B = 2): 1F1B (p − 1)/(m + p − 1) = 1/5; ZBV makespan max(3·v·m + p − 1, 4·(p + m) − 2) = 25,
        # a rank works 24, a stage 12.
        assert_causal(got["events"], 1)
        _, per_rank, per_stage = replay_recorded(got["events"], 1)
        rank_share, stage_share = (1 / 5, 1 / 5) if name == "1f1b" else (1 / 25, 13 / 25)
        assert per_rank == pytest.approx({0: rank_share, 1: rank_share}, abs=1e-12)
        assert per_stage == pytest.approx(dict.fromkeys(stages, stage_share), abs=1e-12)
        assert set(got["by_stage"]) == set(stages)
        assert got["recorded_after_detach"] == 0 and got["stage_methods_restored"]
