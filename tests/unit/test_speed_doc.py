"""``docs/measurements.md``'s compile / Float8 parity table (written by ``tests/distributed/test_speed.py``) covers every
layout issue 43 names, each row within its tolerance; ``docs/speed.md``'s benchmark table (written by
``bench/bench_compile.py --doc``) is consistent: each ratio is its quoted seconds' quotient, beside the planner's
estimate for the same model on its CPU device."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

COMPILE_LAYOUTS = {"tp=2", "pp=2 (1f1b)", "pp=2 (interleaved_1f1b)", "pp=2 (zbv)", "ep=2", "cp=2",
                   "tp=2 × pp=2 × dp=2"}
FLOAT8_LAYOUTS = {"tp=2", "dp=2", "pp=2", "tp=2 × pp=2 × dp=2"}


def _table(path: Path, name: str) -> list[list[str]]:
    text = path.read_text(encoding="utf-8")
    body = text.split(f"<!-- {name}: begin (generated) -->", 1)[1].split(f"<!-- {name}: end -->", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()
            if line.startswith("| ") and not re.match(r"\| (layout|tp) \|", line)]


def test_parity_table_covers_the_layouts_within_tolerance() -> None:
    rows = _table(REPO / "docs" / "measurements.md", "speed-parity")
    compiled = {r[0] for r in rows if r[3].startswith("compile")}
    float8 = {r[0] for r in rows if r[3].startswith("float8")}
    assert COMPILE_LAYOUTS <= compiled, COMPILE_LAYOUTS - compiled
    assert FLOAT8_LAYOUTS <= float8, FLOAT8_LAYOUTS - float8
    for row in rows:
        assert float(row[4]) <= float(row[5]), row  # the error within its tolerance
        assert float(row[5]) >= 1e-5, row  # the floor


def test_bench_table_ratios_are_the_quoted_seconds() -> None:
    rows = _table(REPO / "docs" / "speed.md", "bench-compile")
    assert {r[0] for r in rows} == {"1", "2"}, rows
    for tp, _backend, oe, oc, ours, te, tc, titan, over, planner in rows:
        assert 0 < float(planner) <= 1, (tp, planner)  # the planner's CPU estimate: compile never slower
        assert abs(float(oc) / float(oe) - float(ours)) <= 0.002 + 0.01 * float(ours), (tp, oc, oe, ours)
        assert abs(float(tc) / float(te) - float(titan)) <= 0.002 + 0.01 * float(titan), (tp, tc, te, titan)
        assert abs(float(ours) / float(titan) - float(over)) <= 0.002 + 0.01 * float(over), (tp, ours, titan, over)
