"""``docs/gpu_smoke.md`` quotes ``bench/gpu_smoke.py``: its cases (name and what each checks), its GPU sizes, its
budget and the peak FLOP/s its MFU divides by — each read here from the script and the planner, so the page cannot
drift from the code."""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "gpu_smoke.md").read_text()


@functools.cache
def _script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "bench" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_smoke", module)  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_case_table_is_the_scripts_case_list() -> None:
    rows = {m["name"]: m["checks"] for m in re.finditer(r"^\| `(?P<name>[\w-]+)` \| (?P<checks>[^|]+?) \|$", DOC,
                                                          re.MULTILINE)}
    assert rows == {case.name: case.checks for case in _script().CASES}


def test_quoted_sizes_are_the_scripts() -> None:
    smoke = _script()
    s, c = smoke.GPU_SIZES, smoke.GPU_SIZES.llama
    with torch.device("meta"):
        params = smoke.Llama(c).num_params()
    quoted = (f"{c.n_layers} blocks of width {c.dim},\n{c.n_heads} heads over {c.n_kv_heads} K/V heads, SwiGLU "
              f"{c.ffn_hidden}, a {c.vocab_size // 1000}k vocabulary ({params / 1e9:.1f} B parameters)")
    assert quoted in DOC, quoted
    assert f"on {s.batch} sequences of {s.seq} tokens: {s.warmup} warm-up steps, then {s.steps} timed steps" in DOC
    assert f"for {s.world_steps} steps on the same {s.world_batch} sequences" in DOC
    assert f"`--budget-s` (default {smoke.BUDGET_S:.0f})" in DOC and "at most 8\nminutes" in DOC
    assert smoke.BUDGET_S <= 8 * 60
    readme = (REPO / "README.md").read_text()
    assert "Nothing has run on a GPU yet" in readme and "(one H100/H200, at most 8 minutes)" in readme
    from lightning_4d.planner import H100, H200

    assert H100.peak_flops == H200.peak_flops == 989e12 and "989 TFLOP/s dense bf16" in DOC
    from lightning_4d.planner.hardware import H100_PCIE

    assert smoke.planner_device("NVIDIA H100 80GB HBM3") is H100 and smoke.planner_device("NVIDIA H200") is H200
    assert smoke.planner_device("NVIDIA H100 PCIe") is H100_PCIE and smoke.planner_device("Tesla T4") is None
