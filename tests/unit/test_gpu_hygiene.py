"""GPU hygiene on CPU (``torch.cuda`` mocked where a GPU is needed): the caching allocator emptied after set-up on
CUDA; NCCL's flight recorder switched on before the process group starts (unless the user set it, or opted out);
the default process group the strategy made destroyed at exit on every rank."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator

from lightning_4d import FourDStrategy
from lightning_4d.safety.nccl_debug import FLIGHT_RECORDER_ENV


def test_cuda_cache_emptied_after_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append("empty_cache"))
    strategy = FourDStrategy()
    strategy.parallel_devices = [torch.device("cuda", 0)]
    order: list[str] = []
    monkeypatch.setattr(strategy, "_set_up_layout", lambda trainer: order.append("set-up") or object())
    monkeypatch.setattr(strategy, "model_to_device", lambda: order.append("to device"))
    monkeypatch.setattr(strategy, "barrier", lambda *a: order.append("barrier" + str(len(emptied))))
    monkeypatch.setattr(strategy, "_start_heartbeat", lambda: None)
    monkeypatch.setattr(strategy, "setup_precision_plugin", lambda: None)
    strategy.accelerator = CPUAccelerator()
    strategy.model = torch.nn.Linear(1, 1)
    trainer: Any = type("T", (), {"state": type("S", (), {"fn": None})()})()
    monkeypatch.setattr(strategy.accelerator, "setup", lambda trainer: None)
    strategy.setup(trainer)
    assert order == ["set-up", "to device", "barrier1"]  # emptied once set-up is done, before training


def _environment_seen_by_connect(monkeypatch: pytest.MonkeyPatch, **options: Any) -> dict[str, str]:
    """What the environment holds when the strategy starts the process group (``connect`` stopped there)."""
    seen: dict[str, str] = {}

    def connect(*args: Any) -> None:
        seen.update({k: os.environ[k] for k in FLIGHT_RECORDER_ENV if k in os.environ})
        raise KeyboardInterrupt

    monkeypatch.setattr("lightning_4d.runtime.world.connect", connect)  # both strategies join there
    strategy = FourDStrategy(**options)
    strategy.accelerator = CPUAccelerator()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    with pytest.raises(KeyboardInterrupt):
        strategy.setup_environment()
    return seen


def test_flight_recorder_on_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FLIGHT_RECORDER_ENV:
        monkeypatch.delenv(name, raising=False)
    assert _environment_seen_by_connect(monkeypatch, nccl_flight_recorder=False) == {}  # opted out
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")  # the user's own setting wins
    assert _environment_seen_by_connect(monkeypatch) == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
                                                         "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE")
    assert _environment_seen_by_connect(monkeypatch) == FLIGHT_RECORDER_ENV
    for name in FLIGHT_RECORDER_ENV:  # what the strategy set (monkeypatch restores the environment's own)
        os.environ.pop(name, None)


def test_a_group_made_by_the_strategy_is_destroyed_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_4d.core import distributed

    hooks: list[Any] = []
    monkeypatch.setattr("atexit.register", hooks.append)
    monkeypatch.setattr(distributed, "_DESTROY_AT_EXIT", [])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0",
                           LOCAL_RANK="0", NODE_RANK="0").items():
        monkeypatch.setenv(key, value)
    from datetime import timedelta

    try:
        env = LightningEnvironment()
        assert distributed.connect(env, "gloo", timedelta(seconds=30), torch.device("cpu"))
        assert not distributed.connect(env, "gloo", timedelta(seconds=30), torch.device("cpu"))  # reused
        assert len(hooks) == 1 and dist.is_initialized()
        hooks[0]()  # what the interpreter runs at exit
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
