"""``FourDStrategy(compile=...)`` and ``FourDStrategy(float8=True)`` under the layouts, against one process.

Compile parity: each layout within 1e-5 relative of one eager process (``assert_parity``: the floor 1e-5, or a few
times the reference's own reordering noise), ``aot_eager`` for breadth (Dynamo and AOTAutograd trace the block as
Inductor would, without C++ compiles on 2 cores) and Inductor on pp2 (1f1b) and dp2 (FSDP2; Inductor with tp > 1 is
refused at set-up). Every compiled case also checks that every
block of every rank was compiled (``fullgraph`` or, after a graph break, without it), that ``self.log`` in the module
ran (the losses are recorded from it), and on tp2 that nothing recompiles after the second step.

Float8 parity: each layout against one process converted the same way (the plan's rule, torchao's emulated
Float8). Each quantity's tolerance is derived from Float8's rounding: the larger of the compile tolerance and twice
how far Float8 itself moves a quantity of its kind (the largest loss or gradient error of the Float8 reference
against the same run in fp32): both runs are Float8 roundings of one fp32 computation, so by the triangle inequality
they differ by at most twice that. A sharded run computes its
dynamic scales from other rows (tensorwise: each data-parallel rank's or pipeline micro-batch's activations, as
TorchTitan does), so its operands round to other Float8 values — by up to Float8's rounding, never more; with one
scale for the same rows (tp) it stays at the reordering noise. Float8 is not a no-op: the same layout's gradients
differ from the fp32 run's by more than 1e-3.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torchao  # noqa: F401  # the test extra installs it: a missing torchao fails here, never skips parity

from lightning_4d.testing import run_world
from tests.distributed.common import NOISE_FACTOR, fit_spec, merge_ranks, parity_errors, reordering_noise, world_fit

DOC = Path(__file__).resolve().parents[2] / "docs" / "measurements.md"
BEGIN, END = "<!-- speed-parity: begin (generated) -->", "<!-- speed-parity: end -->"
WRITE_ENV = "LIGHTNING_4D_WRITE_DOCS"
TOL = 1e-5


BASE: dict[str, Any] = dict(steps=3, global_batch=8, lr=1e-3)
AOT = "aot_eager"
#: (model, strategy) per 2-rank case; compile first, then Float8.
COMPILE2 = [("llama", dict(tp=2, compile=AOT)), ("llama-4", dict(pp=2, schedule="1f1b", compile=True)),
            ("llama", dict(dp=2, compile=True)), ("llama-4", dict(pp=2, schedule="1f1b", compile=AOT)),
            ("llama-4", dict(pp=2, schedule="interleaved_1f1b", compile=AOT)),
            ("llama-4", dict(pp=2, schedule="zbv", compile=AOT)),
            ("moe", dict(ep=2, compile=AOT)), ("llama", dict(cp=2, compile=AOT)),
            ("llama", dict(tp=2, compile=AOT, activation_checkpointing="full"))]
FLOAT8_2 = [("llama", dict(tp=2, float8=True)), ("llama", dict(dp=2, float8=True)),
            ("llama-4", dict(pp=2, float8=True)), ("llama", dict(tp=2, float8=True, float8_recipe="rowwise"))]
COMPILE8 = [("llama-4", dict(tp=2, pp=2, dp=2, compile=AOT))]
FLOAT8_8 = [("llama-4", dict(tp=2, pp=2, dp=2, float8=True))]


def _spec(model: str, strategy: dict[str, Any], world: int) -> dict[str, Any]:
    spec = dict(BASE, model=model, world=world, strategy=strategy)
    if strategy.get("float8"):
        spec["float8"] = strategy.get("float8_recipe", "tensorwise")  # the reference converts the same way
    if strategy.get("compile") and strategy.get("tp") == 2 and world == 2 and "activation_checkpointing" not in strategy:
        spec.update(steps=4, count_graphs=True)
    return spec


def _reference(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in ("world", "strategy", "count_graphs") and v is not None}


def _key(spec: dict[str, Any]) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in _reference(spec).items()))


WORLD2 = [_spec(m, s, 2) for m, s in COMPILE2 + FLOAT8_2]
WORLD8 = [_spec(m, s, 8) for m, s in COMPILE8 + FLOAT8_8]


@pytest.fixture(scope="module")
def references() -> dict[tuple, dict[str, Any]]:
    return {_key(s): fit_spec(_reference(s)) for s in {_key(s): s for s in WORLD2 + WORLD8}.values()}


def _fp32(spec: dict[str, Any], references: dict[tuple, dict[str, Any]]) -> dict[str, Any]:
    """The same run without Float8 (one process, fp32), computed once."""
    plain = dict(spec, float8=None)
    if _key(plain) not in references:
        references[_key(plain)] = fit_spec(_reference(plain))
    return references[_key(plain)]


def tolerances(spec: dict[str, Any], ref: dict[str, Any], references: dict[tuple, dict[str, Any]],
               errs: dict[str, float]) -> dict[str, float]:
    """Each quantity's tolerance: ``max(1e-5, NOISE_FACTOR · the reference's reordering noise)`` (``assert_parity``'s),
    and for Float8 also twice Float8's own rounding of its kind — the largest loss / gradient error of the Float8
    reference against the same run in fp32. A sharded Float8 run computes its dynamic scales from other sets of rows (tensorwise: each data-parallel
    rank's or micro-batch's activations, as TorchTitan does), so its values round differently, by up to that much."""
    noise = (reordering_noise(ref) or {}) if any(e > TOL for e in errs.values()) else {}
    tols = {k: max(TOL, NOISE_FACTOR * noise.get(k, 0.0)) for k in errs}
    if spec["strategy"].get("float8"):
        rounding = parity_errors(ref, _fp32(spec, references))
        kind = lambda k: k.split(" ")[0]  # noqa: E731  # "loss", "grad", ...
        # Both runs are Float8 roundings of the same fp32 computation, each about its kind's rounding away from it:
        # they differ by at most twice that (the triangle inequality).
        bound = {kind(k): 0.0 for k in rounding}
        for k, r in rounding.items():
            bound[kind(k)] = max(bound[kind(k)], 2 * r)
        tols = {k: max(t, bound.get(kind(k), 0.0)) for k, t in tols.items()}
    return tols


def _row(spec: dict[str, Any], errs: dict[str, float], tols: dict[str, float]) -> dict[str, Any]:
    """The table row of one case: its worst quantity by error over that quantity's tolerance."""
    worst = max(errs, key=lambda k: errs[k] / tols[k])
    strategy = spec["strategy"]
    feature = f"compile={strategy['compile']!r}" if strategy.get("compile") else \
        f"float8 ({strategy.get('float8_recipe', 'tensorwise')})"
    layout = " × ".join(f"{a}={strategy[a]}" for a in ("tp", "pp", "dp", "ep", "cp") if a in strategy)
    extra = [f"{strategy['schedule']}"] if "schedule" in strategy else []
    extra += ["activation checkpointing"] if "activation_checkpointing" in strategy else []
    return dict(layout=layout + (f" ({', '.join(extra)})" if extra else ""), ranks=spec["world"], model=spec["model"],
                feature=feature, error=errs[worst], tolerance=tols[worst], quantity=worst)


def _check(specs: list[dict[str, Any]], per_rank: list[list[dict[str, Any]]],
           references: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    rows, failures = [], []
    for spec, got in zip(specs, merge_ranks(per_rank)):
        label = f"{spec['model']} {spec['strategy']}"
        ref = references[_key(spec)]
        errs = parity_errors(got, ref)
        tols = tolerances(spec, ref, references, errs)
        rows.append(_row(spec, errs, tols))
        try:
            assert all(math.isfinite(x) for x in got["losses"]), label
            if spec["strategy"].get("compile"):
                for rank in per_rank:  # every block of every rank compiled
                    modes = rank[specs.index(spec)]["compiled"]
                    assert modes and all(m in ("fullgraph", "graph breaks") for m in modes), (label, modes)
            if spec.get("count_graphs"):  # nothing recompiles after the second step
                graphs = got["graphs"]
                assert graphs[1] > 0 and graphs[-1] == graphs[1], (label, graphs)
            if spec["strategy"].get("float8"):  # Float8 is not a no-op: the fp32 run's gradients differ
                assert max(parity_errors(got, _fp32(spec, references)).values()) > 1e-3, label
        except AssertionError as err:
            failures.append(str(err))
    write_or_check(rows)
    assert not failures, "\n".join(failures)
    return rows


def write_or_check(rows: list[dict[str, Any]]) -> None:
    """With ``LIGHTNING_4D_WRITE_DOCS=1``: put ``rows`` into ``docs/measurements.md``'s compile / Float8 table
    (replacing the rows of the same layouts); always: every measured case is within its tolerance."""
    import os

    for r in rows:
        print("speed parity:", r)
    for r in rows:
        assert r["error"] <= r["tolerance"], r
    if os.environ.get(WRITE_ENV) != "1":
        return
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    table, tail = rest.split(END, 1)
    old = {line.split(" | ")[0] + " | " + line.split(" | ")[3]: line
           for line in table.strip().splitlines() if line.startswith("| ") and not line.startswith("| layout")}
    for r in rows:
        line = (f"| {r['layout']} | {r['ranks']} | {r['model']} | {r['feature']} | {r['error']:.2e} | "
                f"{r['tolerance']:.2e} | `{r['quantity']}` |")
        old[line.split(" | ")[0] + " | " + line.split(" | ")[3]] = line
    header = ("| layout | ranks | model | feature | worst rel. error | its tolerance | worst quantity |\n"
              "|---|---:|---|---|---:|---:|---|")
    DOC.write_text(head + BEGIN + "\n" + header + "\n" + "\n".join(old.values()) + "\n" + END + tail,
                   encoding="utf-8")


def test_compile_and_float8_two_ranks(references: dict[tuple, dict[str, Any]]) -> None:
    _check(WORLD2, run_world(world_fit, 2, WORLD2, timeout_s=1200), references)


def test_compile_and_float8_eight_ranks(references: dict[tuple, dict[str, Any]]) -> None:
    _check(WORLD8, run_world(world_fit, 8, WORLD8, timeout_s=1200), references)
