"""The step's fast kernels on CPU, before and after: experts on one grouped GEMM against the per-expert loop, and the
optimizer step with ``foreach`` / ``fused`` kernels over DTensor parameters against ``foreach=False``.

1. **MoE layer step** (one process): forward + backward of the package's :class:`~lightning_4d.expert_parallel.MoE`
   (``--experts`` experts, top-2, ``--tokens`` tokens of width ``--dim``, expert hidden ``--hidden``; ``--bf16-tokens``
   under autocast, whose bf16 matmuls are slow on a CPU), its experts
   run by ``torch.nn.functional.grouped_mm`` (``grouped_mm=True``) and by the per-expert loop (``False``, which also
   copies the counts to the host), in fp32 and under ``torch.autocast("cpu", torch.bfloat16)`` (the experts' fp32
   weights then run in bf16 in both).
2. **Optimizer step** (a 2-rank gloo world): AdamW over the parameters of ``--layers`` Llama-shaped blocks of width
   ``--dim`` as DTensors on two meshes (the dense ``tp`` mesh: matrices ``Shard(0)``, norms ``Replicate``; a 2-D
   ``(dp, tp)`` mesh for the experts' stand-in), built with ``foreach=False`` (before; what ``CausalLM`` built) and
   with :func:`lightning_4d.core.optim.mesh_param_groups` and ``foreach=True`` or ``fused=True`` (after).

Every time is the median of ``--repeats`` runs of ``--steps`` steps, measured in the same process; the ratio is
before / after (above 1: the new kernels are faster). ``--markdown docs/measurements.md`` rewrites the generated
block of that page (``tests/unit/test_step_kernels_doc.py`` checks it).

Run: python bench/bench_step_kernels.py [--markdown docs/measurements.md]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lightning_4d.testing import run_world  # noqa: E402

BEGIN, END = "<!-- BEGIN GENERATED: step kernels -->", "<!-- END GENERATED: step kernels -->"


def _median_time(fn: Callable[[], None], steps: int, repeats: int) -> float:
    fn()  # warm-up (optimizer state, allocator)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- MoE layer
def moe_step_times(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{"dtype", "tokens", "loop_ms", "grouped_ms", "ratio"}]``: one MoE layer's forward + backward, loop vs grouped
    GEMM (bf16 on fewer tokens: this CPU's bf16 matmuls are slow)."""
    from lightning_4d.expert_parallel import MoE

    torch.set_num_threads(1)
    rows = []
    for label, dtype, tokens in (("fp32", None, cfg["tokens"]), ("bf16 autocast", torch.bfloat16, cfg["bf16_tokens"])):
        times = {}
        for grouped in (False, True):
            torch.manual_seed(0)
            layer = MoE(cfg["dim"], cfg["hidden"], cfg["experts"], top_k=2, grouped_mm=grouped)
            x = torch.randn(1, tokens, cfg["dim"], generator=torch.Generator().manual_seed(1))

            def step() -> None:
                layer.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                    out = layer(x)
                out.float().square().mean().backward()

            times[grouped] = _median_time(step, cfg["steps"], cfg["repeats"])
        rows.append({"dtype": label, "tokens": tokens, "loop_ms": times[False] * 1e3, "grouped_ms": times[True] * 1e3,
                     "ratio": times[False] / times[True]})
    return rows


# ---------------------------------------------------------------------------------------------- optimizer
def _dtensor_params(cfg: dict[str, Any]) -> list[torch.nn.Parameter]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dp_tp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    d, f = cfg["dim"], 4 * cfg["dim"]
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(cfg["layers"]):
        for shape in ((d, d), (d // 2, d), (d // 2, d), (d, d), (f, d), (d, f), (f, d)):  # wq wk wv wo w1 w2 w3
            params.append(distribute_tensor(torch.randn(shape, generator=gen) * 0.02, tp, [Shard(0)]))
        for _ in range(2):  # the two norms
            params.append(distribute_tensor(torch.ones(d), tp, [Replicate()]))
        params.append(distribute_tensor(torch.randn(4, d, d, generator=gen) * 0.02, dp_tp, [Replicate(), Shard(0)]))
    out = [torch.nn.Parameter(p) for p in params]
    for p in out:
        p.grad = torch.ones_like(p) * 1e-3
    return out


def _optimizer_world(rank: int, cfg: dict[str, Any]) -> dict[str, float]:
    from lightning_4d.core.optim import mesh_param_groups

    torch.set_num_threads(1)
    variants = {
        "foreach=False": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False),
        "foreach": lambda ps: torch.optim.AdamW(mesh_param_groups(ps), lr=1e-4, foreach=True),
        "fused": lambda ps: torch.optim.AdamW(mesh_param_groups(ps), lr=1e-4, fused=True),
    }
    out = {}
    for name, build in variants.items():
        params = _dtensor_params(cfg)
        opt = build(params)
        out[name] = _median_time(opt.step, cfg["steps"], cfg["repeats"])
    out["params"] = float(len(_dtensor_params(cfg)))
    return out


def optimizer_step_times(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{"kernel", "ms", "ratio"}]``: AdamW's step over DTensor parameters (rank 0 of a 2-rank world)."""
    result = run_world(_optimizer_world, 2, cfg, timeout_s=600)[0]
    before = result["foreach=False"]
    return [{"kernel": k, "ms": result[k] * 1e3, "ratio": before / result[k], "params": int(result["params"])}
            for k in ("foreach=False", "foreach", "fused")]


# ---------------------------------------------------------------------------------------------- output
def markdown(cfg: dict[str, Any], moe: list[dict[str, Any]], opt: list[dict[str, Any]]) -> str:
    """The generated block of docs/measurements.md."""
    lines = [BEGIN,
             f"`python bench/bench_step_kernels.py --markdown docs/measurements.md` (one CPU thread per process; "
             f"median of {cfg['repeats']} × {cfg['steps']} steps; ratio = before / after).",
             "",
             f"MoE layer forward + backward ({cfg['experts']} experts, top-2, dim {cfg['dim']}, expert hidden "
             f"{cfg['hidden']}, one process):",
             "",
             "| dtype | tokens | loop ms (before) | grouped GEMM ms (after) | ratio |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['dtype']} | {r['tokens']} | {r['loop_ms']:.2f} | {r['grouped_ms']:.2f} | {r['ratio']:.2f} |"
              for r in moe]
    lines += ["",
              f"AdamW step over {opt[0]['params']} DTensor parameters on two meshes ({cfg['layers']} Llama-shaped "
              f"blocks of width {cfg['dim']}, rank 0 of 2 gloo ranks):",
              "",
              "| kernel | step ms | ratio |",
              "|---|---:|---:|"]
    lines += [f"| {r['kernel']} | {r['ms']:.2f} | {r['ratio']:.2f} |" for r in opt]
    lines.append(END)
    return "\n".join(lines)


def write_block(path: Path, block: str) -> None:
    """Replace the generated block of ``path`` (append it when the page has none)."""
    text = path.read_text()
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--bf16-tokens", type=int, default=256, help="tokens of the bf16 row")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", type=Path, default=None, help="rewrite the generated block of this page")
    cfg = vars(parser.parse_args())
    moe = moe_step_times(cfg)
    opt = optimizer_step_times(cfg)
    block = markdown(cfg, moe, opt)
    print(block)
    if cfg["markdown"] is not None:
        write_block(cfg["markdown"], block)


if __name__ == "__main__":
    main()
