"""One plan for one layout: a JSON-ready dict, a text table, and ``plan.json``.

:func:`make_plan` gathers everything the planner computes for ``(spec, dims, cluster, train)``:
model counts, memory per role (pp rank), bytes per collective kind and mesh axis (per role and for
the busiest rank), the closed-form bubble, the step-time / MFU estimate, which axes cross nodes and
the assumptions behind the numbers. :func:`format_table` renders it; :func:`write_plan` saves it.

Example:
    >>> from lightning_4d.planner.spec import TransformerSpec, TrainSpec
    >>> from lightning_4d.planner.hardware import ClusterSpec, CPU_TOY
    >>> from lightning_4d.mesh import ParallelDims
    >>> spec = TransformerSpec(vocab_size=64, hidden=32, layers=4, heads=4, seq_len=16, name="toy")
    >>> plan = make_plan(spec, ParallelDims.from_world(4, tp=2, pp=2), ClusterSpec(1, 4, CPU_TOY),
    ...                  TrainSpec(global_batch_size=4))
    >>> plan["total_params"], sorted(plan["communication"]["busiest_rank"])
    (69920, ['pp', 'tp'])
    >>> "toy" in format_table(plan)
    True
"""

from __future__ import annotations

import json
import os
from typing import Any, Union

from lightning_4d.mesh import ParallelDims
from lightning_4d.pipeline.schedules import bubble_theory
from lightning_4d.planner.bubble import replayed_bubble
from lightning_4d.planner.comm import ROUTING_ASSUMPTION, comm_per_rank, summarize
from lightning_4d.planner.hardware import ClusterSpec, axes_crossing_nodes
from lightning_4d.planner.memory import memory_per_rank, micro_batch_size, resolve_microbatches, stage_layout
from lightning_4d.planner.roofline import estimate_step
from lightning_4d.planner.spec import TrainSpec, TransformerSpec, planner_only

__all__ = ["make_plan", "format_table", "write_plan"]

_GB = 1e9


def _replay_bubble(schedule: str, dims: ParallelDims, m: int) -> Union[float, None, str]:
    """Bubble from torch's action table (``lightning_4d.pipeline.bubble``), or a note why not."""
    if dims.pp == 1:
        return 0.0
    try:
        return replayed_bubble(schedule, dims.pp, m, dims.virtual_stages)
    except Exception as err:  # noqa: BLE001 - the replay is optional extra information
        return f"unavailable: {err}"


def make_plan(spec: TransformerSpec, dims: ParallelDims, cluster: ClusterSpec, train: TrainSpec,
              replay_bubble: bool = False) -> dict[str, Any]:
    """Everything about one layout, as a JSON-ready dict.

    Keys: ``model``, ``total_params``, ``active_params_per_token``, ``components``, ``layout``,
    ``memory`` (``per_role`` list, ``peak``, ``usable``, ``fits``), ``communication`` (``per_role``
    ``{axis: {kind: bytes}}`` lists, ``busiest_rank`` and per-call ``records`` of the busiest role),
    ``bubble`` (``theory``, optional ``replay`` from torch's schedule table), ``step`` (the estimate),
    ``mfu``, ``step_time_s``, ``assumptions``.
    """
    m = resolve_microbatches(dims, train)
    b = micro_batch_size(dims, train)
    layout = stage_layout(spec, dims, train.schedule)
    mem = memory_per_rank(spec, dims, train, layout, cluster.device.allocator_overhead, cluster.device.runtime_bytes)
    records = comm_per_rank(spec, dims, train, layout)
    crossing = axes_crossing_nodes(dims, cluster)
    est = estimate_step(spec, dims, train, cluster, records, layout, crossing)
    per_role = [summarize(r) for r in records]
    busiest = max(range(len(records)), key=lambda r: sum(x.bytes_sent for x in records[r]))
    peak = max(r.peak for r in mem)  # training step or set-up, whichever is higher
    schedule = train.schedule if dims.pp > 1 else "none"
    bubble = {"theory": bubble_theory(train.schedule if dims.pp > 1 else "1f1b", dims.pp, m, dims.virtual_stages)}
    if replay_bubble:
        bubble["replay"] = _replay_bubble(train.schedule, dims, m)
    assumptions = [
        "memory: AdamW with fp32 params, grads and two moments (16 B/param) sharded by FSDP2; bf16 compute copies",
        "activations: Korthikanti et al. 2022 per-layer formula" + (", flash attention (no s×s term)"
                                                                   if train.flash_attention else ""),
        "tp: norms, router and shared experts replicated over tp; with SP their grads are summed over tp (norms per "
        "micro-batch by DTensor, router and shared experts once per step on the FSDP shard)",
        "dp: FSDP2 units as lightning_4d.layout.parallelize wraps them (blocks reshard after forward only without "
        "pipelining); dim-0 padding of the local experts over edp included",
        f"ep: {ROUTING_ASSUMPTION} (imbalance {train.expert_imbalance:g})" if dims.ep > 1 else "ep: none",
        "time: GEMMs at a shape-dependent efficiency, memory-bound kernels at the HBM bandwidth; tp/ep/pp traffic on "
        "the critical path, dp traffic overlapped with compute; bubble of the exact schedule (closed form = replay of "
        "torch's action table); constants calibrated in docs/planner_calibration.md",
    ]
    return {
        "model": spec.name or "model",
        "total_params": spec.total_params(),
        "active_params_per_token": spec.active_params_per_token(),
        "components": spec.components(),
        "flops_per_token": spec.flops_per_token(train.seq(spec)),
        "layout": {"world_size": dims.world_size, "tp": dims.tp, "pp": dims.pp, "ep": dims.ep, "dp": dims.dp,
                   "edp": dims.edp, "cp": dims.cp, "sequence_parallel": dims.sp, "virtual_stages": dims.virtual_stages,
                   "schedule": schedule, "microbatches": m, "micro_batch_size": b,
                   "global_batch_size": train.global_batch_size, "seq_len": train.seq(spec),
                   "data_parallel": train.data_parallel, "precision": train.precision,
                   "activation_checkpointing": train.activation_checkpointing,
                   "layers_per_role": [list(x) for x in layout],
                   "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                               "device": cluster.device.name, "memory_bytes": cluster.device.memory_bytes},
                   "axes_crossing_nodes": crossing},
        "memory": {"per_role": [r.as_dict() for r in mem], "peak": peak, "usable": cluster.device.usable_bytes,
                   "fits": peak <= cluster.device.usable_bytes},
        "communication": {"per_role": per_role, "busiest_role": busiest, "busiest_rank": per_role[busiest],
                          "records": [r.as_dict() for r in records[busiest]]},
        "bubble": bubble,
        "step": est.as_dict(),
        "step_time_s": est.step_s,
        "mfu": est.mfu,
        "tokens_per_s": est.tokens_per_s,
        "tokens_per_s_per_device": est.tokens_per_s / dims.world_size,
        "model_tflops_per_device": est.model_flops / est.step_s / dims.world_size / 1e12,
        "compute_efficiency": cluster.device.compute_efficiency,
        "memory_fraction": cluster.device.memory_fraction,
        "hardware": cluster.device.constants(),
        "device": cluster.device.describe(),
        "planner_only": planner_only(train),
        "assumptions": assumptions,
    }


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 6, 7]`` -> ``"0-1,6-7"``."""
    out: list[str] = []
    for i in ids:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out) or "-"


def format_table(plan: dict[str, Any]) -> str:
    """A plain-text report of :func:`make_plan`'s dict (model, memory per role, bytes per axis, time).

    Example:
        >>> from lightning_4d.planner.hardware import CPU_TOY
        >>> spec = TransformerSpec(vocab_size=64, hidden=32, layers=2, heads=4, seq_len=16, name="toy")
        >>> plan = make_plan(spec, ParallelDims.from_world(2, tp=2), ClusterSpec(1, 2, CPU_TOY), TrainSpec(2))
        >>> print(format_table(plan).splitlines()[0])
        model toy: 37 k params, 37 k active per token
    """
    lay, mem, st = plan["layout"], plan["memory"], plan["step"]

    def n(x: float) -> str:
        for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
            if x >= scale:
                return f"{x / scale:.3g} {unit}"
        return str(x)

    cp = f"cp={lay['cp']} " if lay.get("cp", 1) > 1 else ""  # context parallelism, shown when used
    lines = [f"model {plan['model']}: {n(plan['total_params'])} params, {n(plan['active_params_per_token'])} "
             f"active per token",
             f"layout: tp={lay['tp']} pp={lay['pp']} ep={lay['ep']} dp={lay['dp']} {cp}(edp={lay['edp']}) "
             f"sp={lay['sequence_parallel']} schedule={lay['schedule']} v={lay['virtual_stages']} "
             f"m={lay['microbatches']} b={lay['micro_batch_size']} on {lay['cluster']['nodes']}×"
             f"{lay['cluster']['gpus_per_node']} {lay['cluster']['device']}",
             "axes across nodes: " + (", ".join(a for a, x in lay["axes_crossing_nodes"].items() if x) or "none"),
             "",
             f"{'role':>6} {'layers':>11} {'params':>10} {'grads':>10} {'optim':>10} {'unshard':>10} "
             f"{'activ':>10} {'logits':>10} {'alloc+rt':>10} {'total':>10} {'set-up':>10}"]
    for r in mem["per_role"]:
        span = _ranges(r["layers"])
        other = r.get("allocator", 0.0) + r.get("runtime", 0.0)  # allocator slack and a CPU rank's runtime
        lines.append(f"{'pp' + str(r['pp_rank']):>6} {span:>11} " + " ".join(
            f"{_fmt_bytes(v):>10}" for v in [*(r[k] for k in ("params", "grads", "optimizer", "unsharded",
                                                              "activations", "logits")), other, r["total"],
                                              r.get("setup_total", 0.0)]))
    lines += [f"peak (training step or set-up) {_fmt_bytes(mem['peak'])} of {_fmt_bytes(mem['usable'])} usable: "
              f"{'fits' if mem['fits'] else 'DOES NOT FIT'}", "",
              f"bytes sent per step by the busiest rank (role pp{plan['communication']['busiest_role']}):"]
    for axis, kinds in plan["communication"]["busiest_rank"].items():
        lines.append(f"  {axis:>4}: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in kinds.items())
                     + f"  ({st['comm_s'].get(axis, 0.0):.3g} s)")
    bub = plan["bubble"]
    lines += ["", f"bubble (theory) {bub['theory']:.1%}" + (f", replay {bub['replay']:.1%}"
                                                            if isinstance(bub.get("replay"), float) else ""),
              f"step {st['step_s']:.3g} s (compute {st['compute_s']:.3g} s, exposed dp {st['dp_exposed_s']:.3g} s), "
              f"MFU {st['mfu']:.1%}, {plan['tokens_per_s']:.3g} tokens/s, bottleneck {st['bottleneck']}"]
    if "tokens_per_s_per_device" in plan:
        lines.append(f"per device: {plan['tokens_per_s_per_device']:.5g} tokens/s, "
                     f"{plan['model_tflops_per_device']:.4g} model TFLOP/s; peak memory "
                     f"{mem['peak'] / 2**30:.4g} GiB")
    lines += [f"planner only (the runtime cannot run this yet): {x}" for x in plan.get("planner_only", [])]
    if "device" in plan:
        lines.insert(1, f"device: {plan['device']}")
    return "\n".join(lines)


def write_plan(plan: dict[str, Any], path: Union[str, os.PathLike] = "plan.json") -> str:
    """Write the plan as JSON (directories created); return the path.

    Example:
        >>> # not run: needs files (writes a plan)
        >>> write_plan({"mfu": 0.5}, tmp_path / "plan.json")  # doctest: +SKIP
    """
    path = os.fspath(path)
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(plan, f, indent=2, default=str)
        f.write("\n")
    return path
