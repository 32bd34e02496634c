"""A given layout plan is the whole decision: applying it reads the schedule, the data-parallel mode, activation
checkpointing and the expert modules from the plan, and a run whose options disagree with it is refused, naming both
values, before anything changes. Applied on meta-built models in one process (torch's fake process group).

The case that made it matter (confirmed on the code before): a saved ``interleaved_1f1b`` plan (loop placement, 2
stages per rank) applied with ``schedule="zbv"`` went through — the pipeline was built V-shaped from the option — and
so skipped the V-shaped schedules' refusal of weights tied across the first and last stage under data parallelism
(the tied copies would drift). A saved ``1f1b`` plan was stopped only by its stage count, by a message that did not
name the schedule."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from lightning_4d.config import FourDConfig
from lightning_4d.layout.derive_plan import plan_layout
from lightning_4d.layout.parallelize import ParallelPlan, apply_layout, describe_layout
from lightning_4d.mesh import build_mesh
from lightning_4d.models import CausalLM
from lightning_4d.models.gpt2 import GPT2, GPT2Config
from lightning_4d.plan import LayoutPlan
from lightning_4d.planner.fake_world import fake_world
from tests.distributed.common import build_model

WORLD = 4


def _tied_gpt2() -> CausalLM:
    with torch.device("meta"):  # embedding and head tied: the first and the last pipeline stage share a weight
        return CausalLM(GPT2(GPT2Config(vocab_size=64, n_embd=16, n_layer=4, n_head=2, block_size=16)))


def _llama() -> CausalLM:
    with torch.device("meta"):
        return CausalLM(build_model("llama"))


def _apply(build: Any, plan: LayoutPlan, config: Any) -> ParallelPlan:
    dims = (config or FourDConfig(tp=plan.degree("tp"), pp=plan.degree("pp"), ep=plan.degree("ep"),
                                  schedule=plan.schedule)).resolve(WORLD)
    with fake_world(WORLD, rank=0):
        mesh = build_mesh(dims, "cpu")
        return apply_layout(build(), plan, mesh, config)


def test_a_saved_plan_with_another_schedule_is_refused_naming_both() -> None:
    interleaved, zbv = FourDConfig(pp=2, schedule="interleaved_1f1b"), FourDConfig(pp=2, schedule="zbv")
    with pytest.raises(ValueError, match="schedule='zbv' places the first and last pipeline stage on one rank"):
        plan_layout(_tied_gpt2(), zbv.resolve(WORLD), zbv)  # derived for zbv: refused while planning
    saved = plan_layout(_tied_gpt2(), interleaved.resolve(WORLD), interleaved)
    with pytest.raises(ValueError, match=r"made for schedule='interleaved_1f1b' but this run's options say "
                                         r"schedule='zbv'\. Run with schedule='interleaved_1f1b'"):
        _apply(_tied_gpt2, saved, zbv)
    one_f_one_b = FourDConfig(pp=2)
    saved = plan_layout(_tied_gpt2(), one_f_one_b.resolve(WORLD), one_f_one_b)
    with pytest.raises(ValueError, match=r"made for schedule='1f1b' but this run's options say schedule='zbv'"):
        _apply(_tied_gpt2, saved, zbv)
    # the plan edited to a V-shaped schedule (and its stages), with options that agree: the plan's own schedule's
    # rules still hold — the tied weights are refused as when planning
    edited = plan_layout(_tied_gpt2(), interleaved.resolve(WORLD), interleaved).replace(schedule="zbv")
    with pytest.raises(ValueError, match="schedule='zbv' places the first and last pipeline stage on one rank"):
        _apply(_tied_gpt2, edited, zbv)


@pytest.mark.parametrize(("option", "planned", "asked", "shown"), [
    ("data_parallel", "replicate", "fsdp", ("'replicate'", "'fsdp'")),
    ("activation_checkpointing", "full", None, ("'full'", "None")),
    ("activation_checkpointing", None, "selective", ("None", "'selective'")),
])
def test_a_saved_plan_with_another_mode_is_refused_naming_both(option: str, planned: Any, asked: Any,
                                                                shown: tuple[str, str]) -> None:
    saved_with = FourDConfig(tp=2, **{option: planned})
    plan = plan_layout(_llama(), saved_with.resolve(WORLD), saved_with)
    with pytest.raises(ValueError, match=rf"made for {option}={shown[0]} but this run's options say "
                                         rf"{option}={shown[1]}"):
        plan.check_options(FourDConfig(tp=2, **{option: asked}), saved_with.resolve(WORLD))


def test_a_cp_algorithm_asked_by_name_must_be_the_plans() -> None:
    dims = FourDConfig(cp=2).resolve(WORLD)
    plan = LayoutPlan(degrees=(("cp", 2),), blocks_path="l", block_order=(), context_parallel="ulysses: heads")
    plan.check_options(FourDConfig(cp=2), dims)  # "auto": the plan decides
    plan.check_options(FourDConfig(cp=2, cp_algorithm="ulysses"), dims)
    with pytest.raises(ValueError, match=r"made for cp_algorithm='ulysses' but this run's options say "
                                         r"cp_algorithm='allgather'"):
        plan.check_options(FourDConfig(cp=2, cp_algorithm="allgather"), dims)


def test_a_saved_plan_is_applied_as_saved() -> None:
    """Without options, the plan's own data-parallel mode and activation checkpointing are what is applied."""
    saved_with = FourDConfig(tp=2, data_parallel="replicate", activation_checkpointing="full")

    build = _llama
    plan = plan_layout(build(), saved_with.resolve(WORLD), saved_with)
    record = _apply(build, plan, None)
    assert record.layout is plan and record.blocks
    assert all(isinstance(b.forward, functools.partial) for b in record.blocks)  # recomputed in backward
    for mode, placement in (("replicate", {"R"}), ("fsdp", {"S(0)", "StridedShard(0)"})):
        with fake_world(WORLD, rank=0):
            lm = build()
            apply_layout(lm, plan.replace(data_parallel=mode), build_mesh(saved_with.resolve(WORLD), "cpu"))
            on_dp = {row.placements[row.mesh.index("dp")] for row in describe_layout(lm)}
        assert on_dp == placement, (mode, on_dp)  # every parameter over dp as the plan's mode places it


def test_apply_reads_the_experts_from_the_plan_and_sums_their_routers_over_tp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert discovery runs once, when planning: applying the plan inspects no other module, and the parameters
    summed over tp (routers and shared experts under sequence parallelism) come from one owner."""
    import lightning_4d.expert_parallel.inplace as inplace
    import lightning_4d.expert_parallel.rewrite as rewrite

    def build() -> CausalLM:
        with torch.device("meta"):
            return CausalLM(build_model("moe"))

    config = FourDConfig(tp=2, ep=2)
    plan = plan_layout(build(), config.resolve(WORLD), config)
    calls = {"inplace": 0, "moe": 0}
    find_experts, find_moe = inplace.find_expert_modules, rewrite.find_moe_modules

    def counted_experts(model: Any, only: Any = None) -> Any:
        calls["inplace"] += only is None
        return find_experts(model, only)

    def counted_moe(model: Any) -> Any:
        calls["moe"] += 1
        return find_moe(model)

    monkeypatch.setattr(inplace, "find_expert_modules", counted_experts)
    monkeypatch.setattr(rewrite, "find_moe_modules", counted_moe)
    record = _apply(build, plan, config)
    assert calls == {"inplace": 0, "moe": 0}, calls
    assert record.expert_modules and all(n.endswith(".experts") for n in record.expert_modules)
    summed = record.tp_partial_params
    assert summed and all(".router." in n or ".shared_experts." in n for n in summed), summed
    assert len(summed) == len(set(summed))
