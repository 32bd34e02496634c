"""The planner's calibration through the path a user runs: every published run of
``lightning_4d/planner/calibration/published.json`` is stored as ``recipes/plan.py`` overrides, composed into the
``plan`` config exactly as the command line does, planned by :func:`~lightning_4d.recipes.planning.plan_setup`
and :func:`~lightning_4d.planner.make_plan`, and compared with the published figure
(:func:`lightning_4d.planner.calibrate.compare`). ``docs/planner_calibration.md`` is generated from these rows
(``python bench/calibrate_planner.py --write docs/planner_calibration.md``), so the command a row prints
reproduces the row's numbers.

Example:
    >>> rows = calibration_rows(ids=["titan-8B-fsdp8"])
    >>> rows[0]["fits"], round(rows[0]["throughput_ratio"], 2)
    (True, 1.06)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

from lightning_4d.planner import make_plan
from lightning_4d.planner.calibrate import compare, load_published

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from lightning_4d.recipes.planning import PlanSetup

__all__ = ["compose_plan", "plan_overrides", "calibration_rows", "layout_label"]


def compose_plan(overrides: Iterable[str]) -> DictConfig:
    """The ``plan`` config composed with ``overrides`` (Hydra's compose API over ``conf/``, as ``recipes/plan.py``).

    Example:
        >>> compose_plan(["plan.device=H200"]).plan.device
        'H200'
    """
    from hydra import compose, initialize_config_dir

    from lightning_4d.recipes import conf_dir, register_configs

    register_configs()
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("plan", list(overrides))


def layout_label(plan: dict[str, Any]) -> str:
    """``tp=8 pp=4 ep=1 dp=32 v=3 m=28 b=2`` from a plan's layout.

    Example:
        >>> layout_label({"layout": {"tp": 2, "pp": 1, "ep": 1, "dp": 4, "virtual_stages": 1, "microbatches": 1,
        ...                          "micro_batch_size": 8}})
        'tp=2 pp=1 ep=1 dp=4 v=1 m=1 b=8'
    """
    lay = plan["layout"]
    return (f"tp={lay['tp']} pp={lay['pp']} ep={lay['ep']} dp={lay['dp']} v={lay['virtual_stages']} "
            f"m={lay['microbatches']} b={lay['micro_batch_size']}")


def plan_overrides(overrides: Iterable[str]) -> tuple[PlanSetup, dict[str, Any]]:
    """Plan the run ``overrides`` describe, as ``recipes/plan.py`` does without its dry run and search: the
    :class:`~lightning_4d.recipes.planning.PlanSetup` and the plan dict.

    Example:
        >>> setup, plan = plan_overrides(["model=llama3_8b", "parallel=dp", "plan.device=H200", "plan.trace=false"])
        >>> setup.cluster.device.name, plan["layout"]["dp"]
        ('H200-SXM-141GB', 8)
    """
    from lightning_4d.recipes.planning import plan_setup

    setup = plan_setup(compose_plan(overrides))
    plan = make_plan(setup.spec, setup.dims, setup.cluster, setup.train)
    plan["inputs"] = {"model": setup.config.model.name, "parallel": setup.config.parallel.name,
                      "device": setup.cluster.device.name, "notes": list(setup.notes)}
    plan["layout_label"] = layout_label(plan)
    return setup, plan


def calibration_rows(data: Optional[dict] = None, ids: Optional[Iterable[str]] = None) -> list[dict[str, Any]]:
    """Planner vs published for every row (or the rows ``ids``) of ``published.json``, through
    :func:`plan_overrides`: :func:`lightning_4d.planner.calibrate.compare`'s dict per row.

    Example:
        >>> sorted(calibration_rows(ids=["sc21-1.7B"])[0])[:3]
        ['assumption', 'bar', 'bottleneck']
    """
    data = data or load_published()
    wanted = set(ids) if ids is not None else None
    out = []
    for row in data["rows"]:
        if wanted is not None and row["id"] not in wanted:
            continue
        setup, plan = plan_overrides(row["overrides"])
        out.append(compare(row, setup.spec, setup.train, plan))
    return out


# ---------------------------------------------------------------------------------------------- CPU rows
def load_cpu_rows() -> dict[str, Any]:
    """The CPU runs and their stored measurements (``lightning_4d/planner/calibration/cpu_measured.json``).

    Example:
        >>> "default-recipe" in {r["id"] for r in load_cpu_rows()["rows"]}
        True
    """
    import json
    from importlib import resources

    text = resources.files("lightning_4d.planner").joinpath("calibration/cpu_measured.json").read_text()
    return json.loads(text)


def store_cpu_measurements(results: dict[str, dict[str, Any]]) -> None:
    """Write measurements (``bench/calibrate_planner_cpu.py --measure ... --write``) into the packaged JSON.

    Example:
        >>> # not run: needs files (the calibration data)
        >>> store_cpu_measurements({})  # doctest: +SKIP
    """
    import json
    from importlib import resources

    path = resources.files("lightning_4d.planner").joinpath("calibration/cpu_measured.json")
    data = json.loads(path.read_text())
    for row in data["rows"]:
        if row["id"] in results:
            row["measured"] = results[row["id"]]
    with open(str(path), "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")


#: The CPU target: planner / measured within ±25% (issue: "memory and step time within 25 %").
CPU_TOLERANCE = 0.25
#: What a CPU row adds to its recipe overrides to plan it (``recipes/plan.py``'s trainer defaults to ``gpu``).
CPU_PLAN = ("plan.device=cpu", "plan.trace=false")


def cpu_command(row: dict[str, Any]) -> str:
    """The ``recipes/plan.py`` command that plans a CPU row.

    Example:
        >>> cpu_command({"overrides": ["model=tiny_dense"]})
        'python recipes/plan.py trainer=cpu model=tiny_dense plan.device=cpu plan.trace=false'
    """
    return " ".join(["python recipes/plan.py", "trainer=cpu", *row["overrides"], *CPU_PLAN])


def cpu_rows(data: Optional[dict] = None, ids: Optional[Iterable[str]] = None) -> list[dict[str, Any]]:
    """Planner vs measured for every CPU row (``cpu_measured.json``) through :func:`plan_overrides`: per-rank peak
    memory (the planner's largest rank vs the largest measured growth of resident memory over the process's
    baseline) and step time (the planner's vs the median measured wall-clock step).

    Example:
        >>> r = cpu_rows(ids=["default-recipe"])[0]
        >>> r["ranks"], r["command"].split()[2]
        (8, 'trainer=cpu')
    """
    data = data or load_cpu_rows()
    wanted = set(ids) if ids is not None else None
    out = []
    for row in data["rows"]:
        if wanted is not None and row["id"] not in wanted:
            continue
        setup, plan = plan_overrides(["trainer=cpu", *row["overrides"], *CPU_PLAN])
        meas = row.get("measured") or {}
        mem, step = plan["memory"]["peak"], plan["step_time_s"]
        mem_m = meas.get("peak_growth_bytes")
        step_m = meas.get("cpu_bound_step_s")
        if step_m is None and meas:  # measured before the field existed: the same quantity from its parts
            step_m = meas["cpu_s_total"] / min(meas["cpu_count"], meas["ranks"])
        out.append({
            "id": row["id"], "what": row.get("what", ""), "ranks": setup.dims.world_size, "layout": plan["layout_label"],
            "memory_planned_mib": mem / 2**20, "memory_measured_mib": mem_m / 2**20 if mem_m else None,
            "memory_ratio": mem / mem_m if mem_m else None, "step_planned_s": step, "step_measured_s": step_m,
            "step_ratio": step / step_m if step_m else None, "bottleneck": plan["step"]["bottleneck"],
            "wall_step_s": meas.get("step_s"), "role": row.get("role", "validation"),
            "baseline_mib": meas["baseline_rss_bytes"] / 2**20 if meas else None,
            "loadavg": meas.get("loadavg_1min"), "cpu_count": meas.get("cpu_count"), "command": cpu_command(row),
            "measure": f"OMP_NUM_THREADS=1 python bench/calibrate_planner_cpu.py --measure {row['id']} --write",
        })
    return out


def format_cpu_markdown(rows: list[dict[str, Any]], tolerance: float = CPU_TOLERANCE) -> str:
    """The CPU tables as markdown — the validation rows, then the calibration rows the host costs come from —
    (ratios planner / measured; ``*``: outside ``±tolerance``) and each row's two commands (plan, measure).

    Example:
        >>> print(format_cpu_markdown([]).splitlines()[0][:22])
        | run | ranks | layout
    """
    def flag(x: Optional[float]) -> str:
        return "–" if x is None else f"{x:.2f}" + ("" if abs(x - 1) <= tolerance else " *")

    def num(x: Optional[float], fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    def table(part: list[dict[str, Any]]) -> list[str]:
        lines = ["| run | ranks | layout | peak memory per rank MiB measured | planned | ratio | step s measured (CPU-bound) "
                 "| planned | ratio | wall-clock step s | load (1 min) | bottleneck |",
                 "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in part:
            lines.append(f"| {r['id']} | {r['ranks']} | {r['layout']} | {num(r['memory_measured_mib'], '.0f')} | "
                         f"{r['memory_planned_mib']:.0f} | {flag(r['memory_ratio'])} | "
                         f"{num(r['step_measured_s'], '.3g')} | {r['step_planned_s']:.3g} | {flag(r['step_ratio'])} | "
                         f"{num(r['wall_step_s'], '.3g')} | {num(r['loadavg'], '.0f')} | {r['bottleneck']} |")
        return lines

    validation = [r for r in rows if r.get("role", "validation") != "calibration"]
    calibration = [r for r in rows if r.get("role", "validation") == "calibration"]
    lines = table(validation)
    if calibration:
        lines += ["", "Calibration rows (the host costs are derived from these: their ratios are in-sample):", ""]
        lines += table(calibration)
    lines += ["", "Rows and commands (plan; measure):", ""]
    lines += [f"- `{r['id']}` ({r['what']}): `{r['command']}`; `{r['measure']}`" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the document
_GPU_NOTES = """# Planner calibration

<!-- generated by `python bench/calibrate_planner.py --write docs/planner_calibration.md`; do not edit by hand -->

Every row below is planned by the command it prints — `python recipes/plan.py` with the row's overrides, the
path a user runs (`lightning_4d.recipes.calibration.plan_overrides`: the overrides composed into the `plan` config,
`plan_setup`, `make_plan`); `tests/unit/test_planner_calibration.py` checks that the table is what those commands
give. Figures, sources and overrides: `lightning_4d/planner/calibration/published.json`. Ratios are planner /
published; `*` marks a ratio outside ±15%. Nothing is fitted per row: a device's constants are its datasheet
numbers and its family's calibrated efficiency (section "Devices").

What the model is:

- compute: every GEMM at `compute_efficiency · I/(I + gemm_half_intensity)` of the peak (`I` its arithmetic
  intensity), the attention core as GEMMs of width `head_dim`, memory-bound kernels (norms, residuals,
  activation functions, the non-flash softmax) at the HBM bandwidth, recomputation, the AdamW step;
  tp / ep / pp traffic on the critical path, dp traffic overlapped; the bubble of the exact schedule.
- memory (reserved): sharded states, FSDP / ZeRO buffers, activations (Korthikanti et al.'s counts for fused
  kernels, `plan.kernels=fused`; by default what PyTorch's eager kernels keep, as the runtime and TorchTitan run
  them: keys and values repeated to every query head, the attention output twice, `silu(w1 x)` besides the SwiGLU
  inputs, and under DTensor's sequence parallelism the gathered QKV / MLP inputs; checkpointing policies: the
  runtime's "save every matmul", TorchTitan's "every other matmul" (planner only), full), the loss's logits and the
  allocator's slack (`allocator_overhead` of the allocated bytes).
- what a source ran is selectable: `plan.compile=true` and `plan.float8=true` (Float8 linears modelled from the
  hardware: twice the bf16 peak, 1-byte operands, dynamic-scaling casts) run in the runtime too
  (`parallel.compile=true`, `parallel.float8=true`: docs/speed.md); what lightning_4d does not run yet is labelled
  "planner only" in every plan: `plan.selective_policy=every_other_matmul`, `plan.data_parallel=zero1|zero2`
  (Megatron's distributed optimizer; FSDP with gradients reduce-scattered per micro-batch), `plan.kernels=fused`
  (Megatron / Transformer Engine).

Honest limits: TorchTitan's compile rows use `COMPILE_FACTOR` (fused memory-bound kernels) and compile's memory
savings are not modelled (ratio ~1.08); Megatron's SC21 table and the NeMo / Megatron-Core figures give no
memory, so those rows are only checked to fit.

## Published runs (planner / published)

"""


def _devices_markdown() -> str:
    from lightning_4d.planner import compute
    from lightning_4d.planner.hardware import DEVICES, FAMILIES

    lines = ["## Devices", "", "`plan.device=NAME` (or `custom` with `plan.family` / `plan.compute_efficiency`); every "
             "plan prints the constants it used.", "",
             "| family | compute_efficiency | gemm_half_intensity | allocator_overhead | usable memory | latency intra / inter | calibrated on |",
             "|---|---:|---:|---:|---:|---|---|"]
    for f in FAMILIES.values():
        lines.append(f"| {f.name} | {f.compute_efficiency:g} | {f.gemm_half_intensity:g} | {f.allocator_overhead:g} | "
                     f"{f.usable_fraction:g} | {f.latency_intra * 1e6:g} / {f.latency_inter * 1e6:g} us | "
                     f"{f.calibrated_on} |")
    lines += ["", "| plan.device | name | family | peak TFLOP/s | memory GB | HBM GB/s | intra-node GB/s | inter-node GB/s "
              "| source |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for key, d in DEVICES.items():
        lines.append(f"| {key} | {d.name} | {d.family} | {d.peak_flops / 1e12:.4g} | {d.memory_bytes / 1e9:.4g} | "
                     f"{d.hbm_bw / 1e9:.4g} | {d.intra_node_bw / 1e9:.4g} | {d.inter_node_bw / 1e9:.4g} | {d.note} |")
    consts = {n: getattr(compute, n) for n in ("NORM_ELEMENTS", "INNER_ELEMENTS", "SCORE_ELEMENTS",
                                               "BACKWARD_FACTOR", "COMPILE_FACTOR", "OPTIMIZER_BYTES")}
    lines += ["", "Kernel constants (`lightning_4d/planner/compute.py`): "
              + ", ".join(f"{k} {v:g}" for k, v in consts.items()) + "."]
    return "\n".join(lines)


_CPU_NOTES = """## This machine: CPU runs (planner / measured)

The `cpu` device (`plan.device=cpu`) is one CPU rank; the ranks of a node share its `cores` (`plan.cpu_cores`).
With more ranks than cores the step is the node's total work over its cores
(`lightning_4d.planner.roofline.shared_cores_step`): compute, the optimizer step, the framework's host time and
the CPU that gloo and FSDP spend per call and per byte. Its constants (section "Devices"; all in CPU seconds) come
from two sources, never from the validation rows below:

- micro-benchmarks of one core (`python bench/calibrate_planner_cpu.py --constants`): fp32 GEMM ~78 GFLOP/s at the
  rows' shapes, causal SDPA at 0.38 of a GEMM of its shape, elementwise ~40 GB/s, the package's Llama block forward
  + backward at width 16 ~1 ms of framework time, resident memory 1.40 × the live allocations (glibc keeps freed
  blocks: `mallinfo2` against `VmHWM`);
- the calibration rows (`--derive`, last table): the same recipes at negligible width give 10 ms of framework time
  per optimizer step, 2.0 ms of CPU per collective call (DTensor, pipeline, all-to-all; the fit leaves -38%..+18%
  per row) and 4.5 ms per FSDP call, 25 MiB of runtime per rank; FSDP of a 94M-parameter model on 16-token
  micro-batches gives 0.41 GB moved per CPU second.

Measured by `bench/calibrate_planner_cpu.py --measure ID --write` (each row's recipe trained for a few steps, models
built on the meta device): memory is the largest per-rank growth of resident memory over the rank's resident
memory before its model was built (interpreter, torch, Lightning and gloo are that baseline, ~520 MiB), the peak
reset when training starts so that the set-up peak is not in it; step time is the median over the steps after two
warm-up steps of the CPU seconds all ranks spent per step, over the cores they share (the CPU-bound step). The
machine is shared with other jobs (load averages of 14 to 125 on 2 cores during the runs): they stretch the
wall-clock step (listed) but not the run's own CPU seconds. Ratios are planner / measured; `*` marks a ratio
outside ±25%.

"""

_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _cpu_findings(cpu: list[dict[str, Any]]) -> str:
    """The paragraph on the CPU validation rows, its counts and the default recipe's step counted from ``cpu``."""
    rows = [r for r in cpu if r["role"] == "validation" and r["memory_ratio"] is not None]
    inside = [(abs(r["step_ratio"] - 1) <= 0.25, abs(r["memory_ratio"] - 1) <= 0.25) for r in rows]
    step, mem, both = (sum(s for s, _ in inside), sum(m for _, m in inside), sum(s and m for s, m in inside))
    word = lambda n: _WORDS[n] if n < len(_WORDS) else str(n)  # noqa: E731
    default = next(r for r in rows if r["id"] == "default-recipe")
    steps = "all" if step == len(rows) else f"{word(step)} of the"
    return (f"What the CPU rows show: step time is within 25% on {steps} {word(len(rows))} runs (compute, the "
            f"optimizer, the framework's\ntime per call, gloo and FSDP bytes, shared cores), memory on {word(mem)} "
            f"(one rank, and FSDP over 8 ranks); {word(both)} runs\nmeet both. Memory is under-planned where the "
            "framework keeps buffers the model does not count — not yet\nmeasured one by one: most likely FSDP's "
            "gathered and reduce-scatter copies beyond one layer (`o-fsdp8-bytes`, 0.67), the tp × pp × dp run (0.75, "
            "just outside), the\nexpert layers' dispatch buffers (permuted copies, routing indices and weights, "
            "all-to-all buffers; 0.66) and the\ndefault recipe, where a 1M-parameter model leaves only such fixed "
            f"costs ({default['memory_ratio']:.2f}; its step is over-planned by {default['step_ratio'] - 1:.0%}).\n\n")


def calibration_markdown(rows: Optional[list[dict[str, Any]]] = None,
                         cpu: Optional[list[dict[str, Any]]] = None) -> str:
    """The whole of ``docs/planner_calibration.md``: notes, the published-run tables, the devices and the CPU table.

    Example:
        >>> # not run: needs files (the calibration data)
        >>> calibration_markdown().startswith("# Planner calibration")  # doctest: +SKIP
        True
    """
    from lightning_4d.planner.calibrate import format_markdown

    rows = calibration_rows() if rows is None else rows
    cpu = cpu_rows() if cpu is None else cpu
    return (_GPU_NOTES + format_markdown(rows) + "\n\n" + _devices_markdown() + "\n\n" + _CPU_NOTES
            + _cpu_findings(cpu) + format_cpu_markdown(cpu) + "\n")
