"""The monitors in real FourDStrategy fits on 2 CPU ranks: exact communication per mesh axis (TP, SP, EP),
global expert load, throughput, figures, and no-ops where a parallelism is off.

Exact expectations (per rank, one training step, tiny Llama: ``L = 2`` blocks, hidden ``h = 32``,
batch ``b = 4`` sequences of ``s = 16`` tokens, fp32; ``S = b·s·h·4`` bytes is one activation):

- TP = 2 without SP: 2 all-reduces per block forward and 2 backward, plus the vocab-parallel embedding
  (forward) and the column-parallel head's input gradient (backward) — ``4L + 2`` of ``S`` — and
  loss parallel's 3 all-reduces of ``b·s`` fp32 numbers. An all-reduce over 2 ranks sends ``S``.
- TP = 2 with SP: each of those ``4L + 2`` all-reduces becomes an all-gather + a reduce-scatter, each
  sending ``S/2``; the sequence-sharded norms' weight gradients are summed over tp (``h`` floats each).
- EP = 2 (folded onto the two TP ranks, SP): per MoE layer an all-to-all of the per-expert counts,
  dispatch and combine forward, their reverses backward (5); the rows that leave a rank are known from
  the routers' ``tokens_per_expert`` on both ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from lightning_4d.testing import run_world

B, SEQ, H, LAYERS, EXPERTS, TOPK = 4, 16, 32, 2, 4, 2


def _fit(spec: dict[str, Any], outdir: str) -> dict[str, Any]:
    """One fit with every monitor recording each step; returns metrics and what the monitors kept."""
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_4d import FourDStrategy
    from lightning_4d.callbacks import (
        CommunicationMonitor,
        ExpertLoadMonitor,
        FourDThroughputMonitor,
        PipelineBubbleMonitor,
    )
    from lightning_4d.expert_parallel import MoE
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model, make_dataset

    torch.manual_seed(0)
    lm = CausalLM(build_model(spec["model"]))
    strategy = spec["strategy"]
    dp = 2 // (strategy.get("tp", 1) * strategy.get("pp", 1))
    comm = CommunicationMonitor(every_n_steps=1)
    experts = ExpertLoadMonitor(every_n_steps=1, heatmap_every_n_steps=1, dirpath=os.path.join(outdir, "experts"))
    bubble = PipelineBubbleMonitor(every_n_steps=1, dirpath=os.path.join(outdir, "pipeline"))
    perf = FourDThroughputMonitor(peak_flops_per_device=1e12, every_n_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FourDStrategy(**strategy), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[comm, experts, bubble, perf], default_root_dir=outdir,
    )
    trainer.fit(lm, DataLoader(make_dataset(B * 2), batch_size=B // dp))
    # Tokens per expert of the last forward (the last step) on every rank, for the exact expectations.
    loads = {name: (m.tokens_per_expert if isinstance(m, MoE) else m.fourd_tokens_per_expert).clone()
             for name, m in lm.named_modules() if isinstance(m, MoE) or hasattr(m, "fourd_tokens_per_expert")}
    gathered = {}
    for name, t in loads.items():
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        gathered[name] = torch.stack(parts)
    return {
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "comm_local": comm.last_local,
        "expert_tokens": experts.last_tokens,
        "expert_layers": experts.layers,
        "expert_written": experts.written,
        "bubble_written": bubble.written,
        "loads": gathered,
        "rank": dist.get_rank(),
    }


def _world(rank: int, specs: list[dict[str, Any]], outdir: str) -> list[dict[str, Any]]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    return [_fit(spec, os.path.join(outdir, str(i))) for i, spec in enumerate(specs)]


SPECS = [
    dict(model="llama", strategy=dict(tp=2, sequence_parallel=False)),
    dict(model="llama", strategy=dict(tp=2, sequence_parallel=True)),
    dict(model="moe", strategy=dict(tp=2, ep=2)),
    dict(model="moe-aux", strategy=dict(ep=2, data_parallel="replicate")),
    # transformers' Mixtral: its own fused experts module, expert-parallel in place.
    dict(model="hf-mixtral", strategy=dict(tp=2, ep=2)),
]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: Any) -> list[list[dict[str, Any]]]:
    outdir = str(tmp_path_factory.mktemp("callbacks"))
    return run_world(_world, 2, SPECS, outdir, timeout_s=900)


def _metric_families(metrics: dict[str, float]) -> set[str]:
    return {k.split("/")[0] for k in metrics}


def test_metrics_are_global_and_monitors_without_their_parallelism_do_nothing(fits: Any) -> None:
    for i, spec in enumerate(SPECS):
        r0, r1 = fits[0][i], fits[1][i]
        m0, m1 = r0["metrics"], r1["metrics"]
        # Everything the monitors log is already aggregated over ranks: the same keys everywhere, and
        # the same values apart from wall-clock times.
        assert set(m0) == set(m1)
        for key in m0:
            if not key.endswith("_seconds") and "tokens_per_second" not in key and "peak_memory" not in key:
                assert m0[key] == pytest.approx(m1[key]), key
        families = _metric_families(m0)
        assert "pp" not in families and r0["bubble_written"] == []  # no pipeline: no bubble monitor output
        dense = spec["model"] == "llama"
        assert ("moe" in families) != dense  # dense model: no expert metrics
        assert {"comm", "perf", "train_loss"} <= families


def test_tensor_parallel_all_reduces_are_exact(fits: Any) -> None:
    m = fits[0][0]["metrics"]
    act = B * SEQ * H * 4  # S
    assert m["comm/tp/all_reduce_count"] == 4 * LAYERS + 2 + 3
    assert m["comm/tp/all_reduce_bytes"] == (4 * LAYERS + 2) * act + 3 * (B * SEQ * 4)
    assert {k for k in m if k.startswith("comm/") and k.endswith("_count")} == {"comm/tp/all_reduce_count"}
    assert m["comm/tp/all_reduce_seconds"] > 0
    # The planner's analytic bytes (lightning_4d.planner.comm) agree exactly.
    assert m["comm/tp/all_reduce_ratio"] == pytest.approx(1.0)
    for rank in (0, 1):
        local = fits[rank][0]["comm_local"]
        assert local[("tp", "all_reduce")]["count"] == 4 * LAYERS + 5


def test_sequence_parallel_all_gathers_and_reduce_scatters_are_exact(fits: Any) -> None:
    m = fits[0][1]["metrics"]
    act = B * SEQ * H * 4
    # 4 per block (2 regions × forward/backward); SP lives between the blocks, so the last block's output
    # gather (forward) and the first block's input-gradient gather (backward) add two all-gathers.
    expected = {"all_gather": 4 * LAYERS + 2, "reduce_scatter": 4 * LAYERS}
    for kind, count in expected.items():
        assert m[f"comm/tp/{kind}_count"] == count
        assert m[f"comm/tp/{kind}_bytes"] == count * act / 2
        assert m[f"comm/tp/{kind}_ratio"] == pytest.approx(1.0)  # the planner's formula, exactly
    # Inside the blocks: the same total bytes as the all-reduces without SP.
    no_sp = fits[0][0]["metrics"]
    loss = 3 * (B * SEQ * 4)
    assert m["comm/tp/all_gather_bytes"] - act + m["comm/tp/reduce_scatter_bytes"] == (
        no_sp["comm/tp/all_reduce_bytes"] - 2 * act - loss)
    # All-reduces left: loss parallel (3 of b·s fp32), the embedding output and the head's input gradient
    # (act each), and the sequence-sharded norms' weight gradients (2 per block, h fp32 each), the latter
    # once per optimizer use of the partial gradient.
    norms = 2 * LAYERS
    rest = m["comm/tp/all_reduce_bytes"] - loss - 2 * act
    assert rest > 0 and rest % (norms * H * 4) == 0
    assert m["comm/tp/all_reduce_count"] == 3 + 2 + rest / (H * 4)


def _a2a_expected(loads: dict[str, torch.Tensor], ep: int) -> float:
    """Mean over ranks of the all-to-all bytes one rank sends in a step (dropless routing)."""
    per_rank = []
    for rank in range(ep):
        total = 0.0
        for tpe in loads.values():  # (ranks, E): assignments routed by each rank to each expert
            mine = range(rank * EXPERTS // ep, (rank + 1) * EXPERTS // ep)
            others = [e for e in range(EXPERTS) if e not in mine]
            sent = float(tpe[rank, others].sum())  # dispatch: my tokens to remote experts
            returned = float(sum(tpe[r, e] for r in range(ep) if r != rank for e in mine))  # combine
            # forward dispatch + combine, backward their reverses; + the counts (E int64, half stays)
            total += 2 * (sent + returned) * H * 4 + EXPERTS * 8 * (ep - 1) / ep
        per_rank.append(total)
    return sum(per_rank) / len(per_rank)


@pytest.mark.parametrize("index", [2, 3, 4], ids=["tp2-ep2-sp", "dp2-ep2", "hf-mixtral-tp2-ep2-sp"])
def test_expert_all_to_alls_and_load_are_exact(fits: Any, index: int) -> None:
    got = fits[0][index]
    m, loads = got["metrics"], got["loads"]
    moe_layers = len(loads)
    assert moe_layers == LAYERS
    assert m["comm/ep/all_to_all_count"] == 5 * moe_layers
    assert m["comm/ep/all_to_all_bytes"] == pytest.approx(_a2a_expected(loads, 2), rel=1e-12)
    if SPECS[index]["model"].startswith("moe"):  # the planner models the package's MoE layers only
        assert 0.5 < m["comm/ep/all_to_all_ratio"] < 1.5  # the planner assumes uniform routing
    # Global load: every routed token of the step, summed over the ranks that route different tokens.
    tokens = got["expert_tokens"]
    assert tokens.shape == (moe_layers, EXPERTS)
    expected = torch.stack([loads[name].sum(0).double() for name in sorted(loads)])
    assert torch.equal(tokens, expected)
    assert float(tokens.sum(1)[0]) == B * SEQ * TOPK  # the global batch's tokens, k assignments each
    for i, layer in enumerate(got["expert_layers"]):
        mean = B * SEQ * TOPK / EXPERTS
        assert m[f"moe/{layer}/imbalance"] == pytest.approx(float(tokens[i].max()) / mean)
        assert m[f"moe/{layer}/cv"] == pytest.approx(float(tokens[i].std(unbiased=False)) / mean)
        assert m[f"moe/{layer}/dropped_tokens"] == 0.0
        for e in range(EXPERTS):
            assert m[f"moe/{layer}/tokens_expert{e}"] == float(tokens[i, e])
    assert got["expert_layers"] == ["layer0", "layer1"]
    assert ("moe/aux_loss" in m) == (index == 3) and m.get("moe/aux_loss", 1.0) > 0
    # Heatmaps (layers × experts) written by global rank 0 only, one per step.
    assert [os.path.basename(p) for p in got["expert_written"]] == ["experts_step0.png", "experts_step1.png"]
    assert fits[1][index]["expert_written"] == []
    image = __import__("matplotlib.image").image.imread(got["expert_written"][-1])
    assert image.ndim == 3 and image.shape[0] > 50


def test_throughput_and_memory(fits: Any) -> None:
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model

    m = fits[0][0]["metrics"]
    assert m["perf/tokens_per_second"] > 0 and m["perf/step_seconds"] > 0
    flops = CausalLM(build_model("llama")).model.flops_per_token(SEQ)
    # (logged values are float32 in callback_metrics)
    assert m["perf/mfu"] == pytest.approx(flops * m["perf/tokens_per_second"] / (1e12 * 2), rel=1e-6)
    assert m["perf/peak_memory_bytes_max"] >= m["perf/peak_memory_bytes_mean"] > 10 * 2**20
    assert {"perf/peak_memory_bytes_rank0", "perf/peak_memory_bytes_rank1"} <= set(m)


def _pipeline_fit(rank: int, outdir: str) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_4d import FourDStrategy
    from lightning_4d.callbacks import CommunicationMonitor, PipelineBubbleMonitor
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model, make_dataset

    os.environ.setdefault("PL_DISABLE_FORK", "1")
    torch.manual_seed(0)
    m = 4
    comm, bubble = CommunicationMonitor(every_n_steps=1), PipelineBubbleMonitor(every_n_steps=1, trace_every_n_steps=1,
                                                                                dirpath=outdir)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(pp=2, microbatches=m), max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[comm, bubble])
    trainer.fit(CausalLM(build_model("llama")), DataLoader(make_dataset(B * 3), batch_size=B))
    if getattr(trainer.strategy.plan, "pipeline", None) is None:
        return {"integrated": False}
    return {"integrated": True, "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "written": bubble.written, "m": m}


def test_pipeline_monitors_in_a_fit(tmp_path: Any) -> None:
    r0, r1 = run_world(_pipeline_fit, 2, str(tmp_path), timeout_s=600)
    assert r0["integrated"], "FourDStrategy(pp=2) exposes no pipeline runner"
    m, micro = r0["metrics"], r0["m"]
    act = B // micro * SEQ * H * 4
    # One activation forward and one gradient backward per micro-batch across the single boundary.
    assert m["comm/pp/send_count"] == micro and m["comm/pp/recv_count"] == micro
    assert m["comm/pp/send_bytes"] == micro * act
    assert m["pp/bubble_fraction_theory"] == pytest.approx(1 / (micro + 1))
    assert 0.0 <= m["pp/bubble_fraction"] < 1.0 and {"pp/bubble_fraction_stage0", "pp/bubble_fraction_stage1"} <= set(m)
    assert any(p.endswith(".json") for p in r0["written"])
