"""``bench/gpu_smoke.py --dry-run``: the GPU smoke run's own code on CPU at tiny sizes (2-rank worlds on a
``cpu:gloo`` group, the path ``cuda:gloo`` takes on the GPU). Every case passes and reports its figures, and
``docs/gpu_smoke.md`` lists exactly the script's cases with what each checks."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _doc_cases() -> dict[str, str]:
    text = (REPO / "docs" / "gpu_smoke.md").read_text()
    return {m["name"]: m["checks"] for m in re.finditer(r"^\| `(?P<name>[\w-]+)` \| (?P<checks>[^|]+?) \|$", text,
                                                          re.MULTILINE)}


def test_gpu_smoke_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_smoke.py"), "--dry-run", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    failed = {c["name"]: (c.get("error"), c.get("traceback")) for c in report["cases"] if not c["ok"]}
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    assert report["dry_run"] and report["backend"] == "cpu:gloo" and report["failed"] == 0
    cases = {c["name"]: c for c in report["cases"]}
    assert _doc_cases() == {name: c["checks"] for name, c in cases.items()}, "docs/gpu_smoke.md's case table"
    one = cases["one-rank-llama-1b"]
    for key in ("setup_s", "step_s", "plain_step_s", "step_over_plain", "mfu", "plain_mfu", "planner_allocated_bytes"):
        assert isinstance(one[key], float) and one[key] > 0 and math.isfinite(one[key]), (key, one[key])
    assert one["host_syncs_per_step"] is None and one["peak_allocated_bytes"] is None  # CUDA's figures only
    assert len(one["losses"]) == report["sizes"]["warmup"] + 1  # not read inside the timed window but its end
    for name, case in cases.items():
        if "loss_tolerance" in case:  # 16-bit worlds: within the parity tolerance of one process
            assert case["loss_rel_err"] <= case["loss_tolerance"], (name, case)
        elif "loss_rel_err" in case:  # fp32 worlds against one process, same initial weights and sequences
            assert case["loss_rel_err"] < 1e-5, (name, case)
    assert cases["tp2-bf16-save"]["checkpoint_bytes"] > 0
