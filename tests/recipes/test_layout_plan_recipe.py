"""The layout plan as a recipe artefact: a run writes ``layout_plan.json``; re-running with
``parallel.plan=<that file>`` gives identical losses; an edited plan (one MLP replicated instead of sharded) is
applied (the run's own file shows it) and trains at parity with the derived plan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from lightning_4d.recipes import register_configs
from tests.recipes.test_recipes import CONF, SYNTHETIC, TINY

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _run(conf: str, overrides: list[str]) -> list[float]:
    from lightning_4d.recipes import run

    register_configs()
    with initialize_config_dir(conf, version_base=None):
        cfg = compose("train", overrides)
    return run(cfg).losses


def _plans_world(rank: int, conf: str, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_4d.plan import PLAN_FILE, load_plan

    base = [*TINY, *SYNTHETIC, "trainer.devices=2", "trainer.max_steps=4", "parallel=tp",
            "parallel.sequence_parallel=false"]
    first = _run(conf, [*base, f"output_dir={root}/first"])
    written = Path(root) / "first" / PLAN_FILE
    again = _run(conf, [*base, f"output_dir={root}/again", f"parallel.plan={written}"])
    plan = load_plan(written)
    assert plan.tensor_parallel is not None
    block, regions = next(iter(plan.tensor_parallel.regions.items()))
    mlp = f"{block}.{regions[-1]}"
    edited = plan.without_styles(mlp)
    path = Path(root) / f"edited-{rank}.json"
    edited.save(path)
    dist.barrier()
    changed = _run(conf, [*base, f"output_dir={root}/edited", f"parallel.plan={path}"])
    applied = load_plan(Path(root) / "edited" / PLAN_FILE)
    return dict(first=first, again=again, changed=changed, mlp=mlp,
                styles_before=sorted(plan.tensor_parallel.styles),
                styles_applied=sorted(applied.tensor_parallel.styles) if applied.tensor_parallel else [])


def test_written_plan_reapplies_exactly_and_an_edited_plan_trains_at_parity(tmp_path: Path) -> None:
    from lightning_4d.testing import run_world

    got = run_world(_plans_world, 2, str(CONF), str(tmp_path), timeout_s=400, pg_timeout_s=60)[0]
    assert len(got["first"]) == 4 and got["again"] == got["first"]  # the same plan: bit-identical losses
    removed = [s for s in got["styles_before"] if s == got["mlp"] or s.startswith(got["mlp"] + ".")]
    assert removed and not set(removed) & set(got["styles_applied"])  # the edit reached the model
    # replicated instead of sharded: the same math, summed in another order
    for a, b in zip(got["changed"], got["first"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (got["changed"], got["first"])
