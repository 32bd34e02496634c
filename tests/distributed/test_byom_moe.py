"""Bring your own MoE model: real mixture-of-experts models train under expert parallelism with no user code.

Families (:mod:`tests.distributed.byom_models`): transformers 5 Mixtral, Qwen2-MoE (shared expert with a sigmoid
gate), Qwen3-MoE (``norm_topk_prob``) and DeepSeek-V3 (MLA attention, grouped routing with a nonzero
``e_score_correction_bias``, a dense first layer, a shared expert), each keeping its experts in one ``experts``
module with 3-D ``gate_up_proj``/``down_proj``; and two TorchTitan-style models (``layers`` ModuleDict, blocks
called with ``freqs_cis``, a ``moe`` with a ``router.gate``, a token reorderer and ``GroupedExperts`` taking
``(x sorted by expert, num_tokens_per_expert)``): ``titan-moe`` (softmax, scores after the experts, a shared
expert) and ``titan-moe-sig`` (sigmoid, renormalised and scaled scores before the experts, block 0 dense).

lightning_4d shards each experts module *in place* (same module, same parameter names, ``Shard(0)`` over the ep
mesh) and routes tokens with all-to-alls. Every family × layout must match the single-process reference: per-step
global losses and final raw gradients within 1e-5 relative (fp32, lr=1e-4 as in test_byom: routing is chaotic
and AdamW's first steps amplify rounding in proportion to lr). Each run also checks, on every rank:

- every expert parameter is a DTensor on a mesh with an ``ep`` dimension, ``Shard(0)`` there, global shape
  ``[E, ...]`` under its original name, and this rank holds ``E/ep`` experts (``E/(ep·edp)`` rows when FSDP
  shards them further over ``edp``);
- every DTensor parameter and gradient is identical on the ranks of each mesh dimension where it is
  ``Replicate`` (experts over ``edp`` under ``data_parallel="replicate"``, norms over ``tp``...), and under tp>1
  ``fit_spec``'s own check of the tp replicas.

Layouts (world, FourDStrategy kwargs; ep borrows its ranks from dp×tp, see ParallelDims.from_world):
ep2 (2: dp=2, ep=2), ep2-dp2 (4: dp=4, ep=2, edp=2, FSDP), ep2-dp2-replicate (the same with replicated experts),
tp2-ep2 (2: tp=2 with SP, ep=2), pp2-ep2 (4: pp=2, dp=2, ep=2), pp2-tp2-ep2 (4: pp=2, tp=2, ep=2).

DeepSeek-V3 under tp>1 relies on the planner recognising multi-head latent attention's low-rank pairs
(``kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj``: down-projection replicated, up-projection column-parallel);
without that the planner refuses at setup, naming ``kv_b_proj`` and the ``fourd_tp_plan`` hook.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from lightning_4d.testing import run_world
from tests.distributed.common import References, assert_parity, fit_spec, merge_ranks, rel_err

os.environ.setdefault("OMP_NUM_THREADS", "1")

FAMILIES = ("hf-mixtral", "hf-qwen2moe", "hf-qwen3moe", "hf-dsv3", "titan-moe", "titan-moe-sig")
BASE: dict[str, Any] = dict(steps=3, global_batch=8, lr=1e-4)
PG_TIMEOUT_S = 30

# name -> (world, strategy kwargs, layers). Pipeline layouts use 4 layers: 2 blocks per stage.
LAYOUTS: dict[str, tuple[int, dict[str, Any], int]] = {
    "ep2": (2, dict(ep=2), 2),
    "ep2-dp2": (4, dict(ep=2), 2),
    "ep2-dp2-replicate": (4, dict(ep=2, data_parallel="replicate"), 2),
    "tp2-ep2": (2, dict(tp=2, ep=2, sequence_parallel=True), 2),
    "pp2-ep2": (4, dict(pp=2, ep=2), 4),
    "pp2-tp2-ep2": (4, dict(pp=2, tp=2, ep=2, sequence_parallel=True), 4),
}

# ep=1: experts whole on every rank (replicated over edp = dp·tp), the rest of the model under tp / pp / dp.
DENSE_EXPERT_LAYOUTS: dict[str, tuple[int, dict[str, Any], int]] = {
    "tp2": (2, dict(tp=2), 2),
    "tp2-nosp": (2, dict(tp=2, sequence_parallel=False), 2),
    "dp2": (2, dict(), 2),
    "pp2": (2, dict(pp=2), 4),
}
DENSE_EXPERT_CASES = [("hf-mixtral", "tp2"), ("hf-qwen2moe", "tp2-nosp"), ("titan-moe", "tp2"),
                      ("hf-dsv3", "tp2"), ("titan-moe-sig", "dp2"), ("hf-qwen3moe", "pp2")]

ERRORS: dict[str, float] = {}  # "family layout" -> worst relative error (printed at the end of the module)


def _kind(family: str, layers: int) -> str:
    return family if layers == 2 else f"{family}-{layers}"


# Under tp>1 the first block's attention projections (LightningModule names) must really be sharded on tp. For
# DeepSeek-V3's multi-head latent attention that includes the up-projection kv_b_proj (its down-projection
# kv_a_proj_with_mqa stays replicated).
SHARDED: dict[str, list[str]] = {
    **{f: [f"model.model.model.layers.0.self_attn.{n}.weight" for n in ("q_proj", "o_proj")]
       for f in FAMILIES if f.startswith("hf-")},
    "hf-dsv3": [f"model.model.model.layers.0.self_attn.{n}.weight" for n in ("q_b_proj", "kv_b_proj", "o_proj")],
    **{f: [f"model.layers.0.attention.{n}.weight" for n in ("wq", "wo")] for f in FAMILIES if f.startswith("titan")},
}


def _spec(family: str, layout: str) -> dict[str, Any]:
    world, strategy, layers = LAYOUTS[layout] if layout in LAYOUTS else DENSE_EXPERT_LAYOUTS[layout]
    spec = dict(BASE, model=_kind(family, layers), world=world, strategy=dict(strategy, timeout_s=PG_TIMEOUT_S))
    if strategy.get("tp", 1) > 1:
        spec["check_sharded"] = SHARDED[family]
    return spec


@pytest.fixture(scope="module")
def references() -> References:
    return References(BASE)


@pytest.fixture(scope="module", autouse=True)
def _report() -> Any:
    start = time.monotonic()
    yield
    if ERRORS:
        width = max(len(k) for k in ERRORS)
        lines = [f"  {k:<{width}}  {v:.2e}" for k, v in sorted(ERRORS.items())]
        print(f"\nworst relative error per family × layout ({time.monotonic() - start:.0f} s):\n" + "\n".join(lines))


# ----------------------------------------------------------------------------------------------- worker
def _expert_layout(module: Any) -> dict[str, dict[str, Any]]:
    """Per expert parameter this rank holds (3-D, under an ``experts`` module): how it is laid out."""
    from torch.distributed.tensor import DTensor

    out: dict[str, dict[str, Any]] = {}
    for name, p in module.named_parameters():
        if ".experts." not in name or p.dim() != 3:
            continue
        info: dict[str, Any] = {"dtensor": isinstance(p, DTensor), "global": tuple(p.shape)}
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            info.update(mesh=dict(zip(names, p.device_mesh.shape)), local=tuple(p.to_local().shape),
                        placements={n: repr(pl) for n, pl in zip(names, p.placements)},
                        ep_shard0=("ep" in names and p.placements[names.index("ep")].is_shard(0)),
                        grad=p.grad is not None)
        out[name] = info
    return out


def assert_dtensor_replicas_identical(module: Any, rtol: float = 1e-7) -> int:
    """Every DTensor parameter and gradient holds the same local values on all ranks of each mesh dimension on
    which it is ``Replicate``. Collective: every rank of a pipeline stage holds the same parameters, so all call
    the same collectives in the same (name) order. Returns how many (tensor, dimension) pairs were checked."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    checked, bad = 0, []
    for name, p in sorted(module.named_parameters()):
        if not isinstance(p, DTensor):
            continue
        names = p.device_mesh.mesh_dim_names or ()
        for dim, (axis, placement) in enumerate(zip(names, p.placements)):
            if not placement.is_replicate() or p.device_mesh.size(dim) == 1:
                continue
            group = p.device_mesh.get_group(dim)
            for label, t in ((name, p), (f"{name} (grad)", p.grad)):
                if t is None:
                    continue
                local = (t.to_local() if isinstance(t, DTensor) else t).detach().float().contiguous()
                parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, local, group=group)
                checked += 1
                for r, part in enumerate(parts):
                    err = rel_err(part, parts[0])
                    if err > rtol:
                        bad.append(f"{label}: {axis} rank {r} differs from {axis} rank 0 (rel {err:.2e})")
    assert not bad, "replicated DTensors differ:\n" + "\n".join(bad)
    return checked


def _moe_world(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Worker: ``fit_spec`` plus, at the end of the fit (when it gathers the gradients), the layout of every expert
    parameter and the replica check."""
    from tests.distributed import common

    os.environ.setdefault("PL_DISABLE_FORK", "1")
    seen: dict[str, Any] = {}
    gather = common.full_grads

    def full_grads(module: Any) -> Any:
        seen["experts"] = _expert_layout(module)
        seen["replicas_checked"] = assert_dtensor_replicas_identical(module)
        return gather(module)

    common.full_grads = full_grads
    try:
        result = common.fit_spec(spec)
    finally:
        common.full_grads = gather
    result.update(seen)
    return result


def _moe_worlds(rank: int, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_moe_world(rank, spec) for spec in specs]


def _run(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every spec in one world (they share a world size): starting ranks, not training, dominated one world per
    cell on 2 cores."""
    per_rank = run_world(_moe_worlds, specs[0]["world"], specs, timeout_s=900, pg_timeout_s=PG_TIMEOUT_S)
    out = []
    for i, got in enumerate(merge_ranks(per_rank)):
        got["experts_per_rank"] = [r[i]["experts"] for r in per_rank]
        out.append(got)
    return out


@pytest.fixture(scope="module")
def moe_runs() -> dict[tuple[str, str], dict[str, Any]]:
    """Every parity cell of this module, run once, one world per world size."""
    cells = [(f, lay) for lay in LAYOUTS for f in FAMILIES] + list(DENSE_EXPERT_CASES)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for world in sorted({_spec(*cell)["world"] for cell in cells}):
        mine = [cell for cell in cells if _spec(*cell)["world"] == world]
        out.update(zip(mine, _run([_spec(*cell) for cell in mine])))
    return out


def _check_experts(got: dict[str, Any], ref: dict[str, Any], spec: dict[str, Any], label: str) -> None:
    from lightning_4d.mesh import ParallelDims

    kwargs = {k: v for k, v in spec["strategy"].items() if k in ("tp", "pp", "ep", "sequence_parallel")}
    dims = ParallelDims.from_world(spec["world"], **kwargs)
    expected = {n for n in ref["grads"] if ".experts." in n and ref["grads"][n].dim() == 3}
    assert expected, f"{label}: the reference has no 3-D expert parameters"
    held: set[str] = set()
    for rank, layout in enumerate(got["experts_per_rank"]):
        held |= set(layout)
        for name, info in layout.items():
            where = f"{label}: rank {rank}: {name}"
            e = ref["grads"][name].shape[0]
            assert info["dtensor"], f"{where} is not a DTensor (not sharded over ep)"
            assert info["global"] == tuple(ref["grads"][name].shape), f"{where}: global shape {info['global']}"
            assert info["mesh"].get("ep") == dims.ep, f"{where}: mesh {info['mesh']} has no ep={dims.ep} dimension"
            assert info["ep_shard0"], f"{where}: not Shard(0) on ep: {info['placements']}"
            edp_split = info["mesh"].get("edp", 1) if "Shard" in info["placements"].get("edp", "") else 1
            assert info["local"][0] * edp_split == e // dims.ep, (
                f"{where}: local shape {info['local']} (placements {info['placements']}) does not hold E/ep = "
                f"{e}/{dims.ep} experts")
            assert info["grad"], f"{where} has no gradient"
    assert held == expected, f"{label}: expert parameters held {sorted(held)} != the model's {sorted(expected)}"


def worst_error(got: dict[str, Any], ref: dict[str, Any]) -> float:
    """The largest relative error over the per-step losses and the gradients (``inf`` for a missing one)."""
    errs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got["losses"], ref["losses"])]
    errs += [rel_err(got["grads"][n], g) if n in got["grads"] else float("inf") for n, g in ref["grads"].items()]
    return max(errs)


# ----------------------------------------------------------------------------------------------- harness checks
def test_moe_references_are_deterministic_and_route_to_every_expert() -> None:
    import torch

    for family in FAMILIES:
        a, b = fit_spec(dict(BASE, model=family)), fit_spec(dict(BASE, model=family))
        assert a["losses"] == b["losses"], family
        for name, g in a["grads"].items():
            assert g.equal(b["grads"][name]), f"{family}: {name}"
        experts = [n for n, g in a["grads"].items() if ".experts." in n and g.dim() == 3]
        assert experts, family
        for name in experts:  # every expert of every MoE layer received tokens (a nonzero gradient slice)
            g = a["grads"][name]
            assert all(g[e].abs().sum() > 0 for e in range(g.shape[0])), f"{family}: {name}: an expert got no tokens"
        assert all(torch.isfinite(torch.tensor(a["losses"]))), family


# ----------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_parity(family: str, layout: str, references: References,
                    moe_runs: dict[tuple[str, str], dict[str, Any]]) -> None:
    spec = _spec(family, layout)
    ref = references[spec["model"]]
    got = moe_runs[(family, layout)]
    label = f"{spec['model']} {layout}"
    ERRORS[f"{family} {layout}"] = worst_error(got, ref)
    assert_parity(got, ref, label=label)
    _check_experts(got, ref, spec, label)
    flat = [name for name, sharded in got.get("sharded", {}).items() if not sharded]
    assert not flat, f"{label}: not sharded on tp (a DTensor with a Shard placement expected): {flat}"
    if layout == "ep2-dp2-replicate":
        assert got["replicas_checked"] > 0, f"{label}: no replicated DTensor was compared"



@pytest.mark.parametrize("family, layout", DENSE_EXPERT_CASES, ids=[f"{f}-{lay}" for f, lay in DENSE_EXPERT_CASES])
def test_moe_parity_without_expert_parallelism(family: str, layout: str, references: References,
                                               moe_runs: dict[tuple[str, str], dict[str, Any]]) -> None:
    # The experts stay whole; under SP each TP rank routes its own sequence shard, so the expert (and router)
    # gradients must be summed over tp — a missing or doubled sum shows here.
    spec = _spec(family, layout)
    ref = references[spec["model"]]
    got = moe_runs[(family, layout)]
    label = f"{spec['model']} {layout}"
    ERRORS[f"{family} {layout}"] = worst_error(got, ref)
    assert_parity(got, ref, label=label)
    flat = [name for name, sharded in got.get("sharded", {}).items() if not sharded]
    assert not flat, f"{label}: not sharded on tp (a DTensor with a Shard placement expected): {flat}"
