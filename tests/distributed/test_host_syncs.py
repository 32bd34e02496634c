"""A training step without host stalls, and optimizers on fused / foreach kernels over DTensor parameters.

Host syncs (:class:`lightning_4d.testing.HostSyncCounter`: what ``torch.cuda.set_sync_debug_mode`` reports on a GPU —
a value read on the host, an output sized by values, host data copied to the device) are counted on every rank
during training steps 2-5, from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, the
non-finite guard, clipping, the optimizer step), the optimizer's host-side step counters and DeviceMesh's rank table
left out. User models of ``tests/distributed`` run their own code paths: TorchTitan's Llama layout
(``byom_models.Titan``) at tp=2 and at pp=2 with 4 micro-batches, and a Llama whose feed-forwards are a user's
Mixtral blocks (``moe_models``, rewritten into the package's MoE) at ep=2. Budgets: the step's one combined copy
(the guard's decision), plus one per MoE layer per micro-batch (the all-to-all's split sizes).

Then, in the same world, AdamW over DTensor parameters on two meshes and a plain one, split by
:func:`lightning_4d.mesh_param_groups`: ``foreach=True`` and ``fused=True`` against ``foreach=False``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from lightning_4d.testing import run_world

os.environ.setdefault("OMP_NUM_THREADS", "1")

COUNTED = [1, 2, 3, 4]  # batch indices of training steps 2-5
BASE: dict[str, Any] = dict(steps=5, global_batch=8, lr=1e-4, clip=1.0, count_host_syncs=COUNTED)
LAYOUTS: dict[str, dict[str, Any]] = {
    "dense tp=2": dict(model="titan", strategy=dict(tp=2)),
    "pp=2, 4 micro-batches": dict(model="titan-4", strategy=dict(pp=2, microbatches=4)),
    "MoE ep=2": dict(model="mixtral", strategy=dict(ep=2)),
}
STEPS_OPT = 3


def _moe_layers(kind: str) -> int:
    from tests.distributed.common import build_model
    from tests.distributed.moe_models import MixtralSparseMoeBlock

    return sum(isinstance(m, MixtralSparseMoeBlock) for m in build_model(kind).modules())


def budget(layout: str) -> int:
    """The most host syncs a step may make: one, plus one per MoE layer per micro-batch."""
    spec = LAYOUTS[layout]
    micro = spec["strategy"].get("microbatches", 1) if spec["strategy"].get("pp", 1) > 1 else 1
    return 1 + (_moe_layers(spec["model"]) * micro if spec["model"] == "mixtral" else 0)


# ---------------------------------------------------------------------------------------------- the world
def _optimizer_parity(rank: int) -> dict[str, Any]:
    """AdamW after ``STEPS_OPT`` steps on the same gradients: grouped foreach / fused against ``foreach=False``; and
    what one foreach call over every parameter (several meshes and a plain tensor) does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from lightning_4d import mesh_param_groups

    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ep = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))

    def build() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(p) for p in (
            distribute_tensor(torch.randn(8, 4, generator=gen), tp, [Shard(0)]),
            distribute_tensor(torch.randn(4, generator=gen), tp, [Replicate()]),
            distribute_tensor(torch.randn(4, 8, 4, generator=gen), ep, [Replicate(), Shard(0)]),
            torch.randn(3, 5, generator=gen))]

    def run(make: Any) -> tuple[list[torch.Tensor], int]:
        params = build()
        opt = make(params)
        for step in range(STEPS_OPT):
            gen = torch.Generator().manual_seed(10 + step)
            for p in params:
                g = torch.randn(p.shape, generator=gen)
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
            opt.step()
        return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params], len(opt.param_groups)

    options = dict(lr=1e-2, weight_decay=0.1)
    ref, _ = run(lambda ps: torch.optim.AdamW(ps, foreach=False, **options))
    out: dict[str, Any] = {"scale": max(float(r.abs().max()) for r in ref)}
    for kernel in ("foreach", "fused"):
        got, groups = run(lambda ps: torch.optim.AdamW(mesh_param_groups(ps), **{kernel: True}, **options))
        out[kernel] = (max(float((a - b).abs().max()) for a, b in zip(got, ref)), groups)
    try:
        run(lambda ps: torch.optim.AdamW(ps, foreach=True, **options))
        out["one call"] = ""
    except RuntimeError as err:
        out["one call"] = str(err)
    return out


def _world(rank: int, specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from tests.distributed.common import fit_spec

    os.environ.setdefault("PL_DISABLE_FORK", "1")
    out: dict[str, Any] = {name: fit_spec(spec)["host_syncs"] for name, spec in specs.items()}
    out["optimizer"] = _optimizer_parity(rank)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    specs = {name: dict(BASE, world=2, model=layout["model"], strategy=dict(layout["strategy"], timeout_s=60))
             for name, layout in LAYOUTS.items()}
    return run_world(_world, 2, specs, timeout_s=600, pg_timeout_s=60)


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_host_syncs_per_step_within_budget(world: list[dict[str, Any]], layout: str) -> None:
    limit = budget(layout)
    assert limit == {"dense tp=2": 1, "pp=2, 4 micro-batches": 1, "MoE ep=2": 3}[layout]  # 2 MoE layers, 1 micro-batch
    for rank, per_rank in enumerate(world):
        counts = per_rank[layout]
        assert sorted(counts) == COUNTED, (rank, sorted(counts))
        for step, (count, report) in counts.items():
            assert count <= limit, f"{layout}, rank {rank}, batch {step}: {count} > {limit} host syncs\n{report}"
        # The guard's decision is the one sync every rank makes each step (with or without clipping).
        assert all("lightning_4d/safety/nonfinite.py" in report for _, report in counts.values()), counts


def test_moe_syncs_are_the_split_sizes(world: list[dict[str, Any]]) -> None:
    # Exactly one per MoE layer and micro-batch, in the dispatch: the split sizes of the all-to-all.
    layers = _moe_layers("mixtral")
    for per_rank in world:
        for count, report in per_rank["MoE ep=2"].values():
            dispatch = sum(int(line.split(" x ")[0]) for line in report.splitlines()
                           if "expert_parallel/dispatch.py" in line)
            assert dispatch == layers and count == layers + 1, report


def test_grouped_optimizers_match_foreach_false_over_dtensors(world: list[dict[str, Any]]) -> None:
    eps = torch.finfo(torch.float32).eps
    for per_rank in world:
        result = per_rank["optimizer"]
        # Each step rounds the update and the parameter: a few ulps of the largest parameter per step.
        tol = STEPS_OPT * 4 * eps * result["scale"]
        for kernel in ("foreach", "fused"):
            err, groups = result[kernel]
            assert groups == 4, (kernel, groups)  # tp Shard(0), tp Replicate, (edp, ep), plain
            assert err <= tol, f"{kernel}: max abs difference {err:.2e} > {tol:.2e}"
        assert result["foreach"][0] == 0.0  # the same per-element arithmetic as the loop
        # What the groups are for: one foreach call over DTensors and a plain tensor fails.
        assert "mixed torch.Tensor and DTensor" in result["one call"], result["one call"]
