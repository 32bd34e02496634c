"""Expert-parallel benchmark on a CPU/gloo world: all-to-all bytes vs formula, ep=2 vs ep=1 step time,
tokens-per-expert imbalance, grouped matmul vs per-expert loop.

Run: ``python bench/bench_expert.py [--tokens 1024 --dim 128 --hidden 256 --experts 8 --top-k 2]``.

Formulas (per rank, per MoE layer, per training step, dropless, ``N`` local tokens, fp32):
    dispatch  = combine.backward = N·k·H·4 bytes (rows sent)
    combine   = dispatch.backward = R·H·4 bytes, R = rows received (mean over ranks: N·k)
    remote share of an all-to-all with balanced routing: (ep-1)/ep
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_4d.core.comm import CommCounter
from lightning_4d.expert_parallel import MoE, apply_expert_parallel, grouped_linear
from lightning_4d.mesh import ParallelDims, build_mesh
from lightning_4d.testing import run_world


def _step(model: MoE, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()


def _time(model: MoE, x: torch.Tensor, steps: int) -> float:
    for _ in range(2):
        _step(model, x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        _step(model, x)
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def _rank_main(rank: int, cfg: dict[str, Any]) -> dict[str, float]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    n, h, f, e, k = cfg["tokens"], cfg["dim"], cfg["hidden"], cfg["experts"], cfg["top_k"]
    torch.manual_seed(0)
    base = MoE(h, f, e, k, init_std=0.02)
    x = torch.randn(1, n, h, generator=torch.Generator().manual_seed(rank)).requires_grad_()  # as in a real layer
    out: dict[str, float] = {}
    for ep in (1, world):
        mesh = build_mesh(ParallelDims.from_world(world, ep=ep), "cpu")
        model = apply_expert_parallel(MoE(h, f, e, k), mesh)
        out[f"step_s ep={ep}"] = _time(model, x, cfg["steps"])
        if ep > 1:
            with CommCounter() as c:  # the package's one recorder: every all-to-all, forward and backward
                _step(model, x)
            a2a = [r for r in c.records if r.kind == "all_to_all"]
            tokens = [r for r in a2a if r.full_bytes > e * 8]  # the per-expert counts exchange is E longs
            out["dispatch_bytes"] = tokens[0].full_bytes  # forward dispatch: N·k rows of H
            out["dispatch_bytes_formula"] = n * k * h * 4
            out["a2a_token_bytes"] = sum(r.full_bytes for r in tokens)
            out["a2a_remote_bytes"] = sum(r.sent_bytes for r in tokens)
            out["a2a_calls"] = len(a2a)
            load = model.tokens_per_expert.double()
            dist.all_reduce(load)
            out["imbalance_max_over_mean"] = float(load.max() / load.mean())
    del base
    return out


def _grouped_vs_loop(cfg: dict[str, Any]) -> tuple[float, float]:
    torch.set_num_threads(1)
    n, h, f, e = cfg["tokens"] * cfg["top_k"], cfg["dim"], cfg["hidden"], cfg["experts"]
    x, w = torch.randn(n, h), torch.randn(e, f, h)
    counts = torch.full((e,), n // e)
    counts[-1] += n - int(counts.sum())
    times = []
    for mode in (True, False):
        grouped_linear(x, w, counts, mode)
        t0 = time.perf_counter()
        for _ in range(cfg["steps"]):
            grouped_linear(x, w, counts, mode)
        times.append((time.perf_counter() - t0) / cfg["steps"])
    return times[0], times[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    cfg = vars(p.parse_args())
    world = cfg.pop("world")
    res = run_world(_rank_main, world, cfg)
    r0 = res[0]
    ep = world
    token_bytes = sum(r["a2a_token_bytes"] for r in res) / world
    remote = sum(r["a2a_remote_bytes"] for r in res) / world
    formula = 4 * cfg["tokens"] * cfg["top_k"] * cfg["dim"] * 4  # 4 token all-to-alls of N·k·H fp32 rows
    print(f"world={world} ep={ep} tokens/rank={cfg['tokens']} H={cfg['dim']} F={cfg['hidden']} "
          f"E={cfg['experts']} k={cfg['top_k']}")
    print(f"all-to-alls per layer per step: {r0['a2a_calls']} "
          "(counts + dispatch + combine forward, combine + dispatch backward)")
    print(f"dispatch bytes rank0 / formula N·k·H·4: {r0['dispatch_bytes'] / r0['dispatch_bytes_formula']:.3f}")
    print(f"token all-to-all bytes per rank per step / formula 4·N·k·H·4: {token_bytes / formula:.3f}")
    print(f"remote share of those bytes: {remote / token_bytes:.3f} (balanced routing: {(ep - 1) / ep:.3f})")
    print(f"step time ep={ep} / ep=1: {r0[f'step_s ep={ep}'] / r0['step_s ep=1']:.2f} "
          f"({r0[f'step_s ep={ep}'] * 1e3:.1f} ms vs {r0['step_s ep=1'] * 1e3:.1f} ms)")
    print(f"tokens-per-expert imbalance (global max / mean): {r0['imbalance_max_over_mean']:.3f}")
    g, loop = _grouped_vs_loop(cfg)
    print(f"grouped matmul / per-expert loop time (one projection): {g / loop:.2f} "
          f"({g * 1e3:.2f} ms vs {loop * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
