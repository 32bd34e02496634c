"""The host-tensor guard (tests/host_guard.py), the CPU stand-in for NCCL's refusal of host tensors: what it counts
as a host or a device tensor, and that the package's collectives refuse host tensors under it (in a fake process
group: no ranks are started)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_4d.core.distributed import all_reduce_sum, broadcast_module_state
from lightning_4d.planner.fake_world import fake_world
from tests.host_guard import DEVICE_STAND_IN, HostTensorError, host_tensor_guard, where


def test_host_and_device_tensors() -> None:
    root = DEVICE_STAND_IN  # the strategy's root_device under the guard
    with host_tensor_guard():
        host = torch.ones(4)
        made = [host, torch.tensor([1.0]), torch.zeros(2), torch.arange(3), torch.as_tensor(np.ones(2)),
                torch.ones(2, device="cpu"), torch.ones(2, device=root).cpu(), host * 2, host.view(2, 2),
                torch.stack([host, host]), host.data, nn.Linear(2, 2).weight]  # parameters share the storage
        assert [where(t) for t in made] == ["host"] * len(made)
        x = torch.ones(2, 3).to(root)  # moved to the device
        derived = [x, x + 1, x.sum(), x[0], torch.empty_like(x), x.new_zeros(2), x.double(), x.data,
                   torch.tensor([1.0]).to(root), torch.zeros(2).to(x), torch.ones(2, device=root),
                   x + torch.tensor(2.0)]  # a 0-dim host tensor is a scalar, as on a GPU
        assert [where(t) for t in derived] == ["device"] * len(derived)
        with torch.device(root):  # Lightning's tensor_init_context
            assert where(torch.zeros(2)) == where(nn.Linear(2, 2).weight) == "device"
        lin = nn.Linear(2, 2)
        lin.to(root)
        assert where(lin.weight) == where(lin.bias) == "device"
        assert where(torch.ones(2, device=torch.device("cpu"))) is None  # unknown: host and device name it alike
        with pytest.raises(HostTensorError, match="same device"):
            torch.ones(3) + x[0]  # a host and a device tensor in one op
        x[0] = torch.ones(3)  # copying in (indexing, copy_) is allowed, as on a GPU
        x.copy_(torch.zeros(2, 3))
    assert where(torch.ones(1)) is None  # no guard


def test_collectives_refuse_host_tensors() -> None:
    original = torch.distributed.all_reduce
    with fake_world(2), host_tensor_guard():
        all_reduce_sum(torch.ones(2, device=DEVICE_STAND_IN))  # a device tensor passes
        with pytest.raises(HostTensorError, match="all_reduce"):
            all_reduce_sum(torch.ones(2))
        model = nn.Linear(2, 2)  # built on the host
        with pytest.raises(HostTensorError, match="broadcast"):
            broadcast_module_state(model)
        broadcast_module_state(model.to(DEVICE_STAND_IN))
        torch.distributed.all_reduce(torch.ones(2))  # not called from the package: not checked
    assert torch.distributed.all_reduce is original  # restored


def test_grad_norm_of_a_rank_without_gradients() -> None:
    """A rank holding no gradient still takes part in the norm's all-reduce, on its parameters' device."""
    from lightning_4d.core.distributed import global_grad_norm

    with fake_world(2), host_tensor_guard():
        assert float(global_grad_norm(nn.Linear(2, 2).to(DEVICE_STAND_IN).parameters())) == 0.0
