"""Dry run of the real layout on one CPU: the rewriting training uses, traced on a fake process group.

For each *role* (one global rank per pipeline rank; ranks of one stage hold equal shares and send
the same bytes) :func:`dry_run` does, in one process and without allocating any parameter:

1. make the process rank ``r`` of a ``fake`` process group of the full world size
   (:func:`~lightning_4d.planner.fake_world.fake_world`) and build the package's meshes
   (:func:`lightning_4d.mesh.build_mesh`, with the ``cp`` axis under context parallelism);
2. build the user's LightningModule on the ``meta`` device and rewrite it with
   :func:`lightning_4d.layout.parallelize.parallelize_module` — the very function ``FourDStrategy`` calls:
   pipeline split, expert parallelism, TP/SP, activation checkpointing, FSDP2 / replicate;
3. turn the (already sharded) meta parameters into fake tensors (``to_empty`` under
   ``FakeTensorMode``) and run one training step of the strategy's own (:mod:`lightning_4d.runtime.step`, the functions
   ``FourDStrategy`` calls): the batch's zigzag sequence shard under context parallelism, the global-batch loss
   (forward and ``loss_fn`` under loss parallelism and the cp attention, token-weighted over ``dp × cp``; under
   pipelining the runner's own micro-batch loss weighting, loss broadcast and token totals), the backward, the
   once-per-step tp reduction of sequence-parallel partial gradients and tied-embedding exchange, one step of the
   module's own optimizer (``configure_optimizers``, as Lightning builds it) and the expert-bias update (gradient
   clipping runs only when a Trainer asks for it: not traced);
4. record every collective with its bytes and mesh axis
   (:class:`~lightning_4d.planner.fake_world.CollectiveRecorder`) and compare them, axis by axis and
   kind by kind, with the formulas of :func:`lightning_4d.planner.comm.comm_per_rank` for the same
   model, layout and micro-batch (``m = 1``).

What is real and what is a stand-in:

- Real: every module rewrite, DTensor redistribution, FSDP2 all-gather / reduce-scatter, the
  expert all-to-alls (dispatch, combine and their backward), the router statistics all-reduces,
  activation-checkpoint recomputation, loss-parallel all-reduces.
- **Routing is uniform** (the planner's assumption): under fake tensors the router's choices are
  unknown and counting tokens per expert has a data-dependent shape (``aten.bincount``), so the
  MoE layers route by a :class:`~lightning_4d.expert_parallel.permute.FixedRouting`
  (:func:`uniform_routing`: the assignments go round-robin over the ep ranks, then over each rank's
  experts, :func:`uniform_experts`), built on real index tensors, and the per-expert counts every rank
  receives are those of uniform routing. Dispatch, combine and the experts then run unchanged (experts
  with the loop kernel unless bf16: ``grouped_mm="auto"`` declines fake fp32 tensors, the meta kernel of
  ``torch._grouped_mm`` takes bf16 only).
  The router's own token counts are fake zeros (they only feed the aux-loss statistics).
- Host-side random draws (``torch.randint``, e.g. the per-TP-rank dropout seeds) run on real tensors.
- The pipeline stages are installed and pruned as in training (``layout.pipeline_glue.install_stages``); their
  value check (``pipeline.checks.check_staged``) compares nothing on meta (no data). Torch's pipeline schedule is
  not run (its warm-up reads received values): :func:`lightning_4d.layout.pipeline_glue.pipeline_train_loss` runs with a
  stand-in schedule (:data:`~lightning_4d.pipeline.runner.ScheduleRun`) that runs each stage module directly, and
  the pp activation traffic is *measured* from the stage boundary tensors (output forward, input gradient
  backward) instead of traced. Receives are not counted (the formulas count what each rank sends).
- Under context parallelism the model's attention masks have no values on fake tensors: the cp attention
  uses the global causal mask of the same shape (a real run checks the mask at set-up and in every step);
  scalar reads of fake floating tensors (the loss's token total) give 1.0.
- One micro-batch: per-step totals of the formulas scale with ``m`` (FSDP gathers per the schedule rule). When a
  rank's ``N·k`` assignments are not a multiple of ``ep`` (a short traced sequence, many ep ranks), the stand-in
  routing cannot be uniform — every rank routes alike, so fewer than ``ep`` assignments reach only the first ranks
  — and the traced micro-batch is widened until they are (:func:`traced_micro_batch`; formulas at the same size).

What the cross-check found (and :mod:`~lightning_4d.planner.comm` now models): FSDP2 blocks and expert
units do not reshard after forward under pipelining (:func:`lightning_4d.layout.data_parallel.reshards_after_forward`,
the rule both use; the dry run still reads what the wrapped experts do, compares with that and says so if it
differs from the rule); FSDP2 pads the ``E/ep`` local experts to a multiple of ``edp`` (the 1T MoE's 8 local experts over edp = 16: twice the expert bytes); without SP the tp-replicated
parameters need no reduction; with SP and dp = 1 the norms' gradients stay ``Partial`` through
backward (AdamW would all-reduce them on each of its 3 reads; the strategy now resolves them once per
step); row-parallel biases need none; router and shared-expert
gradients are summed over tp once per step on the FSDP shard; the router's aux-loss statistics are
all-reduced over ep and edp; recomputation repeats the forward collectives except a dense block's
last reduction (torch's checkpoint stops early); GPT-2's embedding output is all-reduced, then split.

Nothing of the package is patched: the dry run uses the library's own seams — the MoE layers'
:data:`~lightning_4d.expert_parallel.permute.FIXED_ROUTING` (a ``ContextVar``, set only inside
:func:`uniform_routing`), the pipeline check's, the cp attention's and ``grouped_mm="auto"``'s own rules for
meta / fake tensors, the pipeline runner's ``schedule_run`` — and calls the step's functions
(:mod:`lightning_4d.runtime.step`) the strategy calls too.

Example:
    >>> import torch
    >>> from lightning_4d.models import CausalLM, Llama, LlamaConfig
    >>> from lightning_4d.mesh import ParallelDims
    >>> from lightning_4d.planner import TrainSpec, TransformerSpec
    >>> cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=32)
    >>> result = dry_run(lambda: CausalLM(Llama(cfg)), TransformerSpec.from_config(cfg, seq_len=32),
    ...                  ParallelDims.from_world(8, tp=2, pp=2), TrainSpec(4, precision="32-true"))
    >>> result.ok, [r.rank for r in result.ranks], sorted(result.ranks[0].traced)
    (True, [0, 7], ['dp', 'pp', 'tp'])
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from lightning_4d._compat import clear_dtensor_caches, fake_tensor_mode
from lightning_4d.core.comm import CommRecord, mesh_axis_groups, name_axis
from lightning_4d.config import FourDConfig
from lightning_4d.layout.data_parallel import reshards_after_forward
from lightning_4d.mesh import FourDMesh, ParallelDims, rank_coordinates
from lightning_4d.planner.comm import comm_per_rank, summarize
from lightning_4d.planner.memory import micro_batch_size, stage_layout
from lightning_4d.planner.spec import TrainSpec, TransformerSpec
from lightning_4d.core.precision import precision_info
from lightning_4d.planner.dry_run_report import (
    _AXES, DRY_RUN_ASSUMPTIONS, DryRunResult, RankTrace, _close, _fmt, _union,
)
from lightning_4d.planner.dry_run_stand_ins import (
    _reshards_after_forward, _stand_in_schedule, fake_friendly_mode, traced_micro_batch, uniform_experts,
    uniform_routing,
)

__all__ = ["RankTrace", "DryRunResult", "dry_run", "fake_friendly_mode", "representative_ranks", "strategy_config",
           "traced_micro_batch", "uniform_experts", "uniform_routing", "DRY_RUN_ASSUMPTIONS"]

# ---------------------------------------------------------------------------------------------- ranks
def representative_ranks(dims: ParallelDims) -> list[int]:
    """One global rank per pipeline rank (the roles), with tp / cp / dp coordinates varying between roles.

    All ranks of a pipeline rank hold equal shares and send the same bytes, so one of each suffices;
    pp rank ``r`` is represented by the rank with ``tp = r mod tp``, ``cp = r mod cp`` and ``dp = r mod dp``
    (the mesh is ``(pp, dp, cp, tp)``).

    Example:
        >>> representative_ranks(ParallelDims.from_world(512, tp=8, pp=4, ep=8))
        [0, 137, 274, 411]
        >>> representative_ranks(ParallelDims.from_world(16, tp=2, pp=2, cp=2))
        [0, 15]
    """
    inner = dims.dp * dims.cp * dims.tp
    return [r * inner + (r % dims.dp) * dims.cp * dims.tp + (r % dims.cp) * dims.tp + (r % dims.tp)
            for r in range(dims.pp)]


def _shared_axes(mesh: FourDMesh) -> dict[str, tuple[str, ...]]:
    """Each axis the formulas name → every mesh axis spanning its process group (as the recorder sees them)."""
    groups = mesh_axis_groups(mesh)
    axes = [a for a in _AXES if a != "cp" or mesh.dims.cp > 1]  # no cp dimension without context parallelism
    return {axis: groups.get(mesh[axis].get_group().group_name, (axis,)) for axis in axes}


def _merge_shared_axes(summary: dict[str, dict[str, float]], shared: dict[str, tuple[str, ...]]
                       ) -> dict[str, dict[str, float]]:
    """Name the formulas' traffic on a group several axes span as the recorder names it (the package's one
    namer, :func:`lightning_4d.core.comm.name_axis`)."""
    out: dict[str, dict[str, float]] = {}
    for axis, kinds in summary.items():
        for kind, v in kinds.items():
            target = name_axis(shared.get(axis, (axis,)), kind)
            out.setdefault(target, {})[kind] = out.get(target, {}).get(kind, 0) + v
    return out


def _trace_rank(build: Callable[[], nn.Module], spec: TransformerSpec, dims: ParallelDims, train: TrainSpec,
                config: FourDConfig, rank: int, b: int, boundary: dict) -> RankTrace:
    import torch.distributed as dist

    from lightning_4d.context_parallel import takes_positions
    from lightning_4d.mesh import build_mesh
    from lightning_4d.layout.derive_plan import plan_layout
    from lightning_4d.mesh import Axis
    from lightning_4d.layout.parallelize import parallelize_module
    from lightning_4d.planner.fake_world import CollectiveRecorder, fake_world
    from lightning_4d.runtime.step import after_optimizer_step, finish_backward, loss_context, step_loss

    # what Lightning's mixed-precision plugin wraps the training step in
    def autocast() -> contextlib.AbstractContextManager[None]:
        info = precision_info(precision)
        return torch.autocast("cpu", dtype=info.compute_dtype) if info.mixed else contextlib.nullcontext()

    start = time.perf_counter()
    s = train.seq(spec)
    precision = train.precision
    coords = rank_coordinates(dims, rank)
    clear_dtensor_caches()
    with fake_world(dims.world_size, rank=rank):
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            module = build()
        with fake_friendly_mode():  # the set-up trace routes on meta tensors too
            # cp: the algorithm from the spec's heads (K/V repeated to every query head, as the formulas assume),
            # not a second trace of the model on meta (an MoE's routing has no values there)
            heads = [("the attention", spec.heads, spec.heads, False)] if dims.cp > 1 else None
            layout = plan_layout(module, mesh.dims, config, mesh[Axis.TP] if dims.tp > 1 else None,
                                 attention_heads=heads)
            plan = parallelize_module(module, mesh, config, precision, accumulate=1, plan=layout)
        expert_modules = [module.get_submodule(n) for n in plan.expert_modules]
        expert_raf = {_reshards_after_forward(e) for e in expert_modules} - {None}
        runner = plan.pipeline
        stage_ids = list(runner.stage_ids) if runner is not None else [0]
        names = _shared_axes(mesh)
        fake_mode = fake_tensor_mode()
        with fake_mode:
            module.to_empty(device="cpu")
        sends: list[CommRecord] = []
        schedule_run = _stand_in_schedule(dims, spec, precision, b, s, coords["pp"], boundary, sends) \
            if runner is not None else None
        with uniform_routing(dims.ep), CollectiveRecorder(mesh) as rec, fake_mode, fake_friendly_mode():
            tokens = torch.randint(0, spec.vocab_size, (b, s))  # (b, s): the micro-batch, whole sequences
            targets = torch.randint(0, spec.vocab_size, (b, s))
            module.train()
            # The strategy's step (lightning_4d.runtime.step): sequence shard (cp), loss under loss_parallel / the global
            # attention, token-weighted over dp × cp; under pp forward and backward inside the pipeline step.
            with autocast():
                loss, shard = step_loss(module, tokens, targets, plan, mesh, takes_positions(module),
                                        schedule_run=schedule_run)
            if runner is None:
                with loss_context(plan, shard):
                    loss.backward()
            finish_backward(plan, mesh, module)
            skipped = _optimizer_step(module)
            after_optimizer_step(plan, module)
        traced_records = rec.records + sends
    clear_dtensor_caches()
    assert not dist.is_initialized()

    traced: dict[str, dict[str, float]] = {}
    traced_calls: dict[str, dict[str, int]] = {}
    for t in traced_records:
        if t.kind == "recv":
            continue  # bytes received are the peer's send (the formulas count what each rank sends)
        traced_calls.setdefault(t.axis, {})
        traced_calls[t.axis][t.kind] = traced_calls[t.axis].get(t.kind, 0) + 1
        if t.sent_bytes:
            traced.setdefault(t.axis, {})
            traced[t.axis][t.kind] = traced[t.axis].get(t.kind, 0.0) + t.sent_bytes

    notes: list[str] = [skipped] if skipped else []
    ref = train.with_(global_batch_size=b * dims.dp, microbatches=1)
    if len(expert_raf) == 1:
        (raf,) = expert_raf
        designed = (train.reshard_after_forward if train.reshard_after_forward is not None
                    else reshards_after_forward(dims.pp))
        if train.expert_reshard_after_forward is None and raf != designed:
            notes.append(f"experts are wrapped with reshard_after_forward={raf} by lightning_4d.layout.parallelize; the "
                         f"planner's default assumes {designed} (compared with {raf})")
        ref = ref.with_(expert_reshard_after_forward=raf)
    records = comm_per_rank(spec, dims, ref)[coords["pp"]]
    analytic = _merge_shared_axes(summarize(records), names)
    analytic_calls: dict[str, dict[str, int]] = {}
    for rec_ in records:
        if rec_.group > 1 or rec_.kind == "send":
            for ax, kinds in _merge_shared_axes({rec_.axis: {rec_.kind: rec_.calls}}, names).items():
                for kind, calls in kinds.items():
                    analytic_calls.setdefault(ax, {})
                    analytic_calls[ax][kind] = analytic_calls[ax].get(kind, 0) + int(calls)
    differences = []
    for axis, kinds in _union(traced, analytic).items():
        for kind in kinds:
            t, a = traced.get(axis, {}).get(kind, 0.0), analytic.get(axis, {}).get(kind, 0.0)
            if not _close(t, a):
                differences.append(f"{axis} {kind}: traced {_fmt(t)} ({traced_calls.get(axis, {}).get(kind, 0)} "
                                   f"calls), formula {_fmt(a)} ({analytic_calls.get(axis, {}).get(kind, 0)} calls)")
    layout = stage_layout(spec, dims, train.schedule)
    return RankTrace(rank, coords, stage_ids, layout[coords["pp"]], traced, traced_calls, analytic, analytic_calls,
                     differences, time.perf_counter() - start, notes,
                     expert_raf.copy().pop() if len(expert_raf) == 1 else None)


_UNTRACED_STEP = "optimizer step not traced"


def _optimizer_step(module: nn.Module) -> Optional[str]:
    """One step of the module's own optimizer (``configure_optimizers``) on the fake gradients: DTensor gradients
    still ``Partial`` after backward (sequence-parallel norms outside any data-parallel wrapper) are reduced here."""
    try:
        configured = module.configure_optimizers() if hasattr(module, "configure_optimizers") else None
    except Exception as err:  # noqa: BLE001 - e.g. an optimizer that needs a Trainer: the step is left out
        return f"{_UNTRACED_STEP} (configure_optimizers raised {type(err).__name__}: {err})"
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)):
        configured = configured[0] if configured else None
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if configured is None:
        return f"{_UNTRACED_STEP} (configure_optimizers gave no optimizer)"
    configured.step()
    return None


def _warn_untraced_step(result: DryRunResult) -> None:
    """One warning per dry run when a traced rank could not run the module's optimizer step: its collectives (the
    reductions of ``Partial`` gradients AdamW's step triggers) and its optimizer state are then missing from the
    traced figures, which may differ from a real step's."""
    causes = list(dict.fromkeys(n for r in result.ranks for n in r.notes if n.startswith(_UNTRACED_STEP)))
    if causes:
        ranks = [r.rank for r in result.ranks if any(n.startswith(_UNTRACED_STEP) for n in r.notes)]
        warnings.warn(
            f"lightning_4d.planner.dry_run: the optimizer step was not traced on ranks {ranks} — "
            f"{'; '.join(causes)}. The step's collectives and optimizer state are missing from the traced figures. "
            f"Fix: make `configure_optimizers()` return an optimizer without a Trainer attached.", stacklevel=3)


# ---------------------------------------------------------------------------------------------- entry point
def strategy_config(dims: ParallelDims, train: TrainSpec) -> FourDConfig:
    """The ``FourDConfig`` the strategy would get for ``dims`` and ``train`` (what the dry run applies).

    Example:
        >>> strategy_config(ParallelDims.from_world(4, tp=2), TrainSpec(global_batch_size=8)).tp
        2
    """
    return FourDConfig(
        tp=dims.tp, pp=dims.pp, ep=dims.ep, dp=dims.dp, cp=dims.cp, sequence_parallel=dims.sequence_parallel,
        microbatches=train.microbatches, schedule=train.schedule if dims.pp > 1 else "1f1b",
        virtual_stages=dims.virtual_stages if dims.pp > 1 else None, data_parallel=train.data_parallel,
        activation_checkpointing=train.activation_checkpointing, cp_algorithm=train.cp_algorithm,
        dp_shard=(train.dp_shard or dims.dp_shard) if train.data_parallel == "hsdp" else None)


def dry_run(build: Callable[[], nn.Module], spec: TransformerSpec, dims: ParallelDims, train: TrainSpec,
            ranks: Optional[Sequence[int]] = None, config: Optional[FourDConfig] = None) -> DryRunResult:
    """Trace one micro-batch of the real layout for each role and compare with the formulas (module docstring).

    Args:
        build: builds the LightningModule (a ``FourDModule`` with ``loss_fn``) on the current default device;
            it is called under ``torch.device("meta")`` once per traced rank.
        spec: the planner's description of the *same* model (its counts must match ``build()``'s).
        dims: the layout (its ``world_size`` is the fake group's size).
        train: micro-batch size (``global_batch_size / (dp · m)``), sequence length, schedule, precision
            (``"bf16-mixed"``: bf16 autocast and FSDP2 mixed precision, as Lightning's plugin), data
            parallelism and activation checkpointing.
        ranks: global ranks to trace (default :func:`representative_ranks`).
        config: a :class:`~lightning_4d.config.FourDConfig` (default: built from ``dims`` and ``train``).

    Returns:
        A :class:`DryRunResult`; ``result.ok`` when every traced byte count equals the formula's.

    Raises:
        RuntimeError: a process group is already initialised in this process.

    Example:
        >>> # not run: needs a process group (a fake one per traced rank)
        >>> dry_run(build, spec, ParallelDims.from_world(512, tp=8, pp=4, ep=8), train).ok  # doctest: +SKIP
        True
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group (it creates a fake one per rank).")
    start = time.perf_counter()
    config = config if config is not None else strategy_config(dims, train)
    b = traced_micro_batch(spec, dims, micro_batch_size(dims, train), train.seq(spec))
    ranks = list(ranks) if ranks is not None else representative_ranks(dims)
    # Trace a rank holding stage 0 first: its output shape is the boundary later stages receive.
    order = sorted(range(len(ranks)), key=lambda i: (rank_coordinates(dims, ranks[i])["pp"] != 0, i))
    boundary: dict = {}
    result = DryRunResult(
        world_size=dims.world_size,
        layout={"tp": dims.tp, "pp": dims.pp, "ep": dims.ep, "dp": dims.dp, "cp": dims.cp, "edp": dims.edp,
                "sequence_parallel": dims.sp, "virtual_stages": dims.virtual_stages,
                "schedule": train.schedule if dims.pp > 1 else "none", "data_parallel": train.data_parallel,
                "activation_checkpointing": train.activation_checkpointing},
        model=spec.name or "model", layers=spec.layers, micro_batch_size=b, seq_len=train.seq(spec),
        precision=train.precision)
    if b != micro_batch_size(dims, train):
        result.assumptions.append(
            f"dry run: micro-batch of {b} sequences, not {micro_batch_size(dims, train)}, so that uniform routing "
            f"gives each of the {dims.ep} ep ranks the same number of assignments (formulas at the same size)")
    for i in order:
        result.ranks.append(_trace_rank(build, spec, dims, train, config, ranks[i], b, boundary))
    result.ranks.sort(key=lambda t: t.rank)
    _warn_untraced_step(result)
    result.seconds = time.perf_counter() - start
    return result
