"""Schedule registry, micro-batch rules and bubbles from torch's own action tables (pure)."""

from __future__ import annotations

import pytest

from lightning_4d.pipeline.bubble import bubble_from_actions, schedule_actions, simulate_actions
from lightning_4d.pipeline.schedules import (
    SCHEDULES,
    bubble_theory,
    default_microbatches,
    get_schedule_info,
    minimum_microbatches,
    validate_microbatches,
)


def test_registry_maps_to_torch_classes() -> None:
    import torch.distributed.pipelining as pipelining

    for info in SCHEDULES.values():
        assert info.torch_class is getattr(pipelining, info.torch_name)
    assert get_schedule_info("1F1B").name == "1f1b"
    assert get_schedule_info(pipelining.ScheduleZBVZeroBubble).name == "zbv"
    assert (get_schedule_info("zbv").style, get_schedule_info("dualpipev").style) == ("v", "v")
    assert get_schedule_info("interleaved_1f1b").multi_stage and not get_schedule_info("gpipe").multi_stage
    with pytest.raises(ValueError, match="schedule='pipedream' is not known"):
        get_schedule_info("pipedream")


def test_an_unknown_schedule_is_refused_in_one_place() -> None:
    """The options, the micro-batch rule, the bubble, the planner's in-flight count and the default stages per rank
    all refuse an unknown schedule with the one message of the record's lookup (the micro-batch rule used to accept
    any name, as GPipe)."""
    from lightning_4d.config import FourDConfig
    from lightning_4d.pipeline.schedules import default_virtual_stages, in_flight_microbatches, stage_style

    with pytest.raises(ValueError) as lookup:
        get_schedule_info("2f2b")
    message = str(lookup.value)
    assert message.startswith("schedule='2f2b' is not known. Choose one of gpipe, 1f1b, interleaved_1f1b, zbv, dualpipev")
    for refuse in (lambda: FourDConfig(pp=2, schedule="2f2b"), lambda: validate_microbatches("2f2b", 2, 1, 2),
                   lambda: minimum_microbatches("2f2b", 2), lambda: default_microbatches("2f2b", 2),
                   lambda: bubble_theory("2f2b", 2, 4), lambda: in_flight_microbatches("2f2b", 2, 4, 0),
                   lambda: default_virtual_stages("2f2b", 2), lambda: stage_style("2f2b", 2),
                   lambda: schedule_actions("2f2b", 2, 1, 2)):
        with pytest.raises(ValueError) as caught:
            refuse()
        assert str(caught.value) == message
        assert caught.traceback[-1].name == "get_schedule_info"
    # a schedule torch has but the strategy does not run, and an alias, are the options' own rules
    with pytest.raises(ValueError, match="FourDStrategy runs gpipe, 1f1b, interleaved_1f1b, zbv, dualpipev"):
        FourDConfig(pp=2, schedule="looped_bfs")
    with pytest.raises(ValueError, match="write 'interleaved_1f1b'"):
        FourDConfig(pp=2, schedule="interleaved")


def test_schedule_records_match_torchs_placement() -> None:
    """Each schedule's record (placement, stages per rank) against torch's own action tables: every stage runs on
    the rank ``stage_to_rank`` predicts for the record's style, with the record's stages per rank."""
    from lightning_4d.pipeline.partition import stage_to_rank
    from lightning_4d.pipeline.schedules import default_virtual_stages, stage_style

    for name in SCHEDULES:
        for pp in (2, 4):
            v = default_virtual_stages(name, pp)
            style = stage_style(name, pp)
            m = default_microbatches(name, pp, v)
            actions = schedule_actions(name, pp, v, m)
            seen = {a.stage: rank for rank, acts in actions.items() for a in acts}
            assert sorted(seen) == list(range(pp * v)), name
            assert all(stage_to_rank(stage, pp, style) == rank for stage, rank in seen.items()), (name, pp)
    assert stage_style("zbv", 1) == "loop" and default_virtual_stages("interleaved_1f1b", 1) == 1


def test_defaults_and_minimums() -> None:
    assert default_microbatches("1f1b", 4) == 4
    assert default_microbatches("interleaved_1f1b", 4, 2) == 8
    assert default_microbatches("zbv", 4, 2) == 8
    assert minimum_microbatches("dualpipev", 4, 2) == 8
    assert minimum_microbatches("gpipe", 4) == 1
    assert validate_microbatches("1f1b", 2, 1, None, 8) == 2


def test_rules_agree_with_torch_constructors() -> None:
    """Whatever validate_microbatches accepts, torch builds (and vice versa) — stub stages, no group."""
    from lightning_4d.pipeline.bubble import _torch_pipeline_order

    for info in SCHEDULES.values():
        v = info.virtual_stages or 2
        for pp in (2, 4):
            for m in range(1, 17):
                try:
                    validate_microbatches(info, pp, v, m)
                    ours = True
                except ValueError:
                    ours = False
                try:
                    _torch_pipeline_order(info, pp, v, m)
                    theirs = True
                except (ValueError, AssertionError):
                    theirs = False
                assert ours == theirs, (info.name, pp, m)


@pytest.mark.parametrize(
    "args,match",
    [
        (("1f1b", 4, 1, 3, 12), r"microbatches=3 is invalid for schedule '1f1b' with pp=4: 1F1B needs at least as many"
                                r" micro-batches as stages \(>= pp = 4\). Fix: use microbatches in \[4, 6, 12\]"),
        (("1f1b", 2, 1, 4, 6), r"microbatches=4 does not divide the local batch size 6.*microbatches in \[2, 3, 6\]"),
        (("interleaved_1f1b", 4, 2, 9, 36), r"multiple of the rounds"),
        (("dualpipev", 2, 2, 2, 8), r"DualPipeV needs at least as many micro-batches as stages \(>= 2·pp = 4\)"),
        (("zbv", 2, 1, 4, 8), r"virtual_stages=1 does not fit schedule 'zbv': it runs exactly 2"),
        (("1f1b", 2, 2, 4, 8), r"virtual_stages=2 does not fit schedule '1f1b'.*interleaved_1f1b"),
        (("interleaved_1f1b", 2, 1, 4, 8), r"Set virtual_stages >= 2, or use '1f1b'"),
        (("1f1b", 4, 1, None, 6), r"microbatches=4 \(the default pp·virtual_stages\) does not divide the local batch"),
        (("gpipe", 2, 1, 0, 8), r"microbatches=0 must be a positive integer"),
    ],
)
def test_validation_errors(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_microbatches(*args)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 8, 16, 32])
def test_gpipe_1f1b_bubble_exact(p: int, m: int) -> None:
    for costs in ({"F": 1, "B": 1}, {"F": 1, "B": 2}):
        for name in ("gpipe", "1f1b"):
            if name == "1f1b" and m < p:
                continue
            assert bubble_from_actions(name, p, 1, m, costs=costs) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert bubble_theory("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 2, 16), (2, 3, 6), (4, 4, 8)])
def test_interleaved_bubble_matches_formula(p: int, v: int, m: int) -> None:
    for costs in ({"F": 1, "B": 1}, None):
        got = bubble_from_actions("interleaved_1f1b", p, v, m, costs=costs)
        assert got == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert bubble_theory("interleaved_1f1b", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_schedules_beat_1f1b(p: int, m: int) -> None:
    one_f_one_b = bubble_from_actions("1f1b", p, 1, m)
    for name in ("zbv", "dualpipev"):
        got = bubble_from_actions(name, p, 2, m)
        assert got < one_f_one_b / 3
        assert got == pytest.approx(bubble_theory(name, p, m, 2), abs=1e-12)  # m >= 2p: the start-up delay only


def test_actions_cover_every_microbatch() -> None:
    acts = schedule_actions("zbv", 2, 2, 4)
    kinds = sorted({a.kind for lst in acts.values() for a in lst})
    assert kinds == ["F", "I", "W"]
    assert all(a.stage in (0, 3) for a in acts[0]) and all(a.stage in (1, 2) for a in acts[1])
    # DualPipeV's overlapped F+B actions are flattened into their parts.
    assert {a.kind for lst in schedule_actions("dualpipev", 2, 2, 4).values() for a in lst} >= {"F", "B"}


def test_simulation_detects_deadlock() -> None:
    from lightning_4d.pipeline.bubble import Action

    bad = {0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(1, "B", 0), Action(1, "F", 0)]}
    with pytest.raises(ValueError, match="deadlocks"):
        simulate_actions(bad, 2)
