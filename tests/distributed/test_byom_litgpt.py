"""LitGPT under every layout with no user code: ``litgpt.GPT(Config.from_name(...))`` in a ``CausalLM``.

Families (:mod:`tests.distributed.byom_litgpt`, LitGPT's own configs shrunk with its own options): Llama, Pythia,
Gemma 2, Gemma 3, Qwen3, Mixtral and Qwen3-MoE under tp=2, pp=2, tp=2 × pp=2, cp=2 and dp=2, the two MoE families
also under ep=2 and tp=2 × ep=2; and a user's loop MoE (``gate``, an ``experts`` list, ``torch.where`` per expert,
dropless: :func:`tests.distributed.moe_models.build_mixtral_model`) under cp=2 × ep=2, and a TorchTitan-style model
slicing its rotary table like LitGPT (refused under cp before) under cp=2. What each layout needs of the package,
with nothing written for LitGPT:

- tp: LitGPT's attention reads ``config.n_head`` and ``config.n_query_groups``; the trace sees both read and the
  planner rewrites them per rank by value (they are the heads the fused ``qkv`` is split into);
- ep: ``LLaMAMoE`` (a ``gate`` linear, ``experts`` of ``fc_1 / fc_2 / proj``, top-k in
  ``config.n_expert_per_token``) is rewritten by the generic rules; at ep=1 its experts run as written;
- cp: LitGPT slices its rotary table to the input length (``cos[:T]``); the table is handed to it in each rank's
  global positions. Gemma 3's sliding window comes from LitGPT's per-layer flag. Gemma 2 is refused (:data:`REFUSED`).

Every cell must match one process (3 AdamW steps, fp32): the per-step losses and every final gradient within 1e-5
relative (each gradient against its own norm, or 1e-4 of the largest for one that is zero in exact arithmetic:
``tests.distributed.test_byom_zoo._errors``), and under tp the listed projections sharded (or whole where their
heads are fewer than tp), under ep every expert tensor on an ep mesh. The LitGPT table of ``docs/zoo.md`` is this
test's output: each world checks its cells there (the same cells and refusals, each figure within
:data:`FIGURE_SPREAD` of the run's); ``LIGHTNING_4D_WRITE_ZOO=1`` rewrites the table from a run of the module.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_4d.testing import run_world
from tests.distributed.common import References, merge_ranks
from tests.distributed.test_byom_zoo import _errors, _zoo_world

os.environ.setdefault("OMP_NUM_THREADS", "1")

BASE: dict[str, Any] = dict(steps=3, global_batch=8, lr=1e-4)
PG_TIMEOUT_S = 120
TOL = 1e-5
ZOO = Path(__file__).resolve().parents[2] / "docs" / "zoo.md"
FIGURE_SPREAD = 10.0  # a figure of the table may differ from this run's by this factor (another CPU's rounding)

# column -> (world, strategy kwargs, layers)
LAYOUTS: dict[str, tuple[int, dict[str, Any], int]] = {
    "tp=2": (2, dict(tp=2), 2), "pp=2": (2, dict(pp=2), 4), "tp=2 × pp=2": (4, dict(tp=2, pp=2), 4),
    "ep=2": (2, dict(ep=2), 2), "tp=2 × ep=2": (2, dict(tp=2, ep=2), 2), "cp=2": (2, dict(cp=2), 2),
    "dp=2": (2, dict(), 2), "cp=2 × ep=2": (4, dict(cp=2, ep=2), 2),
}
# row -> (model kind, what it is)
ROWS: dict[str, tuple[str, str]] = {
    "lit-llama": ("lit-llama", "Llama (`Llama-3.2-1B`: grouped queries, fused `qkv`)"),
    "lit-pythia": ("lit-pythia", "Pythia (`pythia-14m`: partial rotary, parallel residual)"),
    "lit-gemma2": ("lit-gemma2", "Gemma 2 (`Gemma-2-2b`: soft-capped attention by hand, sandwich norms)"),
    "lit-gemma3": ("lit-gemma3", "Gemma 3 (`Gemma-3-1b-it`: one KV head, q/k norms, local and global rotary, "
                                 "sliding-window mask by hand)"),
    "lit-qwen3": ("lit-qwen3", "Qwen3 (`Qwen3-0.6B`: q/k norms)"),
    "lit-mixtral": ("lit-mixtral", "Mixtral (`Mixtral-8x7B-v0.1`: `LLaMAMoE`)"),
    "lit-qwen3moe": ("lit-qwen3moe", "Qwen3-MoE (`Qwen3-30B-A3B`: `LLaMAMoE`, q/k norms)"),
    "loop-moe": ("mixtral", "a user's loop MoE (`gate`, `experts` list, `torch.where` per expert; not LitGPT)"),
    "titan": ("titan", "a TorchTitan-style model (`freqs_cis[:T]` sliced like LitGPT's tables; not LitGPT)"),
}
DENSE = ["lit-llama", "lit-pythia", "lit-gemma2", "lit-gemma3", "lit-qwen3"]
MOE = ["lit-mixtral", "lit-qwen3moe"]
CASES: list[tuple[str, str]] = (
    [(r, c) for r in DENSE + MOE for c in ("tp=2", "pp=2", "tp=2 × pp=2", "cp=2", "dp=2")]
    + [(r, c) for r in MOE for c in ("ep=2", "tp=2 × ep=2")] + [("loop-moe", "cp=2 × ep=2"), ("titan", "cp=2")])
# Expected refusals at set-up: (row, column) -> what the error must say.
REFUSED: dict[tuple[str, str], str] = {
    # soft-capping is a tanh on the scores, computed by hand: not the SDPA call context parallelism makes global
    ("lit-gemma2", "cp=2"): "caps the attention logits (attention_logit_softcapping=",
}
_H0 = "model.transformer.h.0"
# Under tp these must be sharded on tp (a layout that replicated them would be no tensor parallelism) ...
SHARDED: dict[str, list[str]] = {
    "lit-llama": [f"{_H0}.attn.qkv.weight", f"{_H0}.attn.proj.weight", f"{_H0}.mlp.fc_1.weight",
                  f"{_H0}.mlp.proj.weight"],
    "lit-pythia": [f"{_H0}.attn.qkv.weight", f"{_H0}.attn.proj.weight", f"{_H0}.mlp.fc.weight"],
    "lit-gemma2": [f"{_H0}.attn.qkv.weight", f"{_H0}.attn.proj.weight", f"{_H0}.mlp.fc_2.weight"],
    "lit-gemma3": [f"{_H0}.attn.proj.weight", f"{_H0}.mlp.fc_1.weight"],
    "lit-qwen3": [f"{_H0}.attn.qkv.weight", f"{_H0}.attn.proj.weight"],
    "lit-mixtral": [f"{_H0}.attn.qkv.weight", f"{_H0}.attn.proj.weight"],
    "lit-qwen3moe": [f"{_H0}.attn.qkv.weight", f"{_H0}.attn.proj.weight"],
}
# ... and these whole: Gemma 3's fused qkv holds one KV head for two ranks (each computes it, with its query heads)
REPLICATED: dict[str, list[str]] = {"lit-gemma3": [f"{_H0}.attn.qkv.weight"]}

RESULTS: dict[tuple[str, str], str] = {}  # (row, column) -> the cell: worst relative error, or the refusal


def _spec(row: str, column: str) -> dict[str, Any]:
    world, strategy, layers = LAYOUTS[column]
    kind = ROWS[row][0]
    spec = dict(BASE, model=kind if layers == 2 else f"{kind}-{layers}", world=world,
                strategy=dict(strategy, timeout_s=PG_TIMEOUT_S), placements=True, refusal=(row, column) in REFUSED)
    if strategy.get("tp", 1) > 1:
        spec["check_sharded"] = sorted(SHARDED.get(row, []) + REPLICATED.get(row, []))
    return spec


def _problems(row: str, column: str, got: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    label = f"{row} {column}"
    expected = REFUSED.get((row, column))
    if expected is not None:
        RESULTS[(row, column)] = "refused: " + got.get("error", "NOT REFUSED")
        return [] if expected in got.get("error", "") else [f"{label}: expected a refusal naming {expected!r}, got "
                                                              f"{got.get('error', 'a run')}"]
    if "error" in got:
        RESULTS[(row, column)] = "ERROR"
        return [f"{label}: {got['error']}"]
    errs = _errors(got, ref)
    RESULTS[(row, column)] = f"{max(errs.values()):.1e}"
    bad = [f"{label}: {name} relative error {err:.2e} > {TOL:.0e}" for name, err in errs.items() if err > TOL]
    for name, sharded in got.get("sharded", {}).items():
        want = name not in REPLICATED.get(row, [])
        if sharded is not want:
            bad.append(f"{label}: {name} should be {'sharded on tp' if want else 'whole'} (sharded={sharded})")
    if "ep" in column:
        if not any("experts" in n and "ep" in mesh for n, (mesh, _) in got.get("placements", {}).items()):
            bad.append(f"{label}: no expert parameter is sharded over an ep mesh")
    return bad


@pytest.fixture(scope="module")
def references() -> References:
    pytest.importorskip("litgpt")
    return References(BASE)


def _run(world: int, references: References) -> list[str]:
    cases = [case for case in CASES if LAYOUTS[case[1]][0] == world]
    specs = [_spec(*case) for case in cases]
    refs = [{} if s["refusal"] else references[s["model"]] for s in specs]  # before the world starts
    start = time.monotonic()
    results = merge_ranks(run_world(_zoo_world, world, specs, timeout_s=900, pg_timeout_s=PG_TIMEOUT_S))
    print(f"\nLitGPT zoo, {len(specs)} cases on {world} ranks: {time.monotonic() - start:.0f} s")
    return [p for (row, column), got, ref in zip(cases, results, refs) for p in _problems(row, column, got, ref)]


def test_two_rank_layouts(references: References) -> None:
    problems = _run(2, references)
    assert not problems, "\n".join(problems)
    _check_table()


def test_four_rank_layouts(references: References) -> None:
    problems = _run(4, references)
    assert not problems, "\n".join(problems)
    _check_table()


# ----------------------------------------------------------------------------------------------- the table
TABLE_START = "<!-- litgpt-table: written by tests/distributed/test_byom_litgpt.py -->"
TABLE_END = "<!-- /litgpt-table -->"
_SHORT = {("lit-gemma2", "cp=2"): "refused: soft-capped attention computed by hand (`attention_logit_softcapping`)"}


def table(results: dict[tuple[str, str], str]) -> str:
    """The markdown table of ``results`` (cells not run are empty)."""
    columns = [c for c in LAYOUTS if any(c == col for _, col in CASES)]
    lines = [TABLE_START, "| family (LitGPT config) | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for row, (_, what) in ROWS.items():
        cells = [_SHORT.get((row, c), results.get((row, c), "")) if (row, c) in CASES else "" for c in columns]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [TABLE_END])


def _cells(text: str) -> dict[tuple[str, str], str]:
    """``{(row, column): cell}`` of a table written by :func:`table`."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    rows = {what: row for row, (_, what) in ROWS.items()}
    out = {}
    for line in lines[2:]:
        what, *cells = [c.strip() for c in line.strip("|").split("|")]
        out.update({(rows.get(what, what), column): cell for column, cell in zip(columns, cells)})
    return out


def _check_table() -> None:
    """docs/zoo.md's LitGPT table against this run's results so far: the same cells (which layouts hold, which are
    refused and why), each figure within FIGURE_SPREAD of this run's (another CPU rounds differently);
    ``LIGHTNING_4D_WRITE_ZOO=1`` writes the run's table instead (once both worlds ran)."""
    doc = ZOO.read_text()
    assert TABLE_START in doc and TABLE_END in doc, f"docs/zoo.md has no LitGPT table ({TABLE_START})"
    written = table(RESULTS)
    if os.environ.get("LIGHTNING_4D_WRITE_ZOO") == "1":  # written once every case ran
        if len(RESULTS) == len(CASES):
            ZOO.write_text(doc[:doc.index(TABLE_START)] + written + doc[doc.index(TABLE_END) + len(TABLE_END):])
        return
    shown = _cells(doc[doc.index(TABLE_START):doc.index(TABLE_END)])
    expected = _cells(table({case: "X" for case in CASES}))
    assert {k for k, v in shown.items() if v} == {k for k, v in expected.items() if v}, (
        f"docs/zoo.md's LitGPT table has other cells than the test runs:\n{written}")
    mine = _cells(written)
    for case in RESULTS:
        doc_cell, run_cell = shown[case], mine[case]
        figure = re.fullmatch(r"\d\.\de-\d+", run_cell)
        if figure is None or re.fullmatch(r"\d\.\de-\d+", doc_cell) is None:
            assert doc_cell == run_cell, f"docs/zoo.md says {doc_cell!r} for {case}, this run {run_cell!r}"
        else:
            ratio = float(doc_cell) / float(run_cell)
            assert 1 / FIGURE_SPREAD <= ratio <= FIGURE_SPREAD, (
                f"docs/zoo.md says {doc_cell} for {case}, this run {run_cell} (run with LIGHTNING_4D_WRITE_ZOO=1)")
