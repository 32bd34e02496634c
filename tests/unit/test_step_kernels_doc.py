"""The generated block of ``docs/measurements.md`` (written by ``bench/bench_step_kernels.py --markdown``) holds what
the docs say of it: every ratio is its row's before / after time, the block is the bench's own output format, the
fp32 MoE step is faster on one grouped GEMM than on the per-expert loop, and the fused and foreach optimizer steps
over DTensor parameters are faster than ``foreach=False``, fused the fastest. A re-run that broke a claim fails
here (then fix the code or the claim)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "measurements.md"


def _bench():
    path = REPO / "bench" / "bench_step_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_step_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tables() -> tuple[list[list[str]], list[list[str]]]:
    bench = _bench()
    text = DOC.read_text()
    block = text.split(bench.BEGIN, 1)[1].split(bench.END, 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()
            if line.startswith("| ") and not line.startswith("| dtype") and not line.startswith("| kernel")]
    return [r for r in rows if len(r) == 5], [r for r in rows if len(r) == 3]


def test_the_block_is_the_bench_output_and_its_ratios_are_its_times() -> None:
    moe, opt = _tables()
    assert [r[0] for r in moe] == ["fp32", "bf16 autocast"]
    assert [r[0] for r in opt] == ["foreach=False", "foreach", "fused"]
    for dtype, _tokens, loop, grouped, ratio in moe:
        assert abs(float(ratio) - float(loop) / float(grouped)) <= 0.01, dtype
    before = float(opt[0][1])
    for kernel, ms, ratio in opt:
        assert abs(float(ratio) - before / float(ms)) <= 0.01, kernel
    # the bench writes this very format (a change of one without the other fails)
    bench = _bench()
    cfg = dict(repeats=1, steps=1, experts=8, dim=256, hidden=512, layers=8)
    rendered = bench.markdown(cfg, [{"dtype": "fp32", "tokens": 1, "loop_ms": 2.0, "grouped_ms": 1.0, "ratio": 2.0}],
                              [{"kernel": "fused", "ms": 1.0, "ratio": 1.0, "params": 80}])
    assert "| fp32 | 1 | 2.00 | 1.00 | 2.00 |" in rendered and "| fused | 1.00 | 1.00 |" in rendered


def test_grouped_gemm_and_fused_kernels_are_faster() -> None:
    moe, opt = _tables()
    fp32 = next(r for r in moe if r[0] == "fp32")
    assert float(fp32[4]) > 1.0, "the fp32 MoE step should be faster on one grouped GEMM than on the loop"
    ratios = {kernel: float(ratio) for kernel, _ms, ratio in opt}
    assert ratios["foreach"] > 1.0 and ratios["fused"] > 1.0, ratios
    assert ratios["fused"] == max(ratios.values()), ratios
