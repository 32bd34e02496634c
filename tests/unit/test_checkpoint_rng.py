"""Checkpoints keep each rank's own GPU random state only (``torch.cuda`` mocked: no GPU here): a resume where a
process sees fewer GPUs (per-task ``CUDA_VISIBLE_DEVICES``, another node shape) loads it; older checkpoints holding
every visible GPU's state still load, this rank's entry."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_4d.checkpoint.state import _rng_state, _set_rng_state


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A process that sees one GPU (device 0); returns the states set on it."""
    applied: list[Any] = []

    def every_gpu(*args: Any) -> Any:
        raise AssertionError("the state of every visible GPU is neither saved nor restored")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": applied.append(state))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_gpu)
    return applied


def test_only_this_ranks_gpu_state_is_saved_and_restored(one_gpu: list[Any]) -> None:
    state = _rng_state()
    assert torch.equal(state["cuda_device"], torch.tensor([7], dtype=torch.uint8)) and "cuda" not in state
    _set_rng_state(state)
    assert one_gpu == [state["cuda_device"]]


def test_an_older_checkpoint_restores_this_ranks_entry(one_gpu: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    old = {k: v for k, v in _rng_state().items() if k != "cuda_device"}
    old["cuda"] = [torch.tensor([r], dtype=torch.uint8) for r in range(8)]  # saved by local rank 3 seeing 8 GPUs
    monkeypatch.setenv("LOCAL_RANK", "3")
    _set_rng_state(old)
    assert [int(s) for s in one_gpu] == [3]
