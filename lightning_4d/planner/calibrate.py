"""The planner against published training runs: what a published figure means, and the ratio table.

The runs (figures, sources and each run described as ``recipes/plan.py`` overrides) are in
``lightning_4d/planner/calibration/published.json``: Megatron-LM's SC21 Table 1 (A100 80GB, GPT 1.7B–1T,
TFLOP/s per GPU), TorchTitan's Llama 3.1 8B / 70B H100 benchmarks (tokens/s per GPU and max reserved memory),
Megatron-Core's Mixtral 8x7B H100 figure and Llama 3 405B's 8K / 16K-GPU pre-training. Every row is planned by
the path a user runs — the row's overrides composed into the ``plan`` config, then
:func:`lightning_4d.recipes.planning.plan_setup` and :func:`~lightning_4d.planner.make_plan`
(:mod:`lightning_4d.recipes.calibration`) — with the devices' family constants
(:mod:`lightning_4d.planner.hardware`) and the kernel constants (:mod:`lightning_4d.planner.compute`);
nothing is fitted per row.

This module is the pure part: how a published figure converts to a step time (:func:`published_step_s`, with
the FLOP conventions of :data:`FLOP_CONVENTIONS`), one row's comparison (:func:`compare`) and the markdown
table (:func:`format_markdown`). ``python bench/calibrate_planner.py --write docs/planner_calibration.md``
regenerates the document.

Example:
    >>> data = load_published()
    >>> {"megatron_sc21", "torchtitan_202412", "megatron_core_moe"} <= {r["source"] for r in data["rows"]}
    True
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Optional

from lightning_4d.planner.spec import TrainSpec, TransformerSpec

__all__ = ["TOLERANCE", "FLOP_CONVENTIONS", "load_published", "iteration_flops", "published_step_s", "compare",
           "format_markdown", "row_command"]

#: The target: every ratio planner / published within ±15%.
TOLERANCE = 0.15
_GIB = 2**30
_LAYOUT_KEYS = ("world_size", "tp", "pp", "ep", "dp", "virtual_stages", "microbatches", "micro_batch_size",
                "global_batch_size")
#: How a source counts the FLOPs behind its TFLOP/s figure (:func:`iteration_flops`).
FLOP_CONVENTIONS = ("megatron_sc21", "megatron_core", "model")


def load_published() -> dict[str, Any]:
    """The published figures (``calibration/published.json``).

    Example:
        >>> len(load_published()["rows"]) >= 15
        True
    """
    text = resources.files("lightning_4d.planner").joinpath("calibration/published.json").read_text()
    return json.loads(text)


def row_command(row: dict[str, Any]) -> str:
    """The command line that plans ``row`` (its overrides after ``python recipes/plan.py``).

    Example:
        >>> row_command({"overrides": ["model=llama3_8b", "parallel=dp"]})
        'python recipes/plan.py model=llama3_8b parallel=dp'
    """
    return " ".join(["python recipes/plan.py", *row["overrides"]])


def iteration_flops(convention: str, spec: TransformerSpec, train: TrainSpec) -> float:
    """FLOPs of one optimizer step as a source counts them for its TFLOP/s figure.

    - ``megatron_sc21``: Narayanan et al. 2021, eq. 3, ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` (GPT with
      full recomputation: four forward passes' worth);
    - ``megatron_core``: Megatron-Core's ``num_floating_point_operations`` (model FLOPs, no recomputation):
      ``12·B·s·l·h²·((1 + g/a + s/h)·q/h + (F/h)·k·σ + V/(2·l·h))`` with ``F`` the expert width of an MoE,
      ``k`` its top-k, ``σ`` 3/2 for SwiGLU;
    - ``model``: the planner's model FLOPs, :meth:`TransformerSpec.flops_per_token` ``× B·s``
      (``6·N_active + 12·l·a·d·s`` per token).

    Example:
        >>> spec = TransformerSpec(vocab_size=51200, hidden=2304, layers=24, heads=24, seq_len=2048)
        >>> round(iteration_flops("megatron_sc21", spec, TrainSpec(512)) / 1e15, 1)
        15.5
    """
    b, s, l, h, v = train.global_batch_size, train.seq(spec), spec.layers, spec.hidden, spec.vocab_size
    if convention == "megatron_sc21":
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    if convention == "megatron_core":
        ffn, k = (spec.expert_hidden, spec.top_k) if spec.is_moe else (spec.ffn_hidden, 1)
        glu = 1.5 if spec.gated_mlp else 1.0
        attn = (1 + spec.kv_heads / spec.heads + s / h) * spec.q_width / h
        return 12 * b * s * l * h * h * (attn + ffn / h * k * glu + v / (2 * l * h))
    if convention == "model":
        return float(spec.flops_per_token(s)) * b * s
    raise ValueError(f"flops={convention!r} is not one of {FLOP_CONVENTIONS}.")


def published_step_s(published: dict[str, Any], spec: TransformerSpec, train: TrainSpec, world: int) -> float:
    """Seconds per optimizer step that a published throughput implies for the planned batch: from
    ``tokens_per_s_per_gpu``, or from ``tflops_per_gpu`` with its FLOP convention (``flops``).

    Example:
        >>> spec = TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1, seq_len=10)
        >>> published_step_s({"tokens_per_s_per_gpu": 5.0}, spec, TrainSpec(4), world=2)
        4.0
    """
    if "tokens_per_s_per_gpu" in published:
        return train.global_batch_size * train.seq(spec) / (published["tokens_per_s_per_gpu"] * world)
    flops = iteration_flops(published["flops"], spec, train)
    return flops / (published["tflops_per_gpu"] * 1e12 * world)


def compare(row: dict[str, Any], spec: TransformerSpec, train: TrainSpec, plan: dict[str, Any]) -> dict[str, Any]:
    """One row of the table: the published figure and the plan's in the published unit, their ratio
    (planner / published; > 1 means the planner is optimistic), memory (planned peak reserved GiB, published
    when known, ratio) and whether the planned peak fits the device.

    Example:
        >>> spec = TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1, seq_len=10)
        >>> plan = {"step_time_s": 2.0, "layout": {"world_size": 2}, "memory": {"peak": 2**30, "fits": True},
        ...         "step": {"bottleneck": "compute"}, "inputs": {"device": "toy"}}
        >>> r = compare({"id": "x", "source": "s", "published": {"tokens_per_s_per_gpu": 5.0, "memory_gib": 2.0},
        ...              "overrides": []}, spec, TrainSpec(4), plan)
        >>> r["throughput_ratio"], r["memory_ratio"]
        (2.0, 0.5)
    """
    pub = row["published"]
    world = plan["layout"]["world_size"]
    step_pub, step = published_step_s(pub, spec, train, world), plan["step_time_s"]
    if "tokens_per_s_per_gpu" in pub:
        unit, published = "tokens/s/GPU", pub["tokens_per_s_per_gpu"]
    else:
        unit, published = f"TFLOP/s/GPU ({pub['flops']})", pub["tflops_per_gpu"]
    planned = published * step_pub / step
    mem = plan["memory"]["peak"] / _GIB
    out: dict[str, Any] = {
        "id": row["id"], "source": row["source"], "gpus": world, "device": plan["inputs"]["device"],
        "layout": plan.get("layout_label", ""), "throughput_unit": unit, "throughput_published": published,
        "throughput_planned": planned, "throughput_ratio": planned / published, "step_s_planned": step,
        "step_s_published": step_pub, "memory_planned_gib": mem, "memory_published_gib": pub.get("memory_gib"),
        "memory_ratio": mem / pub["memory_gib"] if pub.get("memory_gib") else None,
        "fits": bool(plan["memory"]["fits"]), "bottleneck": plan["step"]["bottleneck"],
        "planner_only": list(plan.get("planner_only", [])), "command": row_command(row),
        "bar": bool(row.get("bar", True)), "why": row.get("why", ""), "assumption": row.get("assumption", ""),
        "moe": spec.is_moe, "planned_layout": {k: plan["layout"][k] for k in _LAYOUT_KEYS if k in plan["layout"]},
    }
    return out


def _flag(x: Optional[float], tolerance: float = TOLERANCE) -> str:
    if x is None:
        return "–"
    return f"{x:.2f}" + ("" if abs(x - 1) <= tolerance else " *")


def _table(rows: list[dict[str, Any]], tolerance: float) -> list[str]:
    lines = ["| run | GPUs | device | layout | throughput published | planned | ratio | memory GiB published "
             "| planned | ratio | fits | bottleneck |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        unit = "tok/s" if r["throughput_unit"].startswith("tokens") else "TFLOP/s"
        pub_mem = "–" if r["memory_published_gib"] is None else f"{r['memory_published_gib']:g}"
        lines.append(
            f"| {r['id']} | {r['gpus']} | {r['device']} | {r['layout']} | {r['throughput_published']:g} {unit} | "
            f"{r['throughput_planned']:.4g} | {_flag(r['throughput_ratio'], tolerance)} | {pub_mem} | "
            f"{r['memory_planned_gib']:.1f} | {_flag(r['memory_ratio'], tolerance)} | "
            f"{'yes' if r['fits'] else 'NO'} | {r['bottleneck']} |")
    return lines


def format_markdown(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> str:
    """The calibration tables as markdown — the rows the planner models (``bar``), then the rows planned but
    outside what it models faithfully, each with why — and the command of every row. Ratios planner / published;
    ``*``: outside ``±tolerance``.

    Example:
        >>> print(format_markdown([]).splitlines()[0][:24])
        | run | GPUs | device |
    """
    inside = [r for r in rows if r.get("bar", True)]
    outside = [r for r in rows if not r.get("bar", True)]
    lines = _table(inside, tolerance)
    if outside:
        lines += ["", "Planned the same way, outside what the planner models faithfully (not part of the ±15% bar):",
                  ""] + _table(outside, tolerance) + [""]
        lines += [f"- `{r['id']}`: {r['why']}." for r in outside]
    assumed = [r for r in rows if r.get("assumption")]
    if assumed:
        lines += ["", "What a source leaves open and how the row fills it:", ""]
        lines += [f"- `{r['id']}`: {r['assumption']}." for r in assumed]
    lines += ["", "Commands (each prints the row's step time, tokens/s and model TFLOP/s per device and peak memory "
                  "in GiB):", ""]
    lines += [f"- `{r['id']}`: `{r['command']}`" for r in rows]
    return "\n".join(lines)
