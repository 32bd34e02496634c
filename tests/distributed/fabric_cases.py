"""The Fabric strategy's parity runs: a LitGPT-style loop under a layout, and its single-process reference.

A *case* is a plain dict: the model kind, the strategy options (``None``: the single-process reference, no Fabric),
the loop (``"plain"``: ``model(x)``, ``F.cross_entropy``, ``fabric.backward``; ``"step"``: ``strategy.train_step``),
the data (``ignore``: a fraction of targets set to ``ignore_index``, default ``-100``), ``accumulate`` micro-steps
per optimizer step, and for
checkpoints ``save`` (a directory written after ``save_after`` optimizer steps) or ``resume`` (a directory loaded
before the first step, whose steps then continue from ``save_after``); ``optimizer_after``: the optimizer is built
from the set-up model (else before ``fabric.setup``, which re-points it); ``device``: each rank's device (default:
Fabric's CPU devices). :func:`run_case` returns every micro-step's
global-batch loss, the clipping norms and the last step's full (clipped) gradients by parameter name.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.distributed.common import SEQ, VOCAB, build_model, full_grads, make_dataset, under_source_names

STEPS, GLOBAL_BATCH, LR, CLIP = 3, 8, 1e-3, 0.05


def build(kind: str) -> torch.nn.Module:
    """``"litgpt"``: LitGPT's ``GPT`` with a tiny Llama configuration (GQA, RMSNorm, SwiGLU, rotary; nothing
    downloaded); else a model of :func:`tests.distributed.common.build_model` (``"llama-4"``: the package's)."""
    if kind != "litgpt":
        return build_model(kind)
    from litgpt import GPT, Config

    return GPT(Config(name="fabric-llama", block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2,
                      n_head=4, n_embd=32, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False,
                      bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The user's loss, as written for one process."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One run of ``case`` (see the module doc) in this process: the reference, or this rank of a Fabric world."""
    if torch.distributed.is_initialized():
        import gc

        gc.freeze()  # what earlier cases left is not walked again by the set-up's collection
    torch.manual_seed(case.get("seed", 0))
    accumulate = case.get("accumulate", 1)
    data = make_dataset(GLOBAL_BATCH * STEPS * accumulate, ignore_fraction=case.get("ignore", 0.0))
    ignore_index = case.get("ignore_index", -100)
    data.tensors[1][data.tensors[1] == -100] = ignore_index
    loss = partial(loss_fn, ignore_index=ignore_index)
    options: Optional[dict[str, Any]] = case.get("strategy")
    fabric, strategy = None, None
    if options is None:
        if case.get("meta"):  # the values every layout materialises, in one process
            from lightning_4d.materialize.local_shards import materialize

            with torch.device("meta"):
                model = build(case["model"])
            materialize(model)
        else:
            model = build(case["model"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        loader: Any = DataLoader(data, batch_size=GLOBAL_BATCH)  # global batch i: samples [i·B, (i+1)·B)
    else:
        import lightning as L

        from lightning_4d.fabric import FourDStrategy

        # The world's size (a Trainer's teardown before, in the same world, removes WORLD_SIZE from the environment)
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
        if case.get("device"):  # each rank's device, as Fabric would hand out a GPU (the host-tensor guard's stand-in)
            options = dict(options, parallel_devices=[torch.device(case["device"])] * world)
        strategy = FourDStrategy(**options)
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        assert strategy.root_device == torch.device(case.get("device", "cpu")), strategy.root_device
        with fabric.init_module(empty_init=bool(case.get("meta"))):  # meta: only this rank's shards are made
            model = build(case["model"])
        if case.get("optimizer_after"):  # the expert-parallel rewrite renames experts: the optimizer comes after
            model = fabric.setup(model)
            optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
        else:  # built before the set-up: re-pointed at this rank's parameters by name
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            model, optimizer = fabric.setup(model, optimizer)
        # Fabric's DistributedSampler (no shuffle) gives dp rank r the samples r, r + dp, ...: batch i of every
        # rank together is global batch i.
        loader = fabric.setup_dataloaders(DataLoader(data, batch_size=GLOBAL_BATCH // strategy.dims.dp))
    first = 0
    if case.get("resume"):
        assert fabric is not None
        state = {"model": model, "optimizer": optimizer, "step": -1}
        fabric.load(case["resume"], state)
        first = state["step"]
        assert first == case["save_after"], state["step"]
    out: dict[str, Any] = {"losses": [], "norms": [],
                           "materialized": strategy is not None and strategy.setup_record.materialize_report is not None}
    batches = iter(loader)
    for step in range(STEPS):
        micro = [next(batches) for _ in range(accumulate)]
        if step < first:
            continue
        for i, (x, y) in enumerate(micro):
            out["losses"].append(_micro_step(case, fabric, model, x, y, accumulate, last=i == accumulate - 1))
        if fabric is None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        else:
            norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        out["norms"].append(float(norm))
        if step == STEPS - 1:
            out["grads"] = full_grads(model if strategy is None else strategy.model)
            if strategy is not None:  # experts stacked by the expert-parallel rewrite: under the user's names
                under_source_names(out["grads"], strategy.layout_plan.source_names())
                from torch.distributed.tensor import DTensor

                out["ep_sharded"] = sorted(n for n, p in strategy.model.named_parameters() if isinstance(p, DTensor)
                                           and "ep" in (p.device_mesh.mesh_dim_names or ()))
        optimizer.step()
        optimizer.zero_grad()
        if case.get("save") and step + 1 == case["save_after"]:
            assert fabric is not None
            fabric.save(case["save"], {"model": model, "optimizer": optimizer, "step": step + 1})
    # After training: full outputs and the loss of one batch without gradients (the same batch on every rank).
    x, y = data.tensors[0][:4], data.tensors[1][:4]
    if fabric is not None:
        x, y = fabric.to_device((x, y))
    with torch.no_grad():
        cp = strategy is not None and strategy.dims.cp > 1  # model(x) is refused under cp (outputs per shard)
        out["logits"] = None if cp else model(x)  # under pp: the schedule's forward; under tp: the gathered vocabulary
        out["eval_loss"] = float(loss(model(x), y) if fabric is None else fabric.strategy.eval_step(
            model, (x, y), loss, ignore_index=ignore_index))
    if strategy is not None and (strategy.dims.pp > 1 or strategy.dims.cp > 1):
        try:  # a forward with gradients cannot train here: refused on every rank before any collective
            model(x)
        except RuntimeError as err:
            out["refusal"] = str(err)
    return out


def _micro_step(case: dict[str, Any], fabric: Any, model: Any, x: torch.Tensor, y: torch.Tensor, accumulate: int,
                last: bool) -> float:
    """One micro-step's forward and backward; returns its global-batch loss."""
    ignore_index = case.get("ignore_index", -100)
    user_loss = partial(loss_fn, ignore_index=ignore_index)
    if fabric is None:
        loss = user_loss(model(x), y)
        (loss / accumulate).backward()
        return float(loss.detach())
    with fabric.no_backward_sync(model, enabled=not last):
        if case.get("loop") == "plain":  # the loop as written for one process
            loss = user_loss(model(x), y)
            fabric.backward(loss / accumulate)
            # Each rank's mean over as many tokens: the world mean is the global-batch mean (tp peers agree).
            return float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
        return float(fabric.strategy.train_step(model, (x, y), user_loss, accumulate=accumulate,
                                                ignore_index=ignore_index))


def fabric_world(rank: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker: every case in one world; each rank returns its results (gradients of the parameters it holds)."""
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    return [run_case(case) for case in cases]
