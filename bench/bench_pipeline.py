"""Pipeline bubble and activation memory: measured on the real torch schedules vs theory.

Uniform blocks whose cost is a fixed sleep (no CPU contention between ranks): forward ``t``,
input-gradient backward ``t``, weight-gradient backward ``t`` per block (so F = 1, B = 2, I = W = 1
in the units of :mod:`lightning_4d.pipeline.bubble`). With p = 4 ranks and 8 blocks, 1F1B runs 2
blocks per stage, interleaved 1F1B and ZBV run 2 chunks of 1 block per rank, so every rank does
the same work per step. For m in {4, 8, 16}: the measured bubble share (instrumented schedule
step, mean over ranks and steps), the replay of torch's action table and the closed form.

Second table: peak bytes of activations saved for backward on stage 0 (``saved_tensors_hooks``),
1F1B vs GPipe; 1F1B keeps at most p micro-batches in flight, GPipe all m (expected ratio m / p).

Run: ``python bench/bench_pipeline.py [--sleep-ms 20] [--steps 3]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_4d.pipeline import (  # noqa: E402
    PipelineRunner,
    bubble_from_actions,
    bubble_theory,
    build_pipeline_stages,
    get_schedule_info,
)
from lightning_4d.pipeline.instrument import PipelineInstrument, bubble_share  # noqa: E402
from lightning_4d.testing import run_world  # noqa: E402

PP, BLOCKS, DIM, BATCH = 4, 8, 16, 16
LAYOUTS = [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)]
MICROBATCHES = (4, 8, 16)


class _SleepInput(torch.autograd.Function):
    """Identity on the activation path: sleeps ``t`` forward and ``t`` in the input-gradient pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: float) -> torch.Tensor:
        ctx.t = t
        if t:
            time.sleep(t)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.t:
            time.sleep(ctx.t)
        return grad, None


class _SleepWeight(torch.autograd.Function):
    """Identity on the weight path: its backward (``t``) runs only in the weight-gradient pass."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, t: float) -> torch.Tensor:
        ctx.t = t
        return w.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.t:
            time.sleep(ctx.t)
        return grad, None


class SleepBlock(nn.Module):
    """``x * w`` with fixed costs: F = t, I = t, W = t (activations ``(B, DIM)`` saved for backward)."""

    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = t
        self.w = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepInput.apply(x, self.t) * _SleepWeight.apply(self.w, self.t)  # (B, DIM)


class SleepNet(nn.Module):
    def __init__(self, t: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SleepBlock(t) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _measure_bubble(rank: int, sleep_s: float, steps: int) -> dict[str, float]:
    import torch.distributed as dist

    results: dict[str, float] = {}
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    for name, v in LAYOUTS:
        for m in MICROBATCHES:
            parts = build_pipeline_stages(SleepNet(sleep_s), rank, PP, v, get_schedule_info(name).style)
            runner = PipelineRunner(parts.modules, dist.group.WORLD, _loss, schedule=name, microbatches=m)
            inst = PipelineInstrument.attach_to(runner)
            for _ in range(steps + 1):  # step 0 also runs torch's shape inference: skipped
                dist.barrier()
                runner.train_step(x, y)
            events = inst.gather()
            shares = bubble_share(events, by="rank", skip_steps=1)
            results[f"{name}/{m}"] = sum(shares.values()) / len(shares)
    return results


class _Saved:
    """A tensor saved for backward, counted while alive."""

    live = 0
    peak = 0

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.nbytes = t.numel() * t.element_size()
        _Saved.live += self.nbytes
        _Saved.peak = max(_Saved.peak, _Saved.live)

    def __del__(self) -> None:
        _Saved.live -= self.nbytes


def _pack(t: torch.Tensor) -> Any:
    return t if isinstance(t, nn.Parameter) else _Saved(t)


def _unpack(obj: Any) -> torch.Tensor:
    return obj.t if isinstance(obj, _Saved) else obj


def _measure_memory(rank: int) -> dict[str, int]:
    import torch.distributed as dist

    results: dict[str, int] = {}
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    for name in ("1f1b", "gpipe"):
        for m in MICROBATCHES:
            parts = build_pipeline_stages(SleepNet(0.0), rank, PP)
            module = parts.modules[0]
            plain_forward = module.forward

            def counted_forward(*args: Any, _f: Any = plain_forward) -> Any:
                with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                    return _f(*args)

            module.forward = counted_forward  # type: ignore[method-assign]
            runner = PipelineRunner(parts.modules, dist.group.WORLD, _loss, schedule=name, microbatches=m)
            runner.train_step(x, y)  # shape inference happens here
            _Saved.live = _Saved.peak = 0
            runner.train_step(x, y)
            results[f"{name}/{m}"] = _Saved.peak
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleep-ms", type=float, default=20.0, help="cost of one block's F, I or W")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    args = parser.parse_args()

    t0 = time.perf_counter()
    measured = run_world(_measure_bubble, PP, args.sleep_ms / 1000.0, args.steps)[0]
    print(f"Bubble share of the step, p={PP}, {BLOCKS} uniform blocks, sleep {args.sleep_ms:g} ms per block "
          f"per F/I/W (mean over ranks, {args.steps} steps)\n")
    print(f"{'schedule':<18}{'m':>4}{'theory':>9}{'replay':>9}{'measured':>10}{'meas/theory':>13}")
    for name, v in LAYOUTS:
        for m in MICROBATCHES:
            theory = bubble_theory(name, PP, m, v)
            replay = bubble_from_actions(name, PP, v, m)
            got = measured[f"{name}/{m}"]
            print(f"{name:<18}{m:>4}{theory:>9.3f}{replay:>9.3f}{got:>10.3f}{got / theory:>13.2f}")
    print("\nPeak activation bytes saved for backward on stage 0 (1F1B vs GPipe)\n")
    mem = run_world(_measure_memory, PP)[0]
    print(f"{'m':>4}{'1F1B KiB':>11}{'GPipe KiB':>11}{'GPipe/1F1B':>12}{'expected m/p':>14}")
    for m in MICROBATCHES:
        a, b = mem[f"1f1b/{m}"], mem[f"gpipe/{m}"]
        print(f"{m:>4}{a / 1024:>11.1f}{b / 1024:>11.1f}{b / a:>12.2f}{max(1.0, m / PP):>14.2f}")
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
