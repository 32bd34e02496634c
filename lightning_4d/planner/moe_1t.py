"""The reference 1T MoE (``conf/model/moe_1t.yaml``) on 512 and 1024 GPUs: what fits on 80 GB and 141 GB devices and the best layouts.

Sequence 4096 and a global batch of 1024 sequences (4.2 M tokens per step). Two parts:

1. **The reference layout** (``conf/parallel/moe_1t.yaml``: TP = 8 with SP and EP = 8 inside a node, PP stages across nodes, DP copies):
   for every pipeline depth, schedule, checkpointing and data-parallel mode the runtime accepts, the
   peak memory per GPU and whether it fits, and the fastest fitting variant.
2. **The best layout** from :func:`lightning_4d.planner.search` (ranked by step time with the replayed
   bubble; the search varies tp, pp, ep, dp mode, schedule, micro-batches, AC and SP).

Run ``python -m lightning_4d.planner.moe_1t --write docs/moe_1t_plan.md`` (``tests/unit/test_moe_1t_plan.py`` fails
when the file is not what :func:`document` gives). ``peak GB`` is the larger of the training step's and set-up's
peaks per GPU, ``set-up GB`` the set-up peak alone (:mod:`lightning_4d.planner.setup_memory`).

Example:
    >>> rows = seed_layout_rows(512, H200_CLUSTER_DEVICE, pps=(4,), schedules=("1f1b",), acs=("full",))
    >>> rows[0]["fits"] in (True, False)
    True
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional, Sequence

from lightning_4d.pipeline.schedules import default_virtual_stages
from lightning_4d.planner.hardware import H100, H200, ClusterSpec, DeviceSpec
from lightning_4d.planner.memory import memory_per_rank, stage_layout
from lightning_4d.planner.roofline import estimate_step
from lightning_4d.planner.search import NoLayoutFits, _runtime_accepts, search

if TYPE_CHECKING:
    from lightning_4d.planner.search import Candidate
from lightning_4d.planner.spec import TrainSpec, seed_moe_1t

__all__ = ["SEQ_LEN", "GLOBAL_BATCH", "H200_CLUSTER_DEVICE", "seed_layout_rows", "best_layouts", "report", "document",
           "main"]

SEQ_LEN = 4096
GLOBAL_BATCH = 1024  # sequences: 4.2 M tokens per step
H200_CLUSTER_DEVICE = H200
_GB = 1e9


def seed_layout_rows(world: int, device: DeviceSpec, pps: Sequence[int] = (4, 8, 16),
                     schedules: Sequence[str] = ("1f1b", "interleaved_1f1b", "zbv"),
                     acs: Sequence[Optional[str]] = ("selective", "full"),
                     modes: Sequence[str] = ("fsdp", "hsdp"), microbatches: Sequence[int] = (16, 32, 64),
                     eps: Sequence[int] = (8,)) -> list[dict[str, Any]]:
    """The reference layout family (tp = 8 + SP, ep = 8 by default) on ``world`` GPUs: one row per variant the
    runtime accepts, with peak memory, fit and (when it fits) the estimate."""
    spec = seed_moe_1t(SEQ_LEN)
    cluster = ClusterSpec(world // 8, 8, device)
    out = []
    for pp, ep in [(pp, ep) for pp in pps for ep in eps]:
        dp = world // (8 * pp)
        if (dp * 8) % ep:
            continue
        for schedule in schedules:
            v = default_virtual_stages(schedule, pp)
            for mode in modes:
                shard = 1 if mode == "hsdp" else None  # tp = 8 fills a node: one dp rank per node
                for ac in acs:
                    for m in microbatches:
                        if GLOBAL_BATCH % (dp * m):
                            continue
                        dims = _runtime_accepts(world, 8, pp, ep, True, m, schedule, v, mode, ac, shard)
                        if dims is None:
                            continue
                        train = TrainSpec(GLOBAL_BATCH, seq_len=SEQ_LEN, microbatches=m, schedule=schedule,
                                          data_parallel=mode, dp_shard=shard, activation_checkpointing=ac)
                        layout = stage_layout(spec, dims, schedule)
                        mem = memory_per_rank(spec, dims, train, layout, device.allocator_overhead)
                        peak = max(r.peak for r in mem)
                        row = {"pp": pp, "ep": ep, "dp": dp, "schedule": schedule, "m": m, "b": mem[0].micro_batch_size,
                               "mode": mode, "ac": ac or "none", "peak_gb": peak / _GB,
                               "setup_gb": max(r.setup_total for r in mem) / _GB,
                               "fits": peak <= device.usable_bytes, "parts": max(mem, key=lambda r: r.peak)}
                        if row["fits"]:
                            est = estimate_step(spec, dims, train, cluster, layout=layout)
                            row.update(step_s=est.step_s, mfu=est.mfu, bubble=est.bubble,
                                       tokens_per_s=est.tokens_per_s, bottleneck=est.bottleneck)
                        out.append(row)
    return out


def best_layouts(world: int, device: DeviceSpec, top: int = 3) -> list[Candidate]:
    """The search's fastest layouts of the 1T MoE on ``world`` GPUs (tp ≤ 8 inside a node)."""
    spec = seed_moe_1t(SEQ_LEN)
    return search(spec, ClusterSpec(world // 8, 8, device), TrainSpec(GLOBAL_BATCH, seq_len=SEQ_LEN), top=top,
                  schedules=("1f1b", "interleaved_1f1b", "zbv"), activation_checkpointing=("selective", "full"),
                  sequence_parallel=(True,), data_parallel=("fsdp", "hsdp"),
                  context_parallel=(1,))  # 4096-token sequences: context parallelism is for longer ones


def _fmt_seed(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| pp | ep | dp | schedule | m | b | dp mode | AC | peak GB | set-up GB | fits | step s | MFU | bubble |",
             "|---:|---:|---:|---|---:|---:|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        est = (f"{r['step_s']:.2f} | {r['mfu']:.1%} | {r['bubble']:.1%}" if r["fits"] else "– | – | –")
        lines.append(f"| {r['pp']} | {r['ep']} | {r['dp']} | {r['schedule']} | {r['m']} | {r['b']} | {r['mode']} | "
                     f"{r['ac']} | "
                     f"{r['peak_gb']:.0f} | {r['setup_gb']:.1f} | {'yes' if r['fits'] else 'no'} | {est} |")
    return lines


def report() -> str:
    """The whole plan as markdown."""
    spec = seed_moe_1t(SEQ_LEN)
    out = [f"Model: seed_moe_1t, {spec.total_params() / 1e12:.2f} T parameters, "
           f"{spec.active_params_per_token() / 1e9:.1f} B active per token; sequence {SEQ_LEN}, global batch "
           f"{GLOBAL_BATCH} sequences ({GLOBAL_BATCH * SEQ_LEN / 1e6:.1f} M tokens).", ""]
    for device in (H100, H200):
        for world in (512, 1024):
            rows = seed_layout_rows(world, device)
            wide = seed_layout_rows(world, device, eps=(64,))
            fit = [r for r in rows if r["fits"]]
            out += [f"## {world} × {device.name} (usable {device.usable_bytes / _GB:.0f} GB)", "",
                    "### The reference layout (TP 8 + SP, EP 8, PP across nodes)", ""]
            smallest = min(rows, key=lambda r: r["peak_gb"]) if rows else None
            if fit:
                best = min(fit, key=lambda r: r["step_s"])
                out.append(f"{len(fit)} of {len(rows)} variants fit. Fastest: pp={best['pp']} {best['schedule']} "
                           f"m={best['m']} {best['mode']} AC={best['ac']}: {best['step_s']:.2f} s/step, "
                           f"MFU {best['mfu']:.1%}, {best['peak_gb']:.0f} GB.")
            elif smallest is not None:
                p = smallest["parts"]
                out.append(f"Nothing fits: the smallest peak is {smallest['peak_gb']:.0f} GB (pp={smallest['pp']} "
                           f"{smallest['schedule']} {smallest['mode']} AC={smallest['ac']}): states "
                           f"{(p.params + p.grads + p.optimizer) / _GB:.0f} GB, gathered/unsharded "
                           f"{p.unsharded / _GB:.0f} GB, activations {p.activations / _GB:.0f} GB, logits "
                           f"{p.logits / _GB:.0f} GB.")
            order = lambda r: (not r["fits"], r.get("step_s", 0), r["peak_gb"])  # noqa: E731
            out += [""] + _fmt_seed(sorted(rows, key=order)[:10]) + [""]
            wfit = [r for r in wide if r["fits"]]
            out += ["Same with EP = 64 (every expert on one GPU of a stage: the experts are not replicated over "
                    f"edp): {len(wfit)} of {len(wide)} variants fit.", ""]
            out += _fmt_seed(sorted(wide, key=order)[:6]) + [""]
            out += ["### Best layouts (search)", ""]
            try:
                for i, c in enumerate(best_layouts(world, device), 1):
                    out.append(f"{i}. `{c.label}` sp={c.dims.sp} dp_mode={c.train.data_parallel} "
                               f"AC={c.train.activation_checkpointing}: {c.reason}")
            except NoLayoutFits as err:
                out.append(f"No layout fits: {err}")
            out.append("")
    return "\n".join(out)


def document(text: Optional[str] = None) -> str:
    """``docs/moe_1t_plan.md``: a generated-file header and the :func:`report` (or ``text``).

    Example:
        >>> document("body").splitlines()[2]
        '# moe_1t on 512 and 1024 GPUs'
    """
    return ("<!-- generated by `python -m lightning_4d.planner.moe_1t --write docs/moe_1t_plan.md` -->\n\n"
            "# moe_1t on 512 and 1024 GPUs\n\n" + (report() if text is None else text) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    """Print the plan; ``--write PATH`` also saves it (:func:`document`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", default=None)
    args = ap.parse_args(argv)
    text = report()
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(document(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
