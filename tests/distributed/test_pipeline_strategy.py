"""Pipeline parallel through the Lightning strategy: every schedule at pp=2 and pp=4, composed with TP/SP
and DP (FSDP2 / replicate), GPT-2's tied embedding across stages, MoE with ep, activation checkpointing, a model
implementing the pipeline hooks;
with gradient accumulation and clipping; validate and predict through the pipeline; clear errors."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_4d.testing import run_world
from tests.distributed.common import assert_parity, fit_spec, merge_ranks, world_fit

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
BASE: dict[str, Any] = dict(steps=3, accumulate=2, clip=0.05, predict=True, validate=True)
WORLDS: dict[int, list[tuple[str, dict[str, Any]]]] = {
    2: [("llama-4", dict(pp=2, schedule=s)) for s in SCHEDULES]
    + [("gpt2-4", dict(pp=2)), ("gpt2-4", dict(pp=2, schedule="zbv")),
       ("llama-4", dict(pp=2, activation_checkpointing="full")), ("llama-hooks", dict(pp=2))],
    4: [("llama-8", dict(pp=4, schedule=s)) for s in SCHEDULES]
    + [("llama-8", dict(pp=2, tp=2, schedule=s)) for s in SCHEDULES]
    + [("llama-8", dict(pp=2, schedule=s, data_parallel=m)) for s in SCHEDULES for m in ("fsdp", "replicate")]
    + [("gpt2-4", dict(pp=2, tp=2)), ("moe", dict(pp=2, ep=2)), ("moe", dict(pp=2, tp=2, ep=2)),
       ("llama-hooks", dict(pp=2, tp=2))],
    8: [("llama-8", dict(pp=2, tp=2, schedule=s)) for s in SCHEDULES],
}


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    models = {m for specs in WORLDS.values() for m, _ in specs}
    return {m: fit_spec(dict(BASE, model=m)) for m in sorted(models)}


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_pipeline_parity(world: int, references: dict[str, Any]) -> None:
    specs = [dict(BASE, model=m, world=world, strategy=s) for m, s in WORLDS[world]]
    results = merge_ranks(run_world(world_fit, world, specs, timeout_s=1500))
    for spec, got in zip(specs, results):
        assert_parity(got, references[spec["model"]], label=f"{spec['model']} {spec['strategy']}")



def test_pipeline_gradient_scale_without_clipping() -> None:
    # Unclipped raw gradients of one step: a wrong loss or gradient scale cannot hide behind clipping.
    spec = dict(model="llama-8", steps=1, clip=None, accumulate=2)
    ref = fit_spec(spec)
    specs = [dict(spec, world=4, strategy=s) for s in (dict(pp=4), dict(pp=2, tp=2), dict(pp=2, schedule="zbv"))]
    for got, s in zip(merge_ranks(run_world(world_fit, 4, specs)), specs):
        assert_parity(got, ref, label=f"unclipped {s['strategy']}")


def _non_sequential(rank: int) -> None:
    import torch

    from tests.distributed import common

    original = common.build_model

    def build(kind: str) -> torch.nn.Module:
        model = original("llama-4")
        forward = model.forward
        model.forward = lambda tokens: forward(tokens) + model.tok_embeddings(tokens).sum(-1, keepdim=True)
        return model

    common.build_model = build
    common.fit_spec(dict(model="llama-4", steps=1, world=2, strategy=dict(pp=2)))


def _bad_batch(rank: int) -> None:
    from tests.distributed.common import fit_spec

    fit_spec(dict(model="llama-4", steps=1, world=2, global_batch=6, strategy=dict(pp=2, microbatches=4)))


def _tied_v_with_dp(rank: int) -> None:
    fit_spec(dict(model="gpt2-4", steps=1, world=4, strategy=dict(pp=2, schedule="zbv")))


def test_pipeline_errors_on_every_rank() -> None:
    # Tied embedding/head on one rank (V-shaped schedule) wrapped by two data-parallel roots would drift: refused.
    for res in run_world(_tied_v_with_dp, 4, raise_on_error=False, pg_timeout_s=20):
        assert "schedule='zbv' places the first and last pipeline stage on one rank" in res["error"], res["error"]
        assert "model.embeddings.wte.weight = model.lm_head.weight" in res["error"] and "dp=2" in res["error"]
    for res in run_world(_non_sequential, 2, raise_on_error=False, pg_timeout_s=20):
        assert "pipeline_pre_blocks" in res["error"] and "CausalLM" in res["error"], res["error"]
    for res in run_world(_bad_batch, 2, raise_on_error=False, pg_timeout_s=20):
        assert "microbatches=4" in res["error"] and "6" in res["error"], res["error"]
