"""Set-up traces the user's model once: the plan is derived from one forward of the root module, the value check
runs on a reduced copy (never a second trace, never the real model; under pp one probe per later stage runs the
root with no block), then the plan is applied. Counted on the
root instance itself (forwards of its copies do not count) and by the tracer, for a model built for real and one
built on the meta device, under tp=2 and tp=2 × pp=2 (one world of 4 ranks)."""

from __future__ import annotations

import os
from typing import Any

from lightning_4d.testing import run_world
from tests.distributed.common import assert_parity, merge_ranks

os.environ.setdefault("OMP_NUM_THREADS", "1")

LAYOUTS = [dict(tp=2, pp=1, meta=False), dict(tp=2, pp=1, meta=True), dict(tp=2, pp=2, meta=True),
           dict(tp=2, pp=2, meta=False)]


def _count_world(rank: int) -> list[dict[str, Any]]:
    import torch
    import lightning.pytorch as pl

    import lightning_4d.layout.derive_plan as derive
    from lightning_4d import FourDStrategy
    from lightning_4d.models import CausalLM
    from torch.utils.data import DataLoader

    from tests.distributed.common import build_model, make_dataset

    traced = {"n": 0}
    original = derive.trace_model

    def counting(*args: Any, **kwargs: Any) -> Any:
        traced["n"] += 1
        return original(*args, **kwargs)

    derive.trace_model = counting
    out = []
    counts: dict[int, int] = {}

    class Counted(CausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:  # counted per instance: copies count apart
            counts[id(self)] = counts.get(id(self), 0) + 1
            return super().forward(*args, **kwargs)

    for layout in LAYOUTS:
        traced["n"] = 0
        torch.manual_seed(0)
        with torch.device("meta") if layout["meta"] else torch.device("cpu"):
            lm = Counted(build_model("llama-4"))
        forwards: dict[str, Any] = {"setup": None}

        class AtFitStart(pl.Callback):
            def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                forwards["setup"] = counts.get(id(pl_module), 0)

        trainer = pl.Trainer(strategy=FourDStrategy(tp=layout["tp"], pp=layout["pp"]), devices=4,
                             accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[AtFitStart()])
        trainer.fit(lm, DataLoader(make_dataset(8), batch_size=4))
        out.append(dict(traces=traced["n"], setup_forwards=forwards["setup"],
                        plan=str(trainer.strategy.layout_plan).splitlines()[0]))
    derive.trace_model = original
    return out


def test_set_up_traces_the_model_once() -> None:
    results = run_world(_count_world, 4, timeout_s=600, pg_timeout_s=120)
    for rank_results in results:
        for layout, got in zip(LAYOUTS, rank_results):
            assert got["traces"] == 1, (layout, got)
            # the trace and, under pp, one probe per later stage that runs no block (which outputs of the modules
            # before the blocks later stages read: pipeline/carried.py) are the root's only forwards before
            # training: the value check ran on a copy
            assert got["setup_forwards"] == 1 + (layout["pp"] - 1), (layout, got)
            assert got["plan"].startswith(f"LayoutPlan tp={layout['tp']} pp={layout['pp']}"), got


def _edited_stages_world(rank: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from lightning_4d import plan_layout
    from lightning_4d.config import FourDConfig
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model, fit_spec

    with torch.device("meta"):
        lm = CausalLM(build_model(spec["model"]))
    config = FourDConfig(pp=2)
    derived = plan_layout(lm, config.resolve(2), config)
    keys = derived.block_order
    edited = derived.replace(stages=(keys[:3], keys[3:]))  # 3 blocks on the first stage, 1 on the last
    got = fit_spec(dict(spec, world=2, strategy=dict(pp=2, plan=edited)))
    return [dict(got, derived=[list(s) for s in derived.stages], edited=[list(s) for s in edited.stages])]


def test_an_edited_pipeline_split_trains_at_parity() -> None:
    from tests.distributed.common import fit_spec

    spec: dict[str, Any] = dict(model="llama-4", steps=3)
    ref = fit_spec(spec)
    got = merge_ranks(run_world(_edited_stages_world, 2, spec, timeout_s=600, pg_timeout_s=120))[0]
    assert got["derived"] == [["0", "1"], ["2", "3"]] and got["edited"] == [["0", "1", "2"], ["3"]]
    assert_parity(got, ref, label="pp=2 with stages of 3 and 1 blocks from an edited plan")
