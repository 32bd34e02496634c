"""The planner against published runs, through the path a user runs (``recipes/plan.py`` overrides): every row of
``docs/planner_calibration.md`` is what its printed command gives, the modelled rows are within ±15%, no run that
really ran is called impossible, and the overrides describe the run as its source states it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_4d.planner.calibrate import TOLERANCE, load_published
from lightning_4d.recipes.calibration import calibration_markdown, calibration_rows, cpu_rows, plan_overrides

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "planner_calibration.md"
# Sources this project cited before (the bar of the issue) and the ones added since.
CITED = {"megatron_sc21", "torchtitan_202412"}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return calibration_rows()


@pytest.fixture(scope="module")
def cpu() -> list[dict]:
    return cpu_rows()


def test_the_document_is_what_the_commands_give(rows: list[dict], cpu: list[dict]) -> None:
    """docs/planner_calibration.md is generated from the rows' commands (the recipe path), nothing else."""
    assert DOC.read_text() == calibration_markdown(rows, cpu), (
        "docs/planner_calibration.md is stale: run `python bench/calibrate_planner.py --write docs/planner_calibration.md`")


def test_every_row_prints_its_command(rows: list[dict]) -> None:
    text = DOC.read_text()
    commands = dict(re.findall(r"^- `([^`]+)`: `(python recipes/plan\.py [^`]+)`$", text, flags=re.M))
    assert set(commands) == {r["id"] for r in rows} == {r["id"] for r in load_published()["rows"]}
    for r in rows:
        assert commands[r["id"]] == r["command"]


def test_modelled_rows_are_within_tolerance_and_fit(rows: list[dict]) -> None:
    inside = [r for r in rows if r["bar"]]
    off = {r["id"]: round(r["throughput_ratio"], 3) for r in inside if abs(r["throughput_ratio"] - 1) > TOLERANCE}
    off.update({r["id"] + " memory": round(r["memory_ratio"], 3) for r in inside
                if r["memory_ratio"] is not None and abs(r["memory_ratio"] - 1) > TOLERANCE})
    assert off == {}
    assert [r["id"] for r in inside if not r["fits"]] == []
    # Every row the project cited before is inside the bar, with memory where the source gives it.
    cited = [r for r in rows if r["source"] in CITED and r["id"] != "titan-405B-pp8-interleaved"]
    assert all(r["bar"] for r in cited) and sum(r["memory_ratio"] is not None for r in cited) >= 6


def test_new_runs_include_an_moe_and_one_over_1000_gpus(rows: list[dict]) -> None:
    new = [r for r in rows if r["bar"] and r["source"] not in CITED]
    assert any(r["gpus"] > 1000 for r in new) and any(r["moe"] for r in new)


def test_rows_outside_the_bar_say_why(rows: list[dict]) -> None:
    for r in rows:
        assert r["bar"] or len(r["why"]) > 40, r["id"]


def test_overrides_describe_the_run_as_published(rows: list[dict]) -> None:
    """The planned layout (tp, pp, ep, world, global batch, micro-batch, virtual stages) is the source's."""
    published = {r["id"]: r["as_published"] for r in load_published()["rows"]}
    for row in rows:
        lay, pub = row["planned_layout"], published[row["id"]]
        assert lay["world_size"] == pub["gpus"], row["id"]
        for key in ("tp", "pp", "ep"):
            if key in pub:
                assert lay[key] == pub[key], (row["id"], key)
        if "global_batch" in pub:
            assert lay["global_batch_size"] == pub["global_batch"], row["id"]
        if "micro_batch" in pub:
            assert lay["micro_batch_size"] == pub["micro_batch"], row["id"]
        vp = pub.get("vp", pub.get("virtual_stages"))
        if vp and pub.get("pp", 1) > 1:
            assert lay["virtual_stages"] == vp, row["id"]


def test_efficiency_rises_with_model_size_on_megatron(rows: list[dict]) -> None:
    """The trend measured runs show (SC21 Table 1: 44% at 1.7B, 52% at 1T) comes out of the shapes."""
    sc21 = {r["id"]: r["throughput_planned"] for r in rows if r["source"] == "megatron_sc21"}
    assert sc21["sc21-1T"] > sc21["sc21-1.7B"]


def test_float8_is_physical_not_fitted() -> None:
    """Float8 halves the linear GEMMs' time at most (2x peak, 2x intensity) and adds casts."""
    from lightning_4d.planner.roofline import estimate_step

    row = next(r for r in load_published()["rows"] if "plan.float8=true" in r["overrides"] and r.get("bar", True))
    setup, _ = plan_overrides(row["overrides"])
    fp8 = estimate_step(setup.spec, setup.dims, setup.train, setup.cluster).step_s
    bf16 = estimate_step(setup.spec, setup.dims, setup.train.with_(float8=False), setup.cluster).step_s
    assert bf16 / 2 < fp8 < bf16


def test_the_command_line_prints_the_row(rows: list[dict], tmp_path: Path) -> None:
    """One row through the real command line (the others are composed in-process by the same Hydra config and
    planned by the same functions): its printed per-device throughput and peak are the table's."""
    row = next(r for r in rows if r["id"] == "titan-8B-fsdp8")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = row["command"].split()[2:]
    out = subprocess.run([sys.executable, str(REPO / "recipes" / "plan.py"), *args, f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    match = re.search(r"per device: ([\d.]+) tokens/s, [\d.]+ model TFLOP/s; peak memory ([\d.]+) GiB", out.stdout)
    assert match, out.stdout[-2000:]
    assert float(match.group(1)) == pytest.approx(row["throughput_planned"], rel=1e-4)
    assert float(match.group(2)) == pytest.approx(row["memory_planned_gib"], rel=1e-3)
    assert "planner only" in out.stdout and "every_other_matmul" in out.stdout


def test_cpu_rows_inside_the_bar(cpu: list[dict]) -> None:
    """The stored measurements are the bench's (``bench/calibrate_planner_cpu.py --measure ID --write``); ±25% is the
    target of the CPU table. At least three validation runs meet it for both memory and step time, one of them
    multi-rank; the calibration rows are in-sample and not counted."""
    measured = [r for r in cpu if r["role"] == "validation" and r["memory_ratio"] is not None]
    assert all(r["step_measured_s"] and r["memory_measured_mib"] for r in measured)
    inside = [r["id"] for r in measured
              if abs(r["memory_ratio"] - 1) <= 0.25 and abs(r["step_ratio"] - 1) <= 0.25]
    assert len(inside) >= 3 and any(r["ranks"] > 1 for r in measured if r["id"] in inside), inside
