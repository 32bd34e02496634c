"""``docs/measurements.md``'s bf16 parity tables (written by ``tests/distributed/test_bf16_parity.py``) against the
code, without running them: one row per case and mode, the tolerances recomputed by
:func:`lightning_4d.core.precision.parity_tolerance`, every layout within them and the injected error above them. A
changed case list, model, batch or tolerance formula fails here until the tables are regenerated."""

from __future__ import annotations

import torch

from tests.distributed.bf16_cases import BASE, BUG, CASES, DOC, MODES, expected_cells, parse, target_tokens, tolerance
from tests.distributed.common import SEQ


def test_tables_hold_every_case_with_the_codes_tolerances() -> None:
    rows = parse(DOC.read_text())
    expected = {(p, case.layout): case for case in (*CASES, BUG) for p in MODES}
    assert set(rows) == set(expected), "regenerate with LIGHTNING_4D_WRITE_DOCS=1 python -m pytest " \
                                       "tests/distributed/test_bf16_parity.py"
    for (p, _), case in expected.items():
        cells = rows[(p, case.layout)]
        assert {k: cells[k] for k in expected_cells(case, p)} == expected_cells(case, p), (p, case.layout)
        loss, grad = float(cells["loss"]), float(cells["grad"])
        if case.frozen_stage:
            assert grad > float(cells["grad_tol"]), (p, case.layout, cells)
        else:
            assert loss <= float(cells["loss_tol"]) and grad <= float(cells["grad_tol"]), (p, case.layout, cells)


def test_the_tables_cover_the_layouts_the_issue_names() -> None:
    layouts = {c.layout for c in CASES}
    assert {"tp=2", "pp=2", "ep=2", "cp=2", "tp=2 × pp=2 × dp=2"} <= layouts
    assert set(MODES) == {"bf16-mixed", "bf16-true"}


def test_precision_page_quotes_the_tables_tolerances() -> None:
    """``docs/precision.md`` quotes the tolerances of the tables' models: recomputed here."""
    page = (DOC.parent / "precision.md").read_text()
    eps = torch.finfo(torch.bfloat16).eps
    mixed, true = tolerance(CASES[0], "bf16-mixed"), tolerance(CASES[0], "bf16-true")
    tokens = BASE["global_batch"] * SEQ
    ignored = round(100 * (1 - target_tokens(BASE["steps"], BASE["global_batch"]) / tokens), -1)
    quoted = (f"(2 blocks; {tokens} tokens per batch, of which {ignored:.0f} % are ignored), this gives a gradient "
              f"tolerance\nof {mixed.grad:.1e} ({mixed.grad / eps:.1f} eps) and a loss tolerance of {mixed.loss:.1e} "
              f"(`bf16-mixed`) or {true.loss:.1e} (`bf16-true`)")
    assert quoted in page, quoted


def test_measurements_page_describes_the_cases_run() -> None:
    """The section's description (models, batch, steps) is the cases' own."""
    from tests.distributed.common import build_model

    with torch.device("meta"):
        llama, moe = build_model("llama"), build_model("moe")
    text = DOC.read_text()
    quoted = (f"Llama ({len(llama.layers)} blocks, dim {llama.config.dim}) or MoE transformer ({len(moe.layers)} "
              f"blocks, {moe.moe_config.num_experts} experts, top-{moe.moe_config.top_k}), a global batch of "
              f"{BASE['global_batch']} sequences of {SEQ}\ntokens, two AdamW steps (lr 1e-3)")
    assert quoted in text and BASE["steps"] == 2 and "lr" not in BASE, quoted  # fit_spec's default lr is 1e-3
