"""The MoE layers' replay in the tensor-parallel value check, in one process (:mod:`lightning_4d.layout.expert_replay`).

The check's MoE layers return what the unsharded forward recorded, exactly (this rank's sequence shard of it), and
compare the input they receive with the recorded one; a layer whose input is neither the recorded tensor nor a
shard of it runs its own forward, and a difference found then is a warning, not an error.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_4d.layout.expert_replay import _Replay, check_with_experts_replayed, moe_layers, record_expert_layers
from lightning_4d.core.verify import check_tensor_parallel

B, T, H, E = 2, 4, 3, 5


class Routed(nn.Module):
    """An MoE layer as the package tells one (an ``experts`` child) returning ``(out (B, T, H), logits (B·T, E))``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = nn.Linear(H, E), nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.experts(x), self.gate(x.reshape(-1, H))


class Net(nn.Module):
    """``pre`` → MoE layer, no residual: what reaches the MoE layer is seen only at its input."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.moe = nn.Linear(H, H), Routed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.moe(self.pre(x))
        out += 1.0  # in place, after the layer: the record is a copy
        return out


def _recorded() -> tuple[Net, torch.Tensor, torch.Tensor, dict]:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(B, T, H)  # (B, T, H)
    with torch.no_grad(), record_expert_layers(net) as calls:
        expected = net(x)
    return net, x, expected, calls


def test_outermost_layers_only() -> None:
    outer = nn.Sequential(Routed())
    outer.experts = nn.ModuleList([Routed()])  # an MoE layer holding MoE layers: the outer one is the layer
    assert list(moe_layers(outer)) == [""]


def test_replayed_output_is_the_recorded_one_and_copies_are_kept() -> None:
    net, x, expected, calls = _recorded()
    assert list(calls) == ["moe"] and len(calls["moe"]) == 1
    with torch.no_grad():
        nn.init.zeros_(net.moe.experts.weight)  # the layer now computes something else
    check_with_experts_replayed(net, calls, None, lambda: check_tensor_parallel(net, x, expected))
    assert "forward" not in net.moe.__dict__  # the layer's own forward is back
    with pytest.raises(ValueError, match="changes its output"):  # ... and without the replay it is seen
        check_tensor_parallel(net, x, expected)


def test_a_changed_input_is_refused_naming_the_layer() -> None:
    net, x, expected, calls = _recorded()
    with torch.no_grad():
        net.pre.weight[0, 0] += 0.1  # before the MoE layer; its replayed output hides it from the model's output
    with pytest.raises(ValueError, match=r"changes its output \(max abs difference .* at the input of the MoE layer "
                                         r"moe on a test input\)"):
        check_with_experts_replayed(net, calls, None, lambda: check_tensor_parallel(net, x, expected))


def test_a_sequence_shard_gets_its_share_of_every_output() -> None:
    net, x, _, calls = _recorded()
    full, (out, logits) = calls["moe"][0]
    replay = _Replay(calls, rank=1, parts=2)  # TP rank 1 of 2: the second half of the sequence
    got_out, got_logits = replay.forward("moe", net.moe.forward)(full[:, T // 2:])
    assert torch.equal(got_out, out[:, T // 2:])
    assert torch.equal(got_logits, logits.view(B, T, E)[:, T // 2:].reshape(-1, E))  # rows of (B·T/2, E)
    assert replay.ratio["moe"] == 0.0 and not replay.own


def test_an_input_that_is_no_shard_runs_the_layer_and_a_difference_then_only_warns(caplog) -> None:
    net, x, expected, calls = _recorded()
    replay = _Replay(calls, rank=0, parts=2)
    replay.forward("moe", net.moe.forward)(torch.randn(B, T - 1, H))  # neither the input nor half of it
    assert replay.own == ["moe"] and len(replay.queues["moe"]) == 1
    calls["moe"][0] = (torch.randn(B, T + 1, H), calls["moe"][0][1])  # the recorded input has another shape
    with torch.no_grad():
        nn.init.zeros_(net.moe.experts.weight)
    with caplog.at_level(logging.WARNING, logger="lightning_4d.layout.expert_replay"):
        check_with_experts_replayed(net, calls, None, lambda: check_tensor_parallel(net, x, expected))
    assert "ran their own forward" in caplog.text and "moe" in caplog.text
