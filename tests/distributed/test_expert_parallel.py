"""Expert-parallel parity on gloo worlds, emulating the full system at module level.

A world of ``dp × tp`` ranks: ``tp`` ranks hold different sequence shards of the same batch, ``dp``
ranks hold different batches. Each rank's loss is its share of its data shard's mean loss; expert
gradients are averaged over ``edp`` (as FSDP / replicate will), dense gradients (router, shared
experts) are summed over ``tp`` and averaged over ``dp``. Outputs, losses, gradients, the aux loss and
the aux-loss-free bias must equal a single process on the full batch; the all-to-all count and bytes
must match the token counts exactly. One world per size; every layout runs inside it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_4d.core.comm import CommCounter
from lightning_4d.expert_parallel import MoE, apply_expert_parallel, update_expert_bias
from lightning_4d.mesh import ParallelDims, build_mesh
from lightning_4d.testing import run_world
from tests.unit.test_expert_rewrite import SparseMoeBlock

H, B, T = 16, 2, 8
TOL = 1e-5


def _package_model() -> nn.Module:
    torch.manual_seed(0)
    kw = dict(top_k=2, aux_loss_coef=0.1, bias_update_rate=0.05, init_std=0.3, out_init_std=0.3)
    return nn.Sequential(MoE(H, 32, 8, shared_hidden_dim=16, **kw), MoE(H, 32, 8, score_func="sigmoid", **kw))


def _mixtral_model() -> nn.Module:
    torch.manual_seed(1)
    return SparseMoeBlock(dim=H, hidden=32, num_experts=8, top_k=2)


def _data(dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(dp * B, T, H, generator=g), torch.randn(dp * B, T, H, generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _local_grads(model: nn.Module, mesh: Any, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Emulate the data-parallel reductions: experts mean over edp, dense sum over tp and mean over dp."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "to_local"):
            g = g.to_local().clone()
            dist.all_reduce(g, group=mesh["edp"].get_group())
            g /= dims.edp
        else:
            g = g.clone()
            dist.all_reduce(g, group=mesh["tp"].get_group())
            dist.all_reduce(g, group=mesh["dp"].get_group())
            g /= dims.dp
        out[name] = g
    return out


def _ref_grad(ref: nn.Module, name: str, first: int, n_local: int, original_names: bool) -> torch.Tensor:
    params = dict(ref.named_parameters())
    if not original_names:
        g = params[name].grad
        return g[first:first + n_local] if name.split(".")[-1] in ("w1", "w2", "w3") else g
    mapping = {"router.gate.weight": "gate.weight"}
    if name in mapping:
        return params[mapping[name]].grad
    src = name.split(".")[-1]  # experts.w1 -> w1
    return torch.stack([params[f"experts.{i}.{src}.weight"].grad for i in range(first, first + n_local)])


def _check_layout(tp: int, ep: int, kind: str) -> dict[str, float]:
    """Run two steps in one layout; return the worst relative errors."""
    world = dist.get_world_size()
    dims = ParallelDims.from_world(world, tp=tp, ep=ep)
    mesh = build_mesh(dims, "cpu")
    d, t = mesh.rank("dp"), mesh.rank("tp")
    ref = _mixtral_model() if kind == "mixtral" else _package_model()
    if kind == "skewed":  # every token picks experts 0 and 1: all other ep ranks receive no rows
        for m in ref.modules():
            if isinstance(m, MoE):
                m.router.expert_bias.copy_(torch.tensor([20.0, 19.0] + [0.0] * 6))
    # "bare": a 1-D ep DeviceMesh instead of the FourDMesh; its defaults assume tp=1, ep ranks = dp ranks
    model = apply_expert_parallel(copy.deepcopy(ref), mesh["ep"] if kind == "bare" else mesh)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    n_local = 8 // ep
    first = mesh.rank("ep") * n_local
    errs: dict[str, float] = {}
    sl = slice(t * T // tp, (t + 1) * T // tp)
    for step in range(2):
        x, tgt = _data(dims.dp, step)
        x.requires_grad_()
        y_ref = ref(x)
        loss_ref = ((y_ref - tgt) ** 2).mean()
        loss_ref.backward()
        xl = x.detach()[d * B:(d + 1) * B, sl].clone().requires_grad_()
        tl = tgt[d * B:(d + 1) * B, sl]
        with CommCounter({mesh["ep"].get_group().group_name: "ep"}) as counter:  # the package's one recorder
            y = model(xl)
            loss = ((y - tl) ** 2).sum() / (B * T * H)  # this rank's share of its data shard's mean loss
            loss.backward()
        errs["out"] = max(errs.get("out", 0), _rel(y, y_ref[d * B:(d + 1) * B, sl]))
        # the rank's loss is dp x its share of the global mean loss
        errs["input grad"] = max(errs.get("input grad", 0), _rel(xl.grad / dims.dp, x.grad[d * B:(d + 1) * B, sl]))
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["tp"].get_group())
        dist.all_reduce(total, group=mesh["dp"].get_group())
        errs["loss"] = max(errs.get("loss", 0), _rel(total / dims.dp, loss_ref.detach()))
        if step == 0:
            for name, g in _local_grads(model, mesh, dims).items():
                r = _ref_grad(ref, name, first, n_local, original_names=kind == "mixtral")
                errs[f"grad {name}"] = _rel(g, r)
            if kind != "mixtral":
                ref_moes = [m for m in ref.modules() if isinstance(m, MoE)]
                for i, (m, rm) in enumerate(zip(moes, ref_moes)):
                    errs[f"aux {i}"] = _rel(m.router.aux_loss, rm.router.aux_loss)
                update_expert_bias(model)
                update_expert_bias(ref)
                for i, (m, rm) in enumerate(zip(moes, ref_moes)):
                    errs[f"bias {i}"] = float((m.router.expert_bias - rm.router.expert_bias).abs().max())
                    assert (rm.router.expert_bias != 0).any()
            errs.update(_check_traffic(counter, moes, mesh, xl.shape[0] * xl.shape[1], ep))
        model.zero_grad()
        ref.zero_grad()
    return errs


def _check_traffic(counter: CommCounter, moes: list[MoE], mesh: Any, n_local: int, ep: int) -> dict[str, float]:
    """Exact all-to-all count and bytes for one forward + backward, as the dispatch mode recorded them (not
    the dispatch code's own accounting); returns 0.0 entries when exact."""
    a2a = [r for r in counter.records if r.kind == "all_to_all"]
    if ep == 1:
        assert not a2a
        return {}
    layers = len(moes)
    assert all(r.axis == "ep" and r.group_size == ep for r in a2a)
    # forward per layer: counts, dispatch, combine; backward, last layer first: combine's reverse, dispatch's
    fwd, bwd = [r for r in a2a if not r.backward], [r for r in a2a if r.backward]
    assert len(fwd) == 3 * layers and len(bwd) == 2 * layers
    counts, dispatch, combine = fwd[0::3], fwd[1::3], fwd[2::3]
    combine_bwd, dispatch_bwd = bwd[0::2], bwd[1::2]
    assert all(r.full_bytes == moes[0].num_experts * 8 for r in counts)  # one int64 per expert
    sent = n_local * moes[0].top_k * H * 4  # rows sent = local assignments (dropless) x hidden x fp32
    assert [r.full_bytes for r in dispatch] == [r.full_bytes for r in combine_bwd] == [sent] * layers
    # a rank returns (combine) and back-propagates (dispatch.backward) exactly the rows it received;
    # over the ep group, rows received equal rows sent, and so do the rows that leave the ranks
    assert [r.full_bytes for r in combine] == [r.full_bytes for r in reversed(dispatch_bwd)]
    got = torch.tensor([sum(r.full_bytes for r in combine), sum(r.full_bytes for r in dispatch),
                        sum(r.sent_bytes for r in combine), sum(r.sent_bytes for r in dispatch)], dtype=torch.float64)
    dist.all_reduce(got, group=mesh["ep"].get_group())
    assert got[0] == got[1] and got[2] == got[3]
    return {"traffic": 0.0}


def _check_fsdp(ep: int) -> dict[str, float]:
    """Real FSDP2: experts sharded over edp, router and shared experts over dp; meta-device build, then
    ``to_empty`` + ``reset_parameters``: expert init equals the unsharded init, gradients the full-batch ones."""
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    dims = ParallelDims.from_world(world, ep=ep)
    mesh = build_mesh(dims, "cpu")
    kw = dict(aux_loss_coef=0.1, shared_hidden_dim=16, init_std=0.3, out_init_std=0.3)
    with torch.device("meta"):
        model = MoE(H, 32, 8, 2, **kw)
    apply_expert_parallel(model, mesh)
    fully_shard(model.experts, mesh=mesh["edp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.reset_parameters()
    ref = MoE(H, 32, 8, 2, **kw)
    torch.manual_seed(3)
    ref.reset_parameters()
    errs = {f"init {n}": _rel(getattr(model.experts, n).full_tensor(), getattr(ref.experts, n))
            for n in ("w1", "w2", "w3")}
    with torch.no_grad():  # dense init under FSDP is the strategy's business: copy it
        for n, p in ref.named_parameters():
            p.copy_(dict(model.named_parameters())[n].full_tensor())
    x, tgt = _data(dims.dp, 0)
    d = mesh.rank("dp")
    y = model(x[d * B:(d + 1) * B])
    (((y - tgt[d * B:(d + 1) * B]) ** 2).sum() / (B * T * H)).backward()
    ((ref(x) - tgt) ** 2).mean().backward()
    for n, p in model.named_parameters():
        errs[f"grad {n}"] = _rel(p.grad.full_tensor(), dict(ref.named_parameters())[n].grad)
    return errs


def _world_main(rank: int, layouts: list[tuple[int, int, str]]) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    results = {f"tp={tp} ep={ep} {kind}": _check_layout(tp, ep, kind) for tp, ep, kind in layouts}
    results["errors"] = _check_errors()
    if dist.get_world_size() == 4:
        results["fsdp ep=2"] = _check_fsdp(2)
    return results


def _check_errors() -> dict[str, float]:
    world = dist.get_world_size()
    mesh = build_mesh(ParallelDims.from_world(world, ep=world), "cpu")
    experts = 6 if world == 4 else 3
    with CommCounter() as counter:
        with pytest.raises(ValueError, match=rf"'1': num_experts={experts} is not divisible by ep={world}.*Choose ep"):
            apply_expert_parallel(nn.Sequential(MoE(H, 32, 4, 2), MoE(H, 32, experts, 2)), mesh)
    assert counter.records == []
    dist.barrier()  # no rank is stuck in a collective
    return {"errors": 0.0}


LAYOUTS = {
    2: [(1, 2, "package"), (2, 2, "package"), (2, 1, "package"), (1, 1, "package"),
        (1, 2, "mixtral"), (2, 2, "mixtral"), (2, 2, "skewed"), (1, 2, "bare")],
    4: [(1, 4, "package"), (1, 2, "package"), (2, 2, "package"), (2, 4, "package"), (2, 4, "mixtral"),
        (1, 2, "mixtral"), (1, 4, "skewed")],
}


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_parity(world: int) -> None:
    results = run_world(_world_main, world, LAYOUTS[world])
    assert len(results[0]) == len(LAYOUTS[world]) + (2 if world == 4 else 1)
    for layout, errs in results[0].items():
        assert layout == "errors" or any(k.startswith("grad") for k in errs), layout
    for rank, res in enumerate(results):
        for layout, errs in res.items():
            for what, err in errs.items():
                assert err <= TOL, f"rank {rank} {layout}: {what} rel err {err:.2e}"
