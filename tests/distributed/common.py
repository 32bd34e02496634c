"""Shared pieces of the parity tests: tiny models, data, a fit that records losses and gradients.

A *spec* is a plain dict (picklable) describing one run: model kind, strategy options, trainer
options. :func:`fit_spec` runs it in the current process (single-process reference when
``strategy`` is ``None``) and returns the per-step global losses and the full final gradients.
"""

from __future__ import annotations

import gc
import math
import os
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_4d import FourDStrategy
from lightning_4d.models import GPT2, CausalLM, GPT2Config, HFStyleConfig, HFStyleLM, Llama, LlamaConfig

VOCAB = 64
SEQ = 16


def build_model(kind: str) -> torch.nn.Module:
    """A tiny reference model of ``kind`` (llama | llama-<layers> | llama-hooks | gpt2[-<layers>] | hf | moe* |
    mixtral), or a third-party model from :mod:`tests.distributed.byom_models` (hf-llama, hf-gpt2, nanogpt, titan,
    ...)."""
    from tests.distributed import byom_models

    if kind.startswith("lit-"):  # LitGPT's own GPT: "lit-<family>" or "lit-<family>-<layers>"
        from tests.distributed.byom_litgpt import build_litgpt

        base, _, layers = kind.rpartition("-")
        return build_litgpt(base, int(layers)) if layers.isdigit() else build_litgpt(kind)
    if kind.startswith("cp-"):
        from tests.distributed.cp_models import build_cp_model

        return build_cp_model(kind)
    if byom_models.is_byom_kind(kind):
        return byom_models.build_byom(kind)
    if kind == "llama-wide":  # llama-2's parameter names with a wider hidden size (checkpoint shape checks)
        return Llama(LlamaConfig(vocab_size=VOCAB, dim=48, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=64,
                                 max_seq_len=SEQ))
    if kind == "llama-hooks":  # its LightningModule implements the pipeline hooks (see fit_spec)
        from tests.distributed.pipeline_models import build_scaled_llama

        return build_scaled_llama(VOCAB, SEQ)
    kind, _, layers_str = kind.partition("-") if kind.split("-")[0] in ("llama", "gpt2") else (kind, "", "")
    layers = int(layers_str) if layers_str else 2
    if kind == "llama":
        return Llama(LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=layers, n_heads=8, n_kv_heads=4, ffn_hidden=64,
                                 max_seq_len=SEQ))
    if kind == "gpt2":
        return GPT2(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, block_size=SEQ))
    if kind == "hf":
        return HFStyleLM(HFStyleConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ))
    if kind.startswith("moe"):
        from tests.distributed.moe_models import build_moe_model

        # "moe", "moe-aux" (aux loss), "moe-bias" (aux-loss-free bias update), "moe-all" (every token to every
        # expert: no top-k choice that a 16-bit rounding could flip)
        return build_moe_model(aux=0.01 if kind == "moe-aux" else 0.0, bias_rate=1e-3 if kind == "moe-bias" else 0.0,
                               top_k=4 if kind == "moe-all" else 2)
    if kind == "mixtral":
        from tests.distributed.moe_models import build_mixtral_model

        return build_mixtral_model()
    raise ValueError(kind)


def make_dataset(num_samples: int, seed: int = 1234, ignore_fraction: float = 0.2) -> TensorDataset:
    """Random tokens; targets are next tokens with some positions set to -100 (ignored)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_samples, SEQ + 1), generator=gen)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    mask = torch.rand(targets.shape, generator=gen) < ignore_fraction
    targets[mask] = -100
    return TensorDataset(inputs, targets)


def packed_positions(num_samples: int, seed: int = 4321) -> torch.Tensor:
    """``position_ids`` ``(N, SEQ)`` of rows packed from 1–3 documents of random lengths (0 where one starts)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_samples):
        cuts = sorted(torch.randperm(SEQ - 1, generator=gen)[:int(torch.randint(0, 3, (1,), generator=gen))] + 1)
        bounds = [0, *map(int, cuts), SEQ]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    return torch.stack(rows)


class _ReferenceBiasUpdate(L.Callback):
    """Single-process reference: apply the aux-loss-free expert-bias update after every optimizer step,
    as ``FourDStrategy.optimizer_step`` does (Lightning's own strategies never call it)."""

    def __init__(self) -> None:
        self.step = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step != self.step:  # an optimizer step happened (not an accumulation micro-step)
            self.step = trainer.global_step
            from lightning_4d.expert_parallel import update_expert_bias

            update_expert_bias(pl_module)


class HostSyncsPerStep(L.Callback):
    """Host syncs (:class:`~lightning_4d.testing.HostSyncCounter`) of each training batch whose index is in
    ``batches``, from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, guard, clipping and
    optimizer step): ``per_step[i] = (count, report)``."""

    def __init__(self, batches: Any) -> None:
        self.batches = set(batches)
        self.per_step: dict[int, tuple[int, str]] = {}
        self._counter: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if idx in self.batches:
            from lightning_4d.testing import HostSyncCounter

            self._counter = HostSyncCounter().__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.per_step[idx] = (self._counter.count, self._counter.report())
            self._counter = None


class GraphsPerStep(L.Callback):
    """Graphs ``torch.compile`` has compiled in this process after each training step (a count that stays put once
    nothing recompiles)."""

    def __init__(self) -> None:
        self.per_step: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        from lightning_4d._compat.compile import compiled_graphs

        self.per_step.append(compiled_graphs())


def float8_reference(lm: torch.nn.Module, recipe: str) -> None:
    """Convert ``lm``'s linear layers to Float8 (emulated) as ``FourDStrategy(float8=True, float8_recipe=recipe)``
    does on one process: the plan's rule, the same torchao configuration."""
    from lightning_4d.config import FourDConfig
    from lightning_4d.layout.derive_plan import plan_layout
    from lightning_4d.mesh import ParallelDims
    from lightning_4d.speed.float8 import apply_float8

    plan = plan_layout(lm, ParallelDims(world_size=1), FourDConfig(float8=True, float8_recipe=recipe))
    assert apply_float8(lm, plan.float8_linears, recipe, emulate=True, fsdp_all_gather=False) > 0


class _Recorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def full_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full gradients by parameter name in the user's own layout (fused projections that TP permuted are
    compared unpermuted); collective for DTensor gradients: call on every rank."""
    from lightning_4d.tensor_parallel.layouts import full_tensors

    return {name: g.clone().float() for name, g in full_tensors(module, grads=True).items()}


def under_source_names(grads: dict[str, torch.Tensor], renames: dict[str, tuple[str, Optional[int]]]) -> None:
    """Expert parallelism stacked a Mixtral-style list's experts (``[E, ...]``): put ``grads`` back under the user's
    names, in place (``renames``: the plan's ``source_names()``)."""
    for old, (new, index) in renames.items():
        if new in grads:
            grads[old] = grads[new] if index is None else grads[new][index]
    for new in {new for new, _ in renames.values()}:
        grads.pop(new, None)


def _tp_placement(p: torch.Tensor) -> Optional[Any]:
    """The placement of a DTensor on its mesh's ``tp`` dimension (``None``: not a DTensor or no ``tp`` dim)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return None
    names = p.device_mesh.mesh_dim_names or ()
    return p.placements[names.index("tp")] if "tp" in names else None


def _on_expert_mesh(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor) and bool({"ep", "edp"} & set(p.device_mesh.mesh_dim_names or ()))


@torch.no_grad()
def assert_replicas_identical(module: torch.nn.Module, mesh: Any, rtol: float = 1e-7) -> None:
    """Every parameter (and its gradient) replicated across the ``tp`` ranks holds the same value on each.

    ``mesh`` is the strategy's :class:`~lightning_4d.FourDMesh` (``trainer.strategy.mesh``). Local values are
    compared: ``to_local()`` of a DTensor that is not sharded on ``tp`` (a data-parallel shard is the same
    shard on every tp peer, which share their dp coordinate), the tensor itself for a plain parameter.
    Skipped: parameters sharded on ``tp``, and expert parameters (they live on the expert mesh, where tp
    peers may hold different experts). Collective over the tp group: call it on every rank; the parameter
    lists are checked to agree before any tensor is exchanged. Raises ``AssertionError`` naming the
    parameter.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    group = mesh["tp"].get_group()
    tp = dist.get_world_size(group)
    if tp == 1:
        return
    expert_prefixes = tuple(f"{n}." for n in getattr(getattr(_strategy_of(module), "plan", None), "expert_modules", ()))
    checked: list[tuple[str, torch.Tensor]] = []
    for name, p in module.named_parameters():
        if isinstance(_tp_placement(p), Shard) or _on_expert_mesh(p) or name.startswith(expert_prefixes):
            continue
        checked.append((name, p.to_local() if hasattr(p, "to_local") else p))
        g = p.grad
        if g is not None and not isinstance(_tp_placement(g), Shard):
            checked.append((f"{name} (grad)", g.to_local() if hasattr(g, "to_local") else g))
    listing = [(n, tuple(t.shape), str(t.dtype)) for n, t in checked]
    listings: list[Any] = [None] * tp
    dist.all_gather_object(listings, listing, group=group)
    for r, other in enumerate(listings):
        if other != listing:
            first = next((a, b) for a, b in zip(listing + [None], other + [None]) if a != b)
            raise AssertionError(f"tp ranks disagree on the replicated parameters: this rank has {len(listing)}, "
                                 f"tp rank {r} has {len(other)}; first difference: {first}")
    bad: list[str] = []
    for name, t in checked:
        local = t.detach().float().contiguous()
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local, group=group)
        for r, part in enumerate(parts):
            err = rel_err(part, parts[0])
            if err > rtol:
                bad.append(f"{name}: tp rank {r} differs from tp rank 0 (rel {err:.2e})")
    assert not bad, "replicated parameters differ across tp ranks:\n" + "\n".join(bad)


def _strategy_of(module: torch.nn.Module) -> Any:
    trainer = getattr(module, "_trainer", None)
    return trainer.strategy if trainer is not None else None


def sharded_on_tp(p: Optional[torch.Tensor]) -> Optional[bool]:
    """Whether ``p`` is a DTensor with a ``Shard`` placement on the tp mesh dimension (``None``: absent)."""
    from torch.distributed.tensor import Shard

    return None if p is None else isinstance(_tp_placement(p), Shard)


def fit_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one training described by ``spec``; return losses, gradients and predictions."""
    if torch.distributed.is_initialized():
        # In a world's rank: what earlier specs and imports left is frozen, so the set-up's gc.collect() walks only
        # this spec's objects (the few cycles an earlier spec left stay until the rank exits).
        gc.freeze()
    # rank_seed: every rank seeds differently (sync_module_states must still give rank 0's weights everywhere).
    torch.manual_seed(spec.get("seed", 0) + (int(os.environ.get("RANK", 0)) if spec.get("rank_seed") else 0))
    if spec.get("meta"):
        # Built on the meta device: the strategy shards it there and materialises each rank's shards (premat:
        # materialised whole here first, so the strategy takes the path of a model built for real).
        with torch.device("meta"):
            model = build_model(spec.get("model", "llama"))
    else:
        model = build_model(spec.get("model", "llama"))
    if spec.get("model") == "llama-hooks":
        from tests.distributed.pipeline_models import HookedCausalLM

        lm: CausalLM = HookedCausalLM(model, lr=spec.get("lr", 1e-3))
    else:
        lm = CausalLM(model, lr=spec.get("lr", 1e-3))
    if spec.get("float8") and spec.get("strategy") is None:  # the reference: converted by the strategy's rule
        float8_reference(lm, spec["float8"])
    if spec.get("meta") and (spec.get("strategy") is None or spec.get("premat")):
        from lightning_4d.materialize.local_shards import materialize

        materialize(lm, torch.device("cpu"))  # initial values are keyed by the LightningModule's parameter names
    steps = spec.get("steps", 5)
    accum = spec.get("accumulate", 1)
    global_batch = spec.get("global_batch", 8)
    strategy_kwargs: Optional[dict[str, Any]] = spec.get("strategy")
    devices = spec.get("world", 1)
    if strategy_kwargs is None:
        strategy: Any = "auto"
        batch = global_batch
        devices = 1
    else:
        kwargs = dict(strategy_kwargs)
        if "timeout_s" in kwargs:
            from datetime import timedelta

            kwargs["timeout"] = timedelta(seconds=kwargs.pop("timeout_s"))
        strategy = FourDStrategy(**kwargs)
        dp = devices // (kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1))
        batch = global_batch // dp
    data = make_dataset(global_batch * steps * accum, seed=spec.get("data_seed", 1234))
    if spec.get("packed"):  # (inputs, targets, position_ids): packed documents, attention kept within each
        data = TensorDataset(*data.tensors, packed_positions(len(data)))
    if strategy_kwargs is None:
        # Lightning's DistributedSampler shuffles training data with seed 0 and gives rank r the
        # r-th of every dp indices, so global batch i is perm[i·B:(i+1)·B]: replay that order.
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
        if spec.get("reorder"):  # the same batches, their samples reversed or rotated: other summation orders
            turn = (lambda part: part[1:] + part[:1]) if spec["reorder"] == "rotate" else (lambda part: part[::-1])
            order = [i for start in range(0, len(order), batch) for i in turn(order[start:start + batch])]
        loader = DataLoader(data, batch_size=batch, sampler=order)
    else:
        loader = DataLoader(data, batch_size=batch, shuffle=False)
    recorder = _Recorder()
    callbacks: list[L.Callback] = [recorder] if strategy_kwargs is not None else [recorder, _ReferenceBiasUpdate()]
    syncs = HostSyncsPerStep(spec["count_host_syncs"]) if spec.get("count_host_syncs") else None
    if syncs is not None:  # first: its window closes before the other callbacks' batch-end hooks read values
        callbacks.insert(0, syncs)
    graphs = GraphsPerStep() if spec.get("count_graphs") else None
    if graphs is not None:
        callbacks.append(graphs)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, accumulate_grad_batches=accum,
        gradient_clip_val=spec.get("clip"), precision=spec.get("precision", "32-true"),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, num_sanity_val_steps=0,
    )
    trainer.fit(lm, train_dataloaders=loader)
    if strategy_kwargs is not None and trainer.strategy.dims.tp > 1:
        assert_replicas_identical(lm, trainer.strategy.mesh)
    result: dict[str, Any] = {"losses": recorder.losses, "grads": full_grads(lm), "spec": spec}
    if strategy_kwargs is not None:  # whether the loss ran under loss_parallel (a vocabulary-parallel head)
        result["loss_parallel"] = bool(getattr(trainer.strategy.plan, "loss_parallel", False))
    if syncs is not None:
        result["host_syncs"] = syncs.per_step
    if graphs is not None:
        result["graphs"] = graphs.per_step
    if strategy_kwargs is not None and strategy_kwargs.get("compile"):  # how each block of this rank compiled
        from lightning_4d.speed.compile import compiled_mode

        result["compiled"] = [compiled_mode(b) for b in trainer.strategy.plan.blocks]
    if spec.get("placements"):  # mesh dimension names and placements of every DTensor parameter
        from torch.distributed.tensor import DTensor

        result["placements"] = {n: (tuple(p.device_mesh.mesh_dim_names or ()), tuple(map(str, p.placements)))
                                for n, p in lm.named_parameters() if isinstance(p, DTensor)}
    if spec.get("check_sharded"):
        # Per listed parameter (LightningModule names): a DTensor sharded on tp? None where this rank lacks it.
        params = dict(lm.named_parameters())
        result["sharded"] = {name: sharded_on_tp(params.get(name)) for name in spec["check_sharded"]}
    if strategy_kwargs is not None:
        under_source_names(result["grads"], trainer.strategy.layout_plan.source_names())
    if spec.get("buffers"):
        result["buffers"] = {n: b.detach().clone() for n, b in lm.named_buffers() if "expert_bias" in n}
    if spec.get("validate"):
        val = DataLoader(make_dataset(global_batch, seed=77), batch_size=batch)
        result["val_loss"] = float(trainer.validate(lm, dataloaders=val, verbose=False)[0]["val_loss"])
    if spec.get("predict"):
        preds = trainer.predict(lm, dataloaders=DataLoader(make_dataset(global_batch, seed=99), batch_size=batch))
        result["prediction_dtype"] = str(preds[0].dtype)  # the outputs' own dtype (autocast's, under *-mixed)
        local = torch.cat([p.float() for p in preds])
        if strategy_kwargs is not None and trainer.strategy.dims.dp > 1:
            # The DistributedSampler (no shuffle for predict) gives dp rank r the samples r::dp.
            import torch.distributed as dist

            dp = trainer.strategy.dims.dp
            parts = [torch.empty_like(local) for _ in range(dp)]
            dist.all_gather(parts, local, group=trainer.strategy.mesh["dp"].get_group())
            full = torch.empty((local.shape[0] * dp, *local.shape[1:]), dtype=local.dtype)
            for r, part in enumerate(parts):
                full[r::dp] = part
            local = full
        result["predictions"] = local
    return result


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / max(‖b‖, tiny)``."""
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), 1e-12))


#: How many times its reference's own reordering noise a quantity may differ by (see :func:`assert_parity`).
NOISE_FACTOR = 4.0


def parity_errors(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Relative error of every quantity ``ref`` records, by name (``loss 0``, ``grad <name>``, ``buffer <name>``,
    ``val_loss``, ``predictions``); a tied weight's second name under PP is checked to equal a gradient instead."""
    assert len(got["losses"]) == len(ref["losses"]), (got["losses"], ref["losses"])
    errs = {f"loss {i}": abs(a - b) / max(abs(b), 1e-12) for i, (a, b) in enumerate(zip(got["losses"], ref["losses"]))}
    # Under PP a weight tied between first and last stage has a second name on the last stage.
    assert set(ref["grads"]) <= set(got["grads"]), f"missing {set(ref['grads']) - set(got['grads'])}"
    for name in set(got["grads"]) - set(ref["grads"]):
        assert any(torch.equal(got["grads"][name], g) for g in got["grads"].values() if g is not got["grads"][name]), (
            f"unexpected parameter {name}")
    errs.update({f"grad {name}": rel_err(got["grads"][name], g) for name, g in ref["grads"].items()})
    errs.update({f"buffer {name}": rel_err(got["buffers"][name], b) for name, b in ref.get("buffers", {}).items()})
    if "val_loss" in ref:
        errs["val_loss"] = abs(got["val_loss"] - ref["val_loss"]) / abs(ref["val_loss"])
    if "predictions" in ref:
        errs["predictions"] = rel_err(got["predictions"], ref["predictions"])
    return errs


def reordering_noise(ref: dict[str, Any]) -> Optional[dict[str, float]]:
    """The reference's own rounding noise, per quantity (:func:`parity_errors` names): its difference from the same
    single-process run with each batch's samples in reverse order (the same batches, so the same mathematics; other
    summation orders in every reduction over the batch). Run once per reference, on first need, and kept in it;
    ``None`` for a result that is not a single-process :func:`fit_spec` run."""
    if "noise" not in ref:
        spec = ref.get("spec")
        single = spec is not None and spec.get("strategy") is None
        ref["noise"] = parity_errors(fit_spec(dict(spec, reorder=True)), ref) if single else None
    return ref["noise"]


def assert_parity(got: dict[str, Any], ref: dict[str, Any], tol: float = 1e-5, label: str = "") -> float:
    """Losses, gradients, buffers, validation loss and predictions of ``got`` within their tolerance of ``ref``'s;
    returns the worst relative error seen.

    Each quantity's tolerance is derived from the same computation's scale: ``max(tol, NOISE_FACTOR · noise)``,
    where ``noise`` is that quantity's :func:`reordering_noise` — how far the single-process reference itself moves
    when only its summation order changes (its samples reversed within each batch). A sharded run sums the same
    terms in yet another order, so it differs by that much on any CPU or GPU (on one AMD EPYC, a meta-built Llama's
    ``feed_forward.w2`` gradient after three AdamW steps under cp=2: 1.36e-5 from the reference, which its own
    reversed-batch run differs from by 1.56e-5). ``tol`` (about 1e-5 relative in fp32) is the floor, so the
    reordering run is made only when some quantity exceeds it; a quantity may then differ by a few times its own
    noise, never more — a wrong layout, a gradient scaled by ``1 + 1e-4`` or a loss off by 1e-4 still fail (see
    tests/distributed/test_parity_tolerance.py). Without a single-process reference (``ref`` not from
    :func:`fit_spec`) the tolerance is ``tol``.
    """
    errs = parity_errors(got, ref)
    tols = dict.fromkeys(errs, tol)
    if any(err > tol for err in errs.values()):
        noise = reordering_noise(ref) or {}
        tols = {k: max(tol, NOISE_FACTOR * noise.get(k, 0.0)) for k in errs}
    bad = sorted(((err / tols[k], k) for k, err in errs.items() if err > tols[k]), reverse=True)
    if bad:
        noise = ref.get("noise") or {}
        raise AssertionError(f"{label}: " + "; ".join(
            f"{k} rel err {errs[k]:.2e} > tol {tols[k]:.2e} (reordering noise {noise.get(k, float('nan')):.2e})"
            for _, k in bad[:5]))
    assert all(math.isfinite(x) for x in got["losses"])
    return max(errs.values(), default=0.0)


def world_fit(rank: int, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker: run every spec in one world. Every rank returns its losses and the full gradients of the
    parameters it holds (under PP each rank holds one stage); :func:`merge_ranks` combines them."""
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    return [fit_spec(spec) for spec in specs]


def merge_ranks(results: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per spec: rank 0's losses and predictions, gradients and buffers from whichever rank holds them."""
    merged = []
    for per_rank in zip(*results):
        out = dict(per_rank[0])
        if "sharded" in out:  # under PP a parameter lives on one stage: take the ranks that hold it
            out["sharded"] = {name: next((res["sharded"][name] for res in per_rank if res["sharded"][name] is not None),
                                         None) for name in out["sharded"]}
        for key in ("grads", "buffers", "placements"):
            if key in out:
                combined: dict[str, torch.Tensor] = {}
                for res in per_rank:
                    for name, value in res[key].items():
                        combined.setdefault(name, value)
                out[key] = combined
        merged.append(out)
    return merged


class References:
    """Single-process reference runs of ``base`` with each model kind, each computed once (on first use); a
    module-scoped fixture of the parity tests holds one.

    Example:
        >>> # not run: needs a Trainer
        >>> References(dict(steps=3, global_batch=8, lr=1e-4))["llama"]["losses"]  # doctest: +SKIP
    """

    def __init__(self, base: dict[str, Any]) -> None:
        self._base = base
        self._cache: dict[str, dict[str, Any]] = {}

    def __getitem__(self, kind: str) -> dict[str, Any]:
        if kind not in self._cache:
            self._cache[kind] = fit_spec(dict(self._base, model=kind))
        return self._cache[kind]
