"""Monitors without a process group: the pure pieces (bytes per collective, bubble from events, trace,
load statistics, MFU, figures) and single-process fits where the parallel monitors must do nothing."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_4d.callbacks import (
    CommRecorder,
    CommunicationMonitor,
    ExpertLoadMonitor,
    FourDThroughputMonitor,
    PipelineBubbleMonitor,
    bubble_stats,
    chrome_trace,
    load_stats,
    mfu,
    peak_memory_bytes,
)
from lightning_4d.callbacks._common import every_n, internal_comm, is_internal_comm, resolve_every_n
from lightning_4d.core.comm import mesh_axis_groups
from lightning_4d.core.comm import op_bytes
from lightning_4d.callbacks.experts import layer_labels, plot_expert_heatmap
from lightning_4d.callbacks.pipeline import _local_row, _stats_from_rows, idle_intervals, plot_timeline, write_trace
from lightning_4d.callbacks.throughput import _frozen_linear, find_flops_per_token
from lightning_4d.pipeline.instrument import PipelineEvent


# ---------------------------------------------------------------------------------------------- communication
def test_bytes_per_collective_follow_the_ring_formulas() -> None:
    t = torch.zeros(8, 4)  # 128 bytes
    assert op_bytes("allreduce_", "all_reduce", ([t],), 4, 0) == 2 * 3 / 4 * 128
    assert op_bytes("all_reduce", "all_reduce", (t, "sum", "g"), 2, 1) == 128
    # all-gather: S is the gathered tensor
    assert op_bytes("_allgather_base_", "all_gather", (torch.zeros(32, 4), t), 4, 0) == 3 / 4 * 512
    assert op_bytes("all_gather_into_tensor", "all_gather", (t, 4, "g"), 4, 0) == 3 / 4 * 512
    assert op_bytes("allgather_", "all_gather", ([[t] * 4], [t]), 4, 0) == 3 / 4 * 512
    # reduce-scatter: S is the input
    assert op_bytes("_reduce_scatter_base_", "reduce_scatter", (torch.zeros(2, 4), t), 4, 0) == 3 / 4 * 128
    assert op_bytes("reduce_scatter_tensor", "reduce_scatter", (t, "sum", 4, "g"), 4, 0) == 3 / 4 * 128
    # all-to-all: the rows that leave the rank, exact for uneven splits
    assert op_bytes("alltoall_base_", "all_to_all", (torch.zeros(5, 4), t, None, [5, 3], [6, 2]), 2, 0) == 2 * 16
    assert op_bytes("alltoall_base_", "all_to_all", (torch.zeros(5, 4), t, None, [5, 3], [6, 2]), 2, 1) == 6 * 16
    assert op_bytes("all_to_all_single", "all_to_all", (t, [], [], "g"), 4, 0) == 3 / 4 * 128
    # point-to-point: the tensor; nothing over one rank
    assert op_bytes("send", "send", ([t], None, 1, 0), 2, 0) == 128
    assert op_bytes("recv_", "recv", ([t], None, 0, 0), 2, 1) == 128
    assert op_bytes("allreduce_", "all_reduce", ([t],), 1, 0) == 0


def test_recorder_outside_collectives_records_nothing_and_restores_work_wait() -> None:
    import torch.distributed as dist

    original = dist.Work.wait
    with CommRecorder({}) as outer:
        with CommRecorder({}) as inner:
            assert dist.Work.wait is not original  # wrapped while recording (shared by nested recorders)
            torch.ones(3).sum()
        assert dist.Work.wait is not original
    assert dist.Work.wait is original
    assert outer.records == inner.records == [] and outer.totals() == {}
    assert mesh_axis_groups(None) == {}


def test_internal_comm_and_cadence() -> None:
    assert not is_internal_comm()
    with internal_comm():
        with internal_comm():
            assert is_internal_comm()
        assert is_internal_comm()
    assert not is_internal_comm()
    assert [s for s in range(5) if every_n(2, s)] == [0, 2, 4] and not every_n(0, 0)
    assert resolve_every_n(None, SimpleNamespace(log_every_n_steps=7)) == 7 and resolve_every_n(3, None) == 3
    for cls in (CommunicationMonitor, ExpertLoadMonitor, PipelineBubbleMonitor, FourDThroughputMonitor):
        cls()  # no required arguments
        with pytest.raises(ValueError, match="every_n_steps"):
            cls(every_n_steps=0)
    with pytest.raises(ValueError, match="makespan"):
        PipelineBubbleMonitor(makespan="wall")


# ---------------------------------------------------------------------------------------------- pipeline
def _two_rank_step(offset: float = 0.0, step: int = 0) -> list[PipelineEvent]:
    """Rank 0: F 0-1, B 3-5; rank 1: F 1-2, B 2-3 (stage = rank); step spans 0-5 and 0.5-3.5."""
    o = offset
    return [
        PipelineEvent(step, 0, None, "step", None, o + 0.0, o + 5.0),
        PipelineEvent(step, 1, None, "step", None, o + 0.5, o + 3.5),
        PipelineEvent(step, 0, 0, "F", 0, o + 0.0, o + 1.0),
        PipelineEvent(step, 1, 1, "F", 0, o + 1.0, o + 2.0),
        PipelineEvent(step, 1, 1, "B", 0, o + 2.0, o + 3.0),
        PipelineEvent(step, 0, 0, "wait", None, o + 1.0, o + 3.0),
        PipelineEvent(step, 0, 0, "B", 0, o + 3.0, o + 5.0),
    ]


def test_bubble_from_events_global_and_per_rank_makespan() -> None:
    stats = bubble_stats(_two_rank_step())
    assert stats.per_rank == pytest.approx({0: 1 - 3 / 5, 1: 1 - 2 / 5})
    assert stats.per_stage == pytest.approx({0: 0.4, 1: 0.6})
    assert stats.overall == pytest.approx(0.5) and stats.makespan == pytest.approx(5.0)
    local = bubble_stats(_two_rank_step(), makespan="rank")
    assert local.per_rank == pytest.approx({0: 1 - 3 / 5, 1: 1 - 2 / 3})
    two_steps = bubble_stats(_two_rank_step() + _two_rank_step(10.0, step=1))
    assert two_steps.overall == pytest.approx(0.5)


def test_compact_rows_give_the_same_bubble_as_the_events() -> None:
    events = _two_rank_step()
    rows = torch.stack([_local_row([e for e in events if e.rank == r], 2, 0, r) for r in (0, 1)])
    # a second pipeline copy (replica 1) with the same timing
    rows = torch.cat([rows, rows.clone().index_fill_(1, torch.tensor([1]), 1.0)])
    compact = _stats_from_rows(rows, 2, "global")
    full = bubble_stats(events)
    assert compact is not None
    assert compact.overall == pytest.approx(full.overall)
    assert compact.per_rank == pytest.approx(full.per_rank) and compact.per_stage == pytest.approx(full.per_stage)
    assert _stats_from_rows(torch.zeros(2, 8, dtype=torch.float64), 2, "global") is None


def test_chrome_trace_has_one_event_per_action_and_the_idle_gaps(tmp_path: Any) -> None:
    events = _two_rank_step()
    idle = idle_intervals(events)
    assert [(e.rank, e.t0, e.t1) for e in idle] == [(0, 1.0, 3.0), (1, 0.0, 1.0), (1, 3.0, 5.0)]
    path = write_trace(events, str(tmp_path / "sub" / "trace.json"), metadata={"schedule": "1f1b"})
    with open(path) as fh:
        trace = json.load(fh)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["pid"], e["name"]) for e in complete if e["name"] != "idle") == [
        (0, "B"), (0, "F"), (1, "B"), (1, "F")]
    assert sum(e["dur"] for e in complete) == pytest.approx(2 * 5.0 * 1e6)  # every rank covers the makespan
    first = next(e for e in complete if e["name"] == "F" and e["pid"] == 1)
    assert first["ts"] == pytest.approx(1e6) and first["args"] == {"stage": 1, "microbatch": 0, "step": 0}
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["pp rank 0 (stage 0)", "pp rank 1 (stage 1)"]
    assert trace["otherData"] == {"schedule": "1f1b"}
    assert chrome_trace([])["traceEvents"] == []


def test_timeline_and_heatmap_pngs(tmp_path: Any) -> None:
    import matplotlib.image as image
    png = plot_timeline(_two_rank_step(), str(tmp_path / "timeline.png"), "test")
    heat = plot_expert_heatmap(torch.tensor([[4.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 2.0]]), ["layer0", "layer1"],
                               str(tmp_path / "experts.png"), "test")
    for path in (png, heat):
        assert path is not None
        img = image.imread(path)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 200
    # Forward bars are dark, backward bars light: both colours are in the picture.
    rgb = (image.imread(png)[..., :3] * 255).round().astype(int).reshape(-1, 3)
    pixels = {tuple(p) for p in rgb.tolist()}
    assert (8, 48, 107) in pixels and (107, 174, 214) in pixels


# ---------------------------------------------------------------------------------------------- experts
def test_load_statistics_and_layer_labels() -> None:
    assert load_stats(torch.tensor([6.0, 2.0, 2.0, 2.0])) == pytest.approx(
        {"tokens": 12.0, "imbalance": 2.0, "cv": (3**0.5) / 3})
    assert load_stats(torch.zeros(4)) == {"tokens": 0.0, "imbalance": 0.0, "cv": 0.0}
    assert layer_labels(["model.layers.0.feed_forward", "model.layers.12.feed_forward"]) == {
        "model.layers.0.feed_forward": "layer0", "model.layers.12.feed_forward": "layer12"}
    assert layer_labels(["moe"]) == {"moe": "moe"}
    assert layer_labels(["a.0.moe", "b.0.moe"]) == {"a.0.moe": "a.0.moe", "b.0.moe": "b.0.moe"}  # clash: full names


# ---------------------------------------------------------------------------------------------- throughput
def test_mfu_memory_and_flops_lookup() -> None:
    from lightning_4d.models import Llama, LlamaConfig

    assert mfu(100.0, 10.0, 1000.0, 2) == pytest.approx(0.5) and mfu(1.0, 1.0, 0.0, 1) == 0.0
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20
    model = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=8))
    fn = find_flops_per_token(torch.nn.Sequential(model))
    assert fn is not None and fn(8) == model.flops_per_token(8)
    frozen = _frozen_linear(fn)
    assert frozen is not None and frozen(8) == model.flops_per_token(8) and frozen(5) == model.flops_per_token(5)
    assert find_flops_per_token(torch.nn.Linear(2, 2)) is None and _frozen_linear(None) is None


# ---------------------------------------------------------------------------------------------- single process
def _fit(model: torch.nn.Module, tmp_path: Any) -> tuple[Any, list[Any]]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_4d.models import CausalLM

    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (8, 9))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    monitors = [CommunicationMonitor(), PipelineBubbleMonitor(), ExpertLoadMonitor(heatmap_every_n_steps=1),
                FourDThroughputMonitor(peak_flops_per_device=1e12)]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        callbacks=monitors, default_root_dir=str(tmp_path))
    trainer.fit(CausalLM(model), DataLoader(data, batch_size=4))
    return trainer, monitors


def test_single_process_dense_model_logs_only_throughput(tmp_path: Any) -> None:
    from lightning_4d.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=8))
    trainer, monitors = _fit(model, tmp_path)
    families = {k.split("/")[0] for k in trainer.callback_metrics}
    assert families == {"train_loss", "perf"}  # no communication, no pipeline, no experts
    metrics = trainer.callback_metrics
    assert float(metrics["perf/tokens_per_second"]) > 0
    assert float(metrics["perf/mfu"]) == pytest.approx(
        model.flops_per_token(8) * float(metrics["perf/tokens_per_second"]) / 1e12, rel=1e-6)
    assert not monitors[0].active and monitors[1].instrument is None and not monitors[2].active
    assert not (tmp_path / "experts").exists() or not any((tmp_path / "experts").iterdir())


def test_single_process_moe_model_logs_expert_load(tmp_path: Any) -> None:
    from lightning_4d.models.moe import MoEConfig, MoETransformer

    cfg = MoEConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, num_experts=4, top_k=2, expert_hidden=16,
                    max_seq_len=8, first_dense_layers=1, aux_loss_coef=0.01)
    trainer, monitors = _fit(MoETransformer(cfg), tmp_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    experts = monitors[2]
    assert experts.layers == ["layer1"]  # the one MoE block (block 0 is dense)
    assert metrics["moe/layer1/tokens"] == 4 * 8 * 2  # every token of the batch, top-2
    assert sum(metrics[f"moe/layer1/tokens_expert{e}"] for e in range(4)) == 4 * 8 * 2
    assert metrics["moe/layer1/imbalance"] >= 1.0 and metrics["moe/aux_loss"] > 0
    assert not any(k.startswith(("comm/", "pp/")) for k in metrics)
    assert [p.rsplit("/", 1)[-1] for p in experts.written] == (
        ["experts_step0.png", "experts_step1.png"] if _has_matplotlib() else [])


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_throughput_tokens_it_cannot_count_warn_once_with_the_cause() -> None:
    monitor = FourDThroughputMonitor(peak_flops_per_device=1e12)

    class Splits(torch.nn.Module):
        def split_batch(self, batch: Any) -> Any:
            raise KeyError("input_ids")

    assert monitor._local_tokens(torch.nn.Linear(2, 2), (torch.zeros(3, 5), None))[0] == 15
    with pytest.warns(UserWarning, match=r"split_batch.*KeyError.*tokens_fn") as record:
        assert monitor._local_tokens(Splits(), {"input_ids": torch.zeros(2, 4)})[0] == 0
        assert monitor._local_tokens(Splits(), {"input_ids": torch.zeros(2, 4)})[0] == 0
    assert len(record) == 1
    with pytest.warns(UserWarning, match="inputs are a dict, not a tensor of token ids"):
        FourDThroughputMonitor()._local_tokens(torch.nn.Linear(2, 2), {"input_ids": torch.zeros(2, 4)})
    counted = FourDThroughputMonitor(tokens_fn=lambda batch: int(batch["input_ids"].numel()))
    assert counted._local_tokens(torch.nn.Linear(2, 2), {"input_ids": torch.zeros(2, 4)})[0] == 8
