"""The pipeline instrument's clock: host time on CPU stages; on CUDA stages CUDA events (the host only queues
kernels, so host time would measure launches), read after the step. torch.cuda is mocked: a fake GPU whose stage
work takes 10 ms of device time and no host time."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_4d.pipeline.instrument import PipelineInstrument, bubble_share


class _GPU:
    now_ms = 0.0
    syncs = 0


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: float = float("nan")

    def record(self, stream: Any = None) -> None:
        self.t = _GPU.now_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_Event") -> float:
        return end.t - self.t


class _Stage:
    """What the instrument wraps of a PipelineStage: forward / backward of one micro-batch, 10 ms on the device."""

    has_backward = True
    stage_index = 0
    group_rank = 0

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)

    device_ms = 10.0  # each chunk's device time

    def forward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> None:
        _GPU.now_ms += self.device_ms

    def backward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> None:
        _GPU.now_ms += self.device_ms

    def backward_weight_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> None:
        pass


class _Schedule:
    def __init__(self, stage: _Stage) -> None:
        self.stage = stage

    def step(self) -> None:
        for mb in range(2):
            self.stage.forward_one_chunk(mb)
        _GPU.now_ms += 20.0  # the device idles (a bubble) while the host waits on nothing
        for mb in range(2):
            self.stage.backward_one_chunk(mb)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _GPU.now_ms, _GPU.syncs = 0.0, 0
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: setattr(_GPU, "syncs", _GPU.syncs + 1))


def test_cuda_stages_are_timed_by_cuda_events(fake_cuda: None) -> None:
    stage = _Stage("cuda:0")
    inst = PipelineInstrument([stage], _Schedule(stage))  # type: ignore[list-item, arg-type]
    for _ in range(2):
        inst.schedule.step()
    compute = [e for e in inst.events if e.kind in "FB"]
    assert [e.kind for e in compute] == ["F", "F", "B", "B"] * 2
    assert all(e.duration == pytest.approx(0.010) for e in compute)  # the device's 10 ms, not the host's µs
    assert _GPU.syncs == 2  # one per instrumented step
    assert bubble_share(inst.events) == {0: pytest.approx(20 / 60)}


def test_cpu_stages_keep_host_time(fake_cuda: None) -> None:
    stage = _Stage("cpu")
    stage.device_ms = 1e9  # a device clock far beyond any host time, so the test holds on a loaded machine
    inst = PipelineInstrument([stage], _Schedule(stage))  # type: ignore[list-item, arg-type]
    inst.schedule.step()
    assert inst.events and _GPU.syncs == 0
    assert all(e.duration < 1e5 for e in inst.events)  # host time: the device clock's 1e6 s per chunk not seen
