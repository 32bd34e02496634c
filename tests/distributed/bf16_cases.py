"""The 16-bit parity cases of ``tests/distributed/test_bf16_parity.py`` and their tables in ``docs/measurements.md``.

One owner for the cases, the tolerance of each (:func:`lightning_4d.core.precision.parity_tolerance` for its model's
depth and its batch's target tokens), the errors measured against one process, and the markdown they are written
as. ``LIGHTNING_4D_WRITE_DOCS=1 python -m pytest tests/distributed/test_bf16_parity.py`` rewrites the measured rows;
``tests/unit/test_bf16_parity_doc.py`` checks the tables against the cases and the tolerance without running them.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_4d.core.precision import ParityTolerance, parity_tolerance
from tests.distributed.common import SEQ, build_model, make_dataset, rel_err

MODES = ("bf16-mixed", "bf16-true")
#: Two optimizer steps: the losses of both and the gradients of the second (taken after one update) are compared.
BASE: dict[str, Any] = dict(steps=2, global_batch=8, predict=True)
DOC = Path(__file__).resolve().parents[2] / "docs" / "measurements.md"
BEGIN, END = "<!-- bf16-parity: begin (generated) -->", "<!-- bf16-parity: end -->"
WRITE_ENV = "LIGHTNING_4D_WRITE_DOCS"


@dataclass(frozen=True)
class Case:
    """One layout of the tables: its name, the model kind (:func:`tests.distributed.common.build_model`), the
    strategy options and the world. ``frozen_stage`` injects a real error: pipeline rank 0's optimizer does not
    step (its learning rate is 0), as if its parameters were left out of the optimizer."""

    layout: str
    model: str
    strategy: dict[str, Any] = field(hash=False)
    world: int
    frozen_stage: bool = False

    def spec(self, precision: str) -> dict[str, Any]:
        """The spec of :func:`tests.distributed.common.fit_spec` for this case in ``precision``."""
        return dict(BASE, model=self.model, precision=precision, world=self.world, strategy=dict(self.strategy),
                    frozen_stage=self.frozen_stage)


CASES = (
    Case("tp=2", "llama", {"tp": 2}, 2),
    Case("pp=2", "llama", {"pp": 2}, 2),
    # Every token to every expert: a top-k choice is discrete, and in 16 bits the rounding differences between any
    # two summation orders flip near-tied choices (one token moved changes an expert's gradient by ~10 % at this
    # size, in one process too against fp32); the choice itself is held to fp32 parity by the MoE tests.
    Case("ep=2", "moe-all", {"ep": 2}, 2),
    Case("cp=2", "llama", {"cp": 2}, 2),
    Case("tp=2 × pp=2 × dp=2", "llama", {"tp": 2, "pp": 2}, 8),
)
#: The injected error each mode's table shows caught.
BUG = Case("pp=2, stage 0 not stepping (injected error)", "llama", {"pp": 2}, 2, frozen_stage=True)


def target_tokens(steps: int, global_batch: int) -> int:
    """The fewest target tokens (not ignored) in one global batch of the reference's order (:func:`fit_spec`)."""
    data = make_dataset(global_batch * steps)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    targets = data.tensors[1][order]
    return min(int((targets[i * global_batch:(i + 1) * global_batch] != -100).sum()) for i in range(steps))


def tolerance(case: Case, precision: str) -> ParityTolerance:
    """The case's tolerance: its model's blocks and its batches' target tokens."""
    with torch.device("meta"):
        blocks = len(build_model(case.model).layers)
    return parity_tolerance(precision, blocks, target_tokens(BASE["steps"], BASE["global_batch"]))


@dataclass(frozen=True)
class Row:
    """What one case measured against one process: the worst loss and gradient relative errors."""

    loss: float
    grad: float
    worst: str  # the parameter of the worst gradient error


def measure(got: dict[str, Any], ref: dict[str, Any]) -> Row:
    """The worst relative error of the losses (per step) and of the gradients (per parameter, by norm).

    Raises ``AssertionError`` when the two runs do not hold the same steps and parameters, or when the outputs'
    dtypes differ (a layout that lost autocast computes in another dtype, which a 16-bit tolerance cannot see)."""
    assert len(got["losses"]) == len(ref["losses"]), (got["losses"], ref["losses"])
    assert set(ref["grads"]) <= set(got["grads"]), set(ref["grads"]) - set(got["grads"])
    assert got["prediction_dtype"] == ref["prediction_dtype"], (got["prediction_dtype"], ref["prediction_dtype"])
    assert all(math.isfinite(x) for x in got["losses"]), got["losses"]
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    errors = {name: rel_err(got["grads"][name], g) for name, g in ref["grads"].items()}
    worst = max(errors, key=errors.__getitem__)
    return Row(loss, errors[worst], worst.removeprefix("model."))


# ---------------------------------------------------------------------------------------------- the tables
def _fmt(x: float) -> str:
    return f"{x:.2e}"


def _rows_text(rows: dict[tuple[str, str], Row], precision: str) -> list[str]:
    lines = [f"**{precision}**", "",
             "| layout | ranks | model | loss rel. error | loss tolerance | gradient rel. error | gradient tolerance "
             "| worst parameter |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for case in (*CASES, BUG):
        row = rows.get((precision, case.layout))
        if row is None:
            continue
        tol = tolerance(case, precision)
        lines.append(f"| {case.layout} | {case.world} | {case.model} | {_fmt(row.loss)} | {_fmt(tol.loss)} | "
                     f"{_fmt(row.grad)} | {_fmt(tol.grad)} | `{row.worst}` |")
    return lines


def render(rows: dict[tuple[str, str], Row]) -> str:
    """The generated part of the doc's section: one table per mode."""
    lines = [BEGIN]
    for precision in MODES:
        lines += _rows_text(rows, precision) + [""]
    return "\n".join(lines[:-1] + [END])


_ROW = re.compile(r"^\| (?P<layout>[^|]+?) \| (?P<world>\d+) \| (?P<model>[^|]+?) \| (?P<loss>[^|]+?) \| "
                  r"(?P<loss_tol>[^|]+?) \| (?P<grad>[^|]+?) \| (?P<grad_tol>[^|]+?) \| `(?P<worst>[^`]*)` \|$")


def parse(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """The doc's rows: ``(precision, layout) -> cells`` (strings as written)."""
    if BEGIN not in text or END not in text:
        return {}
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows: dict[tuple[str, str], dict[str, str]] = {}
    precision = ""
    for line in body.splitlines():
        if line.startswith("**") and line.endswith("**"):
            precision = line.strip("*")
        elif (match := _ROW.match(line)) is not None:
            rows[(precision, match["layout"])] = match.groupdict()
    return rows


def expected_cells(case: Case, precision: str) -> dict[str, str]:
    """The cells of a row that follow from the code alone (layout, ranks, model, tolerances)."""
    tol = tolerance(case, precision)
    return {"layout": case.layout, "world": str(case.world), "model": case.model, "loss_tol": _fmt(tol.loss),
            "grad_tol": _fmt(tol.grad)}


def update_doc(measured: dict[tuple[str, str], Row]) -> None:
    """Rewrite the doc's generated tables with ``measured`` (rows not measured now are kept as written)."""
    text = DOC.read_text()
    rows = {key: Row(float(c["loss"]), float(c["grad"]), c["worst"]) for key, c in parse(text).items()}
    rows.update(measured)
    block = render(rows)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        raise AssertionError(f"{DOC.name} has no {BEGIN} … {END} block to write the tables into")
    DOC.write_text(text)


def writing_docs() -> bool:
    """Whether this run rewrites the doc's tables (``LIGHTNING_4D_WRITE_DOCS=1``)."""
    return os.environ.get(WRITE_ENV) == "1"
