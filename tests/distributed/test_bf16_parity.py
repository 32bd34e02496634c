"""16-bit parity: ``bf16-mixed`` and ``bf16-true`` under tp, pp, ep and cp (2 ranks) and tp × pp × dp (8 ranks), each
against one process in the same precision, within :func:`lightning_4d.core.precision.parity_tolerance` (bf16's
epsilon and the model's depth; ``docs/precision.md``). Tensor parallelism runs ``loss_parallel`` under autocast
(``bf16-mixed``) and on bf16 logits (``bf16-true``); at tp=2 alone (dp·cp = 1) no FSDP2 policy casts the weights, so
autocast casts the fp32 DTensor shards as it casts one process's weights. The outputs' dtype must be the one
process's (autocast reaching every pipeline stage). An injected error — pipeline rank 0's optimizer not stepping —
must exceed the tolerance, so the check can fail. The measured errors are the tables of ``docs/measurements.md``
(:mod:`tests.distributed.bf16_cases`)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lightning_4d.testing import run_world
from tests.distributed.bf16_cases import (
    BUG, CASES, DOC, MODES, BASE, Case, Row, expected_cells, measure, parse, tolerance, update_doc, writing_docs,
)
from tests.distributed.common import fit_spec, merge_ranks


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, str], dict[str, Any]]:
    return {(model, p): fit_spec(dict(BASE, model=model, precision=p)) for model in sorted({c.model for c in CASES})
            for p in MODES}


def _world(rank: int, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    results = []
    for spec in specs:
        spec = dict(spec)
        if spec.pop("frozen_stage") and rank == 0:  # pipeline rank 0 (dp = tp = 1 in these cases)
            spec["lr"] = 0.0
        results.append(fit_spec(spec))
    return results


def _run(cases: tuple[Case, ...], world: int, references: dict[tuple[str, str], dict[str, Any]]) -> None:
    runs = [(case, p) for case in cases for p in MODES]
    results = merge_ranks(run_world(_world, world, [case.spec(p) for case, p in runs], timeout_s=900))
    measured: dict[tuple[str, str], Row] = {}
    for (case, p), got in zip(runs, results):
        row = measure(got, references[(case.model, p)])
        assert got["loss_parallel"] == ("tp" in case.strategy), (case.layout, p)  # loss_parallel under autocast
        tol = tolerance(case, p)
        measured[(p, case.layout)] = row
        label = f"{case.layout} {p}: loss {row.loss:.2e} (tol {tol.loss:.2e}), grad {row.grad:.2e} " \
                f"(tol {tol.grad:.2e}, {row.worst})"
        if case.frozen_stage:
            assert row.grad > tol.grad, f"the injected error hides below the tolerance: {label}"
        else:
            assert row.loss <= tol.loss and row.grad <= tol.grad, label
    if writing_docs():
        update_doc(measured)
        return
    written = parse(DOC.read_text())
    for case, p in runs:
        cells = written.get((p, case.layout))
        stale = f"docs/measurements.md's bf16 table: regenerate with LIGHTNING_4D_WRITE_DOCS=1 ({case.layout}, {p})"
        assert cells is not None, stale
        assert {k: cells[k] for k in expected_cells(case, p)} == expected_cells(case, p), stale


def test_bf16_parity_two_ranks(references: dict[tuple[str, str], dict[str, Any]]) -> None:
    _run((*[c for c in CASES if c.world == 2], BUG), 2, references)


def test_bf16_parity_tp_pp_dp(references: dict[tuple[str, str], dict[str, Any]]) -> None:
    _run(tuple(c for c in CASES if c.world == 8), 8, references)
