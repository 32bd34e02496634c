"""``docs/context_parallel_measurements.md`` (written by ``bench/bench_context_parallel.py --markdown``) supports what
docs/context_parallel.md quotes from it: at 8k tokens one step's peak memory per rank at cp=2 at most 0.65 × cp=1's and at cp=4
at most 0.4 × for every algorithm, the planner's activation estimate within 15 % of the measurement at every
sequence, cp and algorithm, the bytes sent on the cp axis equal to the formula. The planner and formula columns
are recomputed from the code, so a change of the planner's model that the measured table no longer supports fails
here (re-run the benchmark); the page's table is the document's 8k rows."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "context_parallel_measurements.md"
ALGORITHMS = ("allgather", "ulysses", "ring")
TARGETS = {2: 0.65, 4: 0.4}  # peak per rank against cp=1's at T = 8192 (issue 45)


def _bench():
    path = REPO / "bench" / "bench_context_parallel.py"
    spec = importlib.util.spec_from_file_location("bench_context_parallel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows() -> list[dict]:
    lines = [x for x in DOC.read_text().splitlines() if x.startswith("| ") and x[2].isdigit()]
    keys = ("T", "algorithm", "cp", "peak", "peak_ratio", "saved", "formula", "planner", "ratio", "sent", "kv_formula")
    rows = []
    for x in lines:
        cells = [c.strip() for c in x.strip("|").split("|")]
        row: dict = {k: (c if k == "algorithm" else float(c)) for k, c in zip(keys, cells)}
        row["alg"] = "allgather" if row["algorithm"] == "-" else row["algorithm"]
        rows.append(row)
    return rows


def test_every_configuration_is_measured_and_the_planner_within_15_percent() -> None:
    rows = _rows()
    bench = _bench()
    lengths = {int(r["T"]) for r in rows}
    assert lengths == {8192, 16384, 32768}, lengths  # issue 45: the 8k targets, also at 16k and 32k
    measured = {t: bench.CONFIGS if t <= bench.LONG else bench.LONG_CONFIGS for t in lengths}
    assert {(int(r["T"]), int(r["cp"]), r["algorithm"]) for r in rows} == {
        (t, cp, a) for t, configs in measured.items() for cp, a in configs}
    for r in rows:
        T, cp = int(r["T"]), int(r["cp"])
        assert abs(bench.planner_activation_bytes(T, cp, r["alg"]) / 1e6 - r["planner"]) <= 0.05, r  # the code
        assert abs(r["ratio"] - r["planner"] / r["saved"]) < 0.01
        assert 0.85 <= r["planner"] / r["saved"] <= 1.15, r


def test_peak_memory_per_rank_falls_with_cp_for_every_algorithm() -> None:
    rows = _rows()
    for r in rows:
        whole = next(x["peak"] for x in rows if x["T"] == r["T"] and x["cp"] == 1)
        assert abs(r["peak_ratio"] - r["peak"] / whole) < 0.01, r
        if r["T"] == 8192 and r["cp"] > 1:
            assert r["peak_ratio"] <= TARGETS[int(r["cp"])], r


def test_bytes_equal_the_formula_and_the_formula_column_is_the_code() -> None:
    from lightning_4d.context_parallel.cost import activation_bytes_per_rank, wire_bytes_per_rank

    bench = _bench()
    rows = _rows()
    for r in rows:
        T, cp, alg = int(r["T"]), int(r["cp"]), r["alg"]
        sent = wire_bytes_per_rank(alg, 1, T, bench.DIM, bench.DIM, bench.LAYERS, cp, 4)
        assert r["sent"] == r["kv_formula"] == round(sent / 1e6, 2), r
        whole = next(x["saved"] for x in rows if x["T"] == T and x["cp"] == 1) * 1e6
        formula = activation_bytes_per_rank(whole, 1, T, bench.DIM, bench.LAYERS, cp, act_bytes=4, algorithm=alg) / 1e6
        assert abs(formula - r["formula"]) <= 0.1 + 1e-3 * formula, r


def test_context_parallel_page_quotes_the_measured_table() -> None:
    readme = (REPO / "docs" / "context_parallel.md").read_text()
    rows = {(int(r["cp"]), r["algorithm"]): r for r in _rows() if r["T"] == 8192}
    quoted = re.search(r"planner's activation estimate is within (\d+) % of the CPU\s+measurement", readme)
    assert quoted, "docs/context_parallel.md should quote the agreement of docs/context_parallel_measurements.md"
    worst = max(abs(1 - r["planner"] / r["saved"]) for r in _rows())
    assert worst * 100 <= int(quoted.group(1)) < worst * 100 + 1
    lengths = re.search(r"at every\s+sequence \(([\dk, ]+)\)", readme)  # the lengths the document has
    assert lengths and lengths.group(1) == ", ".join(f"{int(t) // 1024}k" for t in sorted({r["T"] for r in _rows()}))
    table = re.findall(r"^\| `(\w+)` \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", readme, re.M)
    assert {a for a, *_ in table} == set(ALGORITHMS), table  # one row per algorithm: the 8k measurements
    for algorithm, peak2, peak4, sent2, sent4 in table:
        assert float(peak2) == rows[(2, algorithm)]["peak_ratio"] and float(peak4) == rows[(4, algorithm)]["peak_ratio"]
        assert float(sent2) == rows[(2, algorithm)]["sent"] and float(sent4) == rows[(4, algorithm)]["sent"]
