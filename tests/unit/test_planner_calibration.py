"""The planner against published runs (``lightning_4d/planner/calibration/published.json``): every modelled
ratio within ±15%, and no layout that really ran called impossible."""

from __future__ import annotations

import pytest

from lightning_4d.planner.calibrate import TOLERANCE, calibration_rows, load_published


@pytest.fixture(scope="module")
def rows():
    return calibration_rows()


def test_every_published_row_is_planned(rows):
    assert len(rows) == len(load_published()["rows"]) >= 14
    assert {r["source"] for r in rows} == {"megatron_sc21", "torchtitan_202412"}


def test_runs_that_ran_fit(rows):
    assert [r["id"] for r in rows if not r["fits"]] == []


def test_throughput_within_tolerance(rows):
    off = {r["id"]: round(r["throughput_ratio"], 3) for r in rows
           if not r["float8"] and abs(r["throughput_ratio"] - 1) > TOLERANCE}
    assert off == {}


def test_memory_within_tolerance(rows):
    measured = [r for r in rows if "memory_ratio" in r]
    assert len(measured) == 5
    assert {r["id"]: round(r["memory_ratio"], 3) for r in measured if abs(r["memory_ratio"] - 1) > TOLERANCE} == {}


def test_efficiency_rises_with_model_size_on_megatron(rows):
    """The trend measured runs show (SC21 Table 1: 44% at 1.7B, 52% at 1T): planned TFLOP/s per GPU of the
    1T model above the 1.7B one."""
    sc21 = {r["id"]: r["throughput_planned"] for r in rows if r["source"] == "megatron_sc21"}
    assert sc21["sc21-1T"] > sc21["sc21-1.7B"]
