"""The logic behind ``recipes/plan.py``: a composed config → planner inputs → plan, dry run, search, ``plan.json``.

:func:`plan_setup` turns the config groups of the training recipe plus the ``plan`` section into the
planner's inputs — the :class:`~lightning_4d.planner.TransformerSpec` of the model config, the layout
(:class:`~lightning_4d.mesh.ParallelDims`) of ``parallel``, the :class:`~lightning_4d.planner.TrainSpec`
of ``data`` / ``trainer`` / ``parallel`` and the :class:`~lightning_4d.planner.ClusterSpec` of ``plan`` —
and names where each number came from. :func:`run_plan` then calls
:func:`~lightning_4d.planner.make_plan`, optionally the dry run on a fake process group
(:func:`~lightning_4d.planner.dry_run.dry_run`) and the layout search, and writes ``plan.json``.

Requests that cannot be planned (a layout that does not divide the model or the cluster, a batch that
does not split, a search where nothing fits) raise :class:`PlanError` with a message naming the keys. A plan
whose layout does not fit the device ends with :data:`EXIT_DOES_NOT_FIT` (the recipe's exit status).

Example:
    >>> from hydra import compose, initialize_config_dir
    >>> from lightning_4d.recipes import conf_dir, register_configs
    >>> register_configs()
    >>> with initialize_config_dir(str(conf_dir()), version_base=None):
    ...     cfg = compose("plan", ["model=moe_1t", "parallel=moe_1t"])
    >>> setup = plan_setup(cfg)
    >>> setup.dims.world_size, setup.cluster.nodes, setup.spec.total_params()
    (512, 64, 1038954930176)
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from omegaconf import DictConfig

from lightning_4d.layout.data_parallel import reshards_after_forward
from lightning_4d.pipeline.schedules import validate_microbatches
from lightning_4d.core.precision import PLANNER_PRECISIONS, precision_info
from lightning_4d.planner import ClusterSpec, DeviceSpec, NoLayoutFits, TrainSpec, format_table, make_plan, search, write_plan
from lightning_4d.planner.dry_run import dry_run
from lightning_4d.planner.hardware import custom_device, device_by_name
from lightning_4d.planner.memory import check_layout
from lightning_4d.planner.spec import planner_only, runtime_speed_notes
from lightning_4d.recipes.build import build_model, output_dir, validate
from lightning_4d.recipes.resources import model_spec
from lightning_4d.recipes.schema import (
    HFModelConfig,
    PlanConfig,
    PlanRecipeConfig,
    RecipeConfigError,
    TrainConfig,
    owned,
)

if TYPE_CHECKING:
    from lightning_4d.mesh import ParallelDims
    from lightning_4d.planner import TransformerSpec
    from lightning_4d.planner.dry_run import DryRunResult
    from lightning_4d.recipes.schema import ModelConfig

__all__ = ["EXIT_DOES_NOT_FIT", "EXIT_IMPOSSIBLE", "EXIT_TRACE_DIFFERS", "PlanError", "PlanSetup", "PlanOutcome",
           "plan_setup", "run_plan", "TRACE_BLOCKS"]

EXIT_TRACE_DIFFERS = 1  # the dry run's traced collectives disagree with the formulas (or it failed)
EXIT_IMPOSSIBLE = 2  # PlanError: the request cannot be planned (layout, cluster, batch; nothing fits in the search)
EXIT_DOES_NOT_FIT = 3  # the planned layout's peak (training step or set-up) exceeds the device's usable memory

TRACE_BLOCKS = 8
"""With ``plan.trace_blocks: null`` models of at most this many blocks are traced whole, bigger ones cut down
(the formulas are per block; tracing time grows with the blocks, about 0.1-0.5 s each on one CPU core)."""


class PlanError(RecipeConfigError):
    """The request cannot be planned (layout, cluster, batch or memory); the message says why and what to change.

    Example:
        >>> str(PlanError("no layout fits"))
        'no layout fits'
    """


@dataclass
class PlanSetup:
    """The planner's inputs derived from a composed config, and notes on where they came from.

    Example:
        >>> PlanSetup.__dataclass_fields__["notes"].default_factory()
        []
    """
    config: TrainConfig
    plan: PlanConfig
    spec: TransformerSpec
    dims: ParallelDims
    cluster: ClusterSpec
    train: TrainSpec
    notes: list[str] = field(default_factory=list)


@dataclass
class PlanOutcome:
    """What :func:`run_plan` produced: the plan dict (also in ``path``), its text report and the exit code
    (0; :data:`EXIT_DOES_NOT_FIT` when the layout does not fit the device, else :data:`EXIT_TRACE_DIFFERS` when
    the dry run disagrees with the formulas).

    Example:
        >>> PlanOutcome(plan={}, text="", path=None).exit_code
        0
    """
    plan: dict
    text: str
    path: Optional[str]
    exit_code: int = 0
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------- inputs
def _plan_section(c: TrainConfig) -> PlanConfig:
    return c.plan if isinstance(c, PlanRecipeConfig) else PlanConfig()


def _precision(trainer_precision: str) -> tuple[str, Optional[str]]:
    p = str(trainer_precision)
    try:
        info = precision_info(p)
    except ValueError as err:
        raise PlanError(f"trainer.precision: {err}") from err
    if info.planner is None:
        raise PlanError(f"trainer.precision={p} is not modelled by the planner; use one of {PLANNER_PRECISIONS}.")
    if info.modelled_exactly:
        return info.planner, None
    return info.planner, (f"trainer.precision={p} is modelled as {info.planner} (16-bit compute, fp32 weights, "
                          f"gradients and AdamW states)")


def plan_device(plan: PlanConfig) -> DeviceSpec:
    """The device of the ``plan`` section: a named one (``lightning_4d.planner.hardware.DEVICES``) with any of
    the numbers overridden (its name then gets a ``*``), or a ``custom`` one from the numbers and a family's
    calibrated constants (or an explicit ``compute_efficiency``).

    Example:
        >>> plan_device(PlanConfig(device="A100-40GB")).name
        'A100-SXM-40GB'
        >>> d = plan_device(PlanConfig(device="H100", memory_gb=94, compute_efficiency=0.5))
        >>> d.name, d.memory_bytes / 1e9, d.compute_efficiency, d.family
        ('H100-SXM-80GB*', 94.0, 0.5, 'hopper')
    """
    if plan.device == "custom":
        dev = custom_device(plan.memory_gb, plan.peak_tflops, plan.nvlink_gb_s, plan.infiniband_gb_s, plan.family,
                            plan.compute_efficiency, plan.hbm_gb_s)
    else:
        dev = device_by_name(plan.device)
        scale = {"memory_gb": ("memory_bytes", 1e9), "peak_tflops": ("peak_flops", 1e12),
                 "nvlink_gb_s": ("intra_node_bw", 1e9), "infiniband_gb_s": ("inter_node_bw", 1e9),
                 "hbm_gb_s": ("hbm_bw", 1e9), "compute_efficiency": ("compute_efficiency", 1.0)}
        changes = {field_: getattr(plan, key) * factor for key, (field_, factor) in scale.items()
                   if getattr(plan, key) is not None}
        if changes:
            dev = dev.with_(name=f"{dev.name}*", **changes)
    if plan.cpu_cores is not None:
        if dev.family != "cpu":
            raise PlanError(f"plan.cpu_cores={plan.cpu_cores} applies to CPU ranks; plan.device={plan.device} is a "
                            f"{dev.family} device. Use plan.device=cpu, or drop plan.cpu_cores.")
        dev = dev.with_(cores=plan.cpu_cores)
    return dev


def plan_setup(cfg: Union[DictConfig, TrainConfig]) -> PlanSetup:
    """Derive model spec, layout, train spec and cluster from a composed ``plan`` (or ``train``) config.

    Rules (each noted in ``PlanSetup.notes`` when a default is used):

    - model: the package's model configs, or ``model=hf`` (``model.path`` / ``model.config``) through
      :func:`~lightning_4d.recipes.hf_model.hf_spec` (its parameter count checked against the model's own);
    - world: ``tp·pp·dp`` with an explicit ``parallel.dp``; with ``dp: auto`` ``plan.nodes ×
      gpus_per_node`` if ``plan.nodes`` is set, else ``trainer.devices × trainer.num_nodes``;
    - cluster: ``plan.gpus_per_node`` (``null``: ``trainer.devices``, 8 for ``auto``) and ``plan.nodes``
      (``null``: enough nodes for the world); the device of :func:`plan_device`;
    - sequence length: ``plan.seq_len`` or ``data.seq_len``; global batch: ``plan.global_batch_size`` or
      ``data.batch_size × dp × trainer.accumulate_grad_batches``, raised to the next multiple of
      ``dp × microbatches`` when the pipeline needs more sequences than that (noted);
    - micro-batches: ``parallel.microbatches`` (``null``: ``pp·v`` with a pipeline) times
      ``trainer.accumulate_grad_batches``: the runtime runs the pipeline schedule once per accumulation step, and
      accumulated micro-batches without a pipeline hold unsharded gradients like pipeline ones;
    - precision: ``trainer.precision`` (16-bit variants modelled as ``bf16-mixed``);
    - what only the planner models (``plan.selective_policy``, ``plan.data_parallel=zero1|zero2``,
      ``plan.kernels=fused``) is noted as "planner only" (:func:`~lightning_4d.planner.spec.planner_only`);
      compile and Float8 (``plan.*`` or ``parallel.*``) as what the runtime does
      (:func:`~lightning_4d.planner.spec.runtime_speed_notes`).

    Raises:
        PlanError: the layout does not fit the model or the cluster, or the batch does not split.

    Example:
        >>> # not run: needs files (the recipe's config files)
        >>> setup = plan_setup(cfg)  # doctest: +SKIP
    """
    c = validate(cfg)
    plan, par, t = _plan_section(c), c.parallel, c.trainer
    notes: list[str] = []
    gpn = plan.gpus_per_node or (t.devices if isinstance(t.devices, int) else 8)
    if par.dp != "auto":
        world = par.tp * par.pp * int(par.dp)
        source = f"parallel: tp·pp·dp = {par.tp}·{par.pp}·{par.dp}"
    elif plan.nodes is not None:
        world = plan.nodes * gpn
        source = f"plan.nodes × gpus_per_node = {plan.nodes} × {gpn} (parallel.dp=auto)"
    else:
        devices = t.devices if isinstance(t.devices, int) else gpn
        world = devices * t.num_nodes
        source = f"trainer.devices × trainer.num_nodes = {devices} × {t.num_nodes} (parallel.dp=auto)"
    notes.append(f"world: {world} ranks from {source}")
    try:
        dims = owned("parallel", par).resolve(world)
    except ValueError as err:
        raise PlanError(f"layout {par.name}: {err}") from None
    nodes = plan.nodes or -(-world // gpn)
    if nodes * gpn < world:
        raise PlanError(
            f"cluster: the layout needs {world} ranks ({source}) but plan.nodes × gpus_per_node = {nodes} × {gpn} = "
            f"{nodes * gpn} GPUs; set plan.nodes={-(-world // gpn)}, or parallel.dp=auto to fill the cluster.")
    if plan.nodes is None:
        notes.append(f"cluster: {nodes} node(s) × {gpn} GPUs from the world (plan.nodes=null)")
    device = plan_device(plan)
    cluster = ClusterSpec(nodes, gpn, device)
    notes.append(f"device: {device.describe()}")

    seq, spec = plan.seq_len or c.data.seq_len, _model_spec(c, notes)
    if seq > spec.seq_len:
        raise PlanError(f"plan.seq_len={seq} exceeds the model's max_seq_len={spec.seq_len}.")
    notes.append(f"seq_len: {seq} from " + ("plan.seq_len" if plan.seq_len else "data.seq_len"))
    spec = spec.with_(seq_len=seq)
    try:
        check_layout(spec, dims)
    except ValueError as err:
        raise PlanError(f"layout {par.name} does not fit model {c.model.name}: {err}") from None

    precision, note = _precision(t.precision)
    if note:
        notes.append(note)
    pipe_m = dims.pp * dims.virtual_stages if (par.microbatches is None and dims.pp > 1) else (par.microbatches or 1)
    acc = t.accumulate_grad_batches
    m = pipe_m * acc
    if acc > 1:
        notes.append(f"micro-batches: {pipe_m} per schedule × trainer.accumulate_grad_batches={acc} = {m} per step"
                     + (" (the bubble is planned as one schedule over all of them: optimistic)" if dims.pp > 1 else ""))
    if plan.global_batch_size is not None:
        gbs = plan.global_batch_size
        if gbs % (dims.dp * m):
            raise PlanError(f"plan.global_batch_size={gbs} does not split into dp·microbatches = {dims.dp}·{m} equal "
                            f"micro-batches; use a multiple of {dims.dp * m}.")
        notes.append(f"global batch: {gbs} sequences from plan.global_batch_size")
    else:
        local = c.data.batch_size * acc
        gbs = local * dims.dp
        text = (f"data.batch_size × dp × trainer.accumulate_grad_batches = {c.data.batch_size} × {dims.dp} × "
                f"{acc}")
        if local % m:
            local = -(-local // m) * m
            notes.append(f"global batch: {text} = {gbs} does not split into {m} micro-batches per dp rank; planned "
                         f"with {local} sequences per dp rank ({local * dims.dp} in all); set plan.global_batch_size "
                         f"or data.batch_size to plan another")
            gbs = local * dims.dp
        else:
            notes.append(f"global batch: {gbs} sequences = {text}")
    if dims.pp > 1:
        try:
            validate_microbatches(par.schedule, dims.pp, dims.virtual_stages, pipe_m, gbs // dims.dp // acc)
        except ValueError as err:
            raise PlanError(f"parallel.schedule={par.schedule} with pp={dims.pp}: {err}") from None
    train = TrainSpec(global_batch_size=gbs, seq_len=seq, microbatches=m, schedule=par.schedule,
                      data_parallel=plan.data_parallel or par.data_parallel, precision=precision,
                      activation_checkpointing=par.activation_checkpointing, flash_attention=plan.flash_attention,
                      expert_imbalance=plan.expert_imbalance, dp_shard=getattr(par, "dp_shard", None),
                      selective_policy=plan.selective_policy,
                      compile=bool(plan.compile or getattr(par, "compile", False)),
                      float8=bool(plan.float8 or getattr(par, "float8", False)),
                      kernels=plan.kernels, cp_algorithm=getattr(par, "cp_algorithm", None) or "auto")
    notes += [f"planner only: {x}" for x in planner_only(train)] + runtime_speed_notes(train)
    bad = [r for r in plan.trace_ranks or [] if not 0 <= r < world]
    if bad:
        raise PlanError(f"plan.trace_ranks={bad} are outside the world of {world} ranks.")
    if plan.materialize_rank is not None and not plan.materialize_rank < world:
        raise PlanError(f"plan.materialize_rank={plan.materialize_rank} is outside the world of {world} ranks "
                        f"(0 ... {world - 1}).")
    return PlanSetup(c, plan, spec, dims, cluster, train, notes)


def _model_spec(c: TrainConfig, notes: list[str]) -> TransformerSpec:
    """The planner's spec of ``c.model``; for ``model=hf`` also checked against the model's own parameter count."""
    spec = model_spec(c.model)
    if not isinstance(c.model, HFModelConfig):
        return spec
    from lightning_4d.recipes.hf_model import hf_param_count, hf_spec_notes

    if spec is None:
        raise PlanError(
            f"{c.model.source_key}={c.model.source!r}: the planner cannot describe this Hugging Face config as a "
            f"decoder-only transformer (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size or "
            f"experts); {'; '.join(hf_spec_notes(c.model)) or 'see lightning_4d.recipes.hf_model.hf_spec'}.")
    exact = hf_param_count(c.model).total
    planned = spec.total_params()
    notes += [f"hf: {x}" for x in hf_spec_notes(c.model)]
    if planned == exact:
        notes.append(f"hf: parameters {exact:,} (the planner's count equals the model's own, built on meta)")
    else:
        notes.append(f"hf: parameters {exact:,} counted on a meta build; the planner's shape holds {planned:,} "
                     f"({(planned - exact) / exact:+.2%}): its memory and time are for that shape")
    return spec


# ---------------------------------------------------------------------------------------------- dry run
def _traced_model(model: ModelConfig, blocks: int) -> ModelConfig:
    """The model schema cut to ``blocks`` blocks (same widths); an MoE keeps dense and MoE blocks when both exist."""
    changes: dict[str, int] = {"n_layer" if hasattr(model, "n_layer") else "n_layers": blocks}
    if getattr(model, "first_dense_layers", 0):
        changes["first_dense_layers"] = 0 if blocks == 1 else min(model.first_dense_layers, blocks // 2)
    return dataclasses.replace(model, **changes)


def _n_blocks(model: ModelConfig) -> int:
    return model_spec(model).layers


def trace_blocks(setup: PlanSetup) -> int:
    """How many blocks the dry run traces: ``plan.trace_blocks`` or the whole model up to :data:`TRACE_BLOCKS`,
    as a multiple of the pipeline stages (at least one block per stage).

    Example:
        >>> # not run: needs files (the recipe's config files)
        >>> trace_blocks(setup)  # doctest: +SKIP
        40
    """
    total = _n_blocks(setup.config.model)
    stages = setup.dims.num_stages
    want = setup.plan.trace_blocks if setup.plan.trace_blocks is not None else (
        total if total <= TRACE_BLOCKS else TRACE_BLOCKS)
    if want >= total:
        return total
    return min(total, max(stages, want // stages * stages))


def run_dry_run(setup: PlanSetup) -> DryRunResult:
    """:func:`~lightning_4d.planner.dry_run.dry_run` of the config's model (cut to :func:`trace_blocks` blocks)
    with the setup's layout and micro-batch. A Hugging Face model is traced from its config alone (randomly
    initialised on the meta device: no weights are read), cut in a temporary ``config.json``.

    Example:
        >>> # not run: needs files (the recipe's config files)
        >>> run_dry_run(plan_setup(cfg)).ok  # doctest: +SKIP
        True
    """
    import tempfile

    import torch  # noqa: F401 - the model builder runs under torch.device("meta")

    blocks = trace_blocks(setup)
    total = _n_blocks(setup.config.model)
    with tempfile.TemporaryDirectory(prefix="plan_hf_") as tmp:
        model = setup.config.model
        if isinstance(model, HFModelConfig):
            from lightning_4d.recipes.hf_model import hf_config_with_layers

            model = hf_config_with_layers(model, blocks, Path(tmp))
        elif blocks < total:
            model = _traced_model(model, blocks)
        c = dataclasses.replace(setup.config, model=model)
        spec = model_spec(model).with_(seq_len=setup.train.seq(setup.spec))
        result = dry_run(lambda: build_model(c), spec, setup.dims, setup.train, ranks=setup.plan.trace_ranks)
    if blocks < total:
        result.assumptions.append(
            f"dry run: {blocks} of {total} blocks traced (plan.trace_blocks); the formulas are "
            f"per block, compared for the same {blocks} blocks")
    return result


def run_setup_simulation(setup: PlanSetup, plan: dict) -> str:
    """Set up rank ``plan.materialize_rank`` of the configured run for real in this process
    (:func:`~lightning_4d.planner.setup_rank.simulate_setup`, the whole model) and compare its measured peak with the
    planner's set-up term for that rank's pipeline role (``plan["memory"]["per_role"]``: tensors only, the CPU
    process's own runtime is outside both); the result is stored as ``plan["setup_simulation"]``.

    Example:
        >>> # not run: needs a process group (a fake one) and files (the recipe's config files)
        >>> print(run_setup_simulation(plan_setup(cfg), plan))  # doctest: +SKIP
        set-up of rank 0 of 512, run here ...
    """
    from lightning_4d.mesh import rank_coordinates
    from lightning_4d.planner.dry_run import strategy_config
    from lightning_4d.planner.setup_rank import simulate_setup

    rank = setup.plan.materialize_rank
    assert rank is not None
    pp_rank = rank_coordinates(setup.dims, rank)["pp"]
    role = next(r for r in plan["memory"]["per_role"] if r["pp_rank"] == pp_rank)
    estimate = float(role["setup"])
    measured = simulate_setup(lambda: build_model(setup.config), setup.dims, rank,
                              config=strategy_config(setup.dims, setup.train), precision=setup.train.precision)
    plan["setup_simulation"] = {**measured.as_dict(), "estimate_bytes": estimate,
                                "measured_over_estimate": measured.ratio(estimate)}
    return measured.describe(estimate)


def target_dir(output: str, out_dir: Optional[Union[str, Path]], setup: PlanSetup) -> Path:
    """The directory ``plan.output`` names (relative to ``out_dir``, default the run's output directory)."""
    target = Path(output)
    if not target.is_absolute():
        target = Path(out_dir if out_dir is not None else output_dir(setup.config)) / target
    return target.parent


def write_layout_plan(setup: PlanSetup, directory: Path) -> str:
    """Derive the layout plan the strategy would apply (:func:`~lightning_4d.layout.derive_plan.plan_layout` on a meta
    build of the configured model: no weights), write it as ``layout_plan.json`` and ``layout_plan.txt`` (one line
    per module) in ``directory``, and return a short report; a model that cannot be built on meta is reported,
    not raised (the analytic plan stands without it).

    Example:
        >>> # not run: needs files (the recipe's config files)
        >>> print(write_layout_plan(plan_setup(cfg), tmp_path))  # doctest: +SKIP
        layout plan tp=2 pp=1 ep=1 dp=4: 2 blocks at 'model.layers'; ... -> .../layout_plan.json
    """
    import torch

    from lightning_4d.layout.derive_plan import plan_layout
    from lightning_4d.plan import PLAN_FILE
    from lightning_4d.planner.dry_run import strategy_config

    try:
        with torch.device("meta"):
            model = build_model(setup.config)
        layout = plan_layout(model, setup.dims, strategy_config(setup.dims, setup.train))
    except Exception as err:  # noqa: BLE001 - reported: the analytic plan does not depend on it
        return f"layout plan not derived ({type(err).__name__}: {err})"
    directory.mkdir(parents=True, exist_ok=True)
    path = layout.save(directory / PLAN_FILE)
    (directory / "layout_plan.txt").write_text(str(layout) + "\n")
    return f"{layout.summary()} -> {path} (one line per module: {directory / 'layout_plan.txt'})"


# ---------------------------------------------------------------------------------------------- run
def _format_search(cands: list) -> str:
    lines = [f"layout search: the {len(cands)} fastest layouts that fit"]
    for i, cand in enumerate(cands, 1):
        lines.append(f"  #{i} {cand.label}: {cand.reason}")
    return "\n".join(lines)


def does_not_fit_message(plan: dict, device: DeviceSpec) -> str:
    """The line :func:`run_plan` ends a plan with when its layout does not fit: which peak, by how much, what to try.

    Example:
        >>> from lightning_4d.planner.hardware import H100
        >>> mem = {"peak": 80e9, "usable": 76e9, "per_role": [{"total": 80e9, "setup_total": 9e9}]}
        >>> print(does_not_fit_message({"memory": mem}, H100))
        DOES NOT FIT: the training step's peak 80 GB per GPU exceeds the usable 76 GB of a H100-SXM-80GB: try ...
    """
    mem = plan["memory"]
    setup = max(r.get("setup_total", 0.0) for r in mem["per_role"])
    which = "set-up's" if setup >= mem["peak"] else "training step's"
    bigger = "" if device.memory_bytes >= 141e9 else " a larger device (plan.device=H200),"
    return (f"DOES NOT FIT: the {which} peak {mem['peak'] / 1e9:.4g} GB per GPU exceeds the usable "
            f"{mem['usable'] / 1e9:.4g} GB of a {device.name}: try plan.search=true,{bigger} more GPUs or activation "
            f"checkpointing (exit status {EXIT_DOES_NOT_FIT}).")


def run_plan(cfg: Union[DictConfig, TrainConfig], out_dir: Optional[Union[str, Path]] = None) -> PlanOutcome:
    """Plan the configured run: table, optional dry run and search, ``plan.json``.

    Args:
        cfg: a composed ``plan`` config (or a ``train`` config: default ``plan`` section).
        out_dir: where a relative ``plan.output`` goes (default: ``output_dir``, Hydra's run directory).

    Returns:
        A :class:`PlanOutcome` (plan dict, text, path; exit code 1 when the dry run disagrees with the formulas).

    Raises:
        PlanError: the request is impossible (see :func:`plan_setup`), or ``plan.search`` finds no layout.

    Example:
        >>> # not run: needs files (the recipe's config files)
        >>> outcome = run_plan(cfg, tmp_path)  # doctest: +SKIP
        >>> outcome.plan["total_params"]  # doctest: +SKIP
        1038954930176
    """
    start = time.perf_counter()
    setup = plan_setup(cfg)
    plan_cfg = setup.plan
    plan = make_plan(setup.spec, setup.dims, setup.cluster, setup.train, replay_bubble=setup.dims.pp > 1)
    plan["inputs"] = {"model": setup.config.model.name, "parallel": setup.config.parallel.name,
                      "device": setup.cluster.device.name, "notes": list(setup.notes)}
    plan["assumptions"] = list(plan["assumptions"]) + list(setup.notes)
    text = [format_table(plan)]
    exit_code = 0
    result = None
    if plan_cfg.trace:
        try:
            result = run_dry_run(setup)
        except Exception as err:  # noqa: BLE001 - the analytic plan stands without the cross-check
            plan["dry_run"] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            text += ["", f"dry run failed ({type(err).__name__}: {err}); the plan above is analytic only. "
                         f"Skip it with plan.trace=false."]
            exit_code = EXIT_TRACE_DIFFERS
    if result is not None:
        detected = result.expert_reshard_after_forward
        designed = (setup.train.reshard_after_forward if setup.train.reshard_after_forward is not None
                    else reshards_after_forward(setup.dims.pp))
        if detected is not None and setup.train.expert_reshard_after_forward is None and detected != designed:
            # Plan what the code does: the traced wrapping of the experts replaces the planner's default.
            setup.train = setup.train.with_(expert_reshard_after_forward=detected)
            note = (f"experts: lightning_4d.layout.parallelize wraps them with FSDP reshard_after_forward={detected} (seen in "
                    f"the dry run); the plan uses that instead of the planner's default")
            setup.notes.append(note)
            inputs, assumptions = plan["inputs"], plan["assumptions"] + [note]
            plan = make_plan(setup.spec, setup.dims, setup.cluster, setup.train, replay_bubble=setup.dims.pp > 1)
            plan["inputs"], plan["assumptions"] = inputs, list(plan["assumptions"]) + [
                a for a in assumptions if a not in plan["assumptions"]]
            text[0] = format_table(plan)
        plan["dry_run"] = result.as_dict()
        plan["assumptions"] += [a for a in result.assumptions if a not in plan["assumptions"]]
        text += ["", result.format()]
        if not result.ok:
            exit_code = EXIT_TRACE_DIFFERS
    if plan_cfg.search:
        try:
            cp = tuple(plan_cfg.context_parallel) if plan_cfg.context_parallel is not None else None
            cands = search(setup.spec, setup.cluster, setup.train, top=plan_cfg.top, context_parallel=cp)
        except NoLayoutFits as err:
            raise PlanError(str(err)) from None
        except ValueError as err:
            raise PlanError(f"search: {err}") from None
        plan["search"] = [cand.as_dict() for cand in cands]
        text += ["", _format_search(cands)]
    if plan_cfg.materialize_rank is not None:
        text += ["", run_setup_simulation(setup, plan)]
    text += ["", write_layout_plan(setup, target_dir(plan_cfg.output, out_dir, setup))]
    if not plan["memory"]["fits"]:
        text += ["", does_not_fit_message(plan, setup.cluster.device)]
        exit_code = EXIT_DOES_NOT_FIT
    plan["planner_seconds"] = time.perf_counter() - start
    target = target_dir(plan_cfg.output, out_dir, setup) / Path(plan_cfg.output).name
    path = write_plan(plan, target)
    text.append(f"\nplan written to {path}")
    return PlanOutcome(plan, "\n".join(text), path, exit_code, time.perf_counter() - start)
