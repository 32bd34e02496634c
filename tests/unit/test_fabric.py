"""Lightning Fabric's ``FourDStrategy`` without a process group: its options, its name in Fabric's registry, the
optimizer re-pointed at the set-up model's parameters, the refusals of ``model(x)`` where it cannot train, the
gradient-sync control and the checkpoint's optimizer record."""

from __future__ import annotations

import inspect
from dataclasses import replace
from types import SimpleNamespace
from typing import Optional

import lightning as L
import pytest
import torch
from torch import nn

from lightning_4d import FourDConfig
from lightning_4d.config import options_signature
from lightning_4d.context_parallel.check import check_context_parallel
from lightning_4d.checkpoint.fabric_state import saved_optimizer_keys, split_fabric_state
from lightning_4d.fabric import TRAINER_ONLY, FourDStrategy
from lightning_4d.layout.parallelize import ParallelPlan
from lightning_4d.plan import LayoutPlan
from lightning_4d.layout.set_up import parameter_names, rebind_optimizer
from lightning_4d.runtime.forward import FullOutputModel
from lightning_4d.strategy import FourDStrategy as TrainerStrategy


def test_options_are_the_configs_but_the_trainers_loop() -> None:
    params = list(inspect.signature(FourDStrategy).parameters)
    assert params[:4] == ["tp", "pp", "ep", "dp"] and params[-1] == "kwargs"
    trainer = [p for p in inspect.signature(TrainerStrategy).parameters]
    assert [p for p in trainer if p not in params] == list(TRAINER_ONLY)
    strategy = FourDStrategy(tp=2, pp=2, schedule="gpipe")
    assert (strategy.config.tp, strategy.config.pp, strategy.config.schedule) == (2, 2, "gpipe")
    assert strategy.config.preemption_signals == () and strategy.config.heartbeat_timeout is None
    for name in TRAINER_ONLY:
        with pytest.raises(TypeError, match=name):
            FourDStrategy(**{name: FourDConfig.__dataclass_fields__[name].default})
    with pytest.raises(ValueError, match="schedule='nope'"):
        FourDStrategy(schedule="nope")


def test_options_signature_excludes() -> None:
    sig = options_signature(exclude=("pp", "ep"))
    assert list(sig.parameters)[:3] == ["self", "tp", "dp"]
    assert "pp" not in sig.parameters and "kwargs" in sig.parameters


def test_fourd_is_a_fabric_strategy_name() -> None:
    fabric = L.Fabric(strategy="fourd", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, FourDStrategy)
    assert isinstance(L.Trainer(strategy="fourd", accelerator="cpu", devices=2, logger=False).strategy,
                      TrainerStrategy)


def _tied() -> nn.Module:
    net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False))
    net[2].weight = net[0].weight  # tied under two names
    return net


def test_rebind_optimizer_follows_names_to_this_ranks_parameters() -> None:
    before = _tied()
    optimizer = torch.optim.AdamW([{"params": [before[0].weight], "lr": 0.1},
                                   {"params": list(before[1].parameters()), "weight_decay": 0.0}])
    names = parameter_names(before)
    assert names[id(before[0].weight)] == ["0.weight", "2.weight"]
    # After the set-up: new tensors, the embedding's stage elsewhere, the head holds its own copy of the tied weight.
    after = nn.Sequential()
    after.add_module("1", nn.Linear(4, 4))
    after.add_module("2", nn.Linear(4, 8, bias=False))
    rebind_optimizer(optimizer, names, after)
    first, second = optimizer.param_groups
    assert [id(p) for p in first["params"]] == [id(after[1].weight)] and first["lr"] == 0.1
    assert [id(p) for p in second["params"]] == [id(after[0].weight), id(after[0].bias)]
    assert second["weight_decay"] == 0.0
    optimizer.step()  # a usable optimizer over the new tensors (no gradients: nothing changes)


def test_rebind_optimizer_keeps_an_empty_group_for_another_stage() -> None:
    before = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.SGD([{"params": before[0].parameters()}, {"params": before[1].parameters()}], lr=0.1)
    names = parameter_names(before)
    after = nn.Sequential()
    after.add_module("1", nn.Linear(2, 2))
    rebind_optimizer(optimizer, names, after)
    assert optimizer.param_groups[0]["params"] == [] and len(optimizer.param_groups[1]["params"]) == 2


def test_rebind_optimizer_refuses_what_it_cannot_follow() -> None:
    net = nn.Linear(2, 2)
    stepped = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="has state .* fabric.setup_optimizers"):
        rebind_optimizer(stepped, parameter_names(net), nn.Linear(2, 2))
    foreign = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(3,\) that is not a parameter"):
        rebind_optimizer(foreign, parameter_names(net), nn.Linear(2, 2))
    experts = nn.Module()
    experts.w = nn.Parameter(torch.ones(2, 2))  # a name the model before the set-up did not have
    with pytest.raises(ValueError, match="new names \\(w: experts"):
        rebind_optimizer(torch.optim.SGD(net.parameters(), lr=0.1), parameter_names(net), experts)


_PLAN = LayoutPlan(degrees=(), blocks_path="layers", block_order=("0",))


def _mesh(**degrees: int) -> SimpleNamespace:
    dims = SimpleNamespace(**{"tp": 1, "pp": 1, "cp": 1, **degrees})
    return SimpleNamespace(dims=dims, __getitem__=None)


def test_model_call_refused_where_it_cannot_train() -> None:
    inner = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"cp=2: .*train_step\(model"):
        FullOutputModel(inner, ParallelPlan(_PLAN), _mesh(cp=2))(torch.ones(1, 2))
    piped = FullOutputModel(inner, ParallelPlan(_PLAN, pipeline=object()), _mesh(pp=2))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"gradients under pp=2: .*train_step"):
        piped(torch.ones(1, 2))
    with torch.no_grad(), pytest.raises(TypeError, match="one positional argument"):
        piped(torch.ones(1, 2), torch.ones(1, 2))
    whole = FullOutputModel(inner, ParallelPlan(replace(_PLAN, input_shape=(2, 8))), _mesh())
    assert torch.equal(whole(torch.ones(3, 2)), inner(torch.ones(3, 2)))  # no DTensor: the model's own output
    with pytest.raises(ValueError, match="have 1 dimension"):
        whole(torch.ones(2))  # the inputs' rank is checked before any collective


def test_no_backward_sync_switches_the_models_gradient_sync() -> None:
    strategy = FourDStrategy()
    calls: list[tuple[str, bool]] = []
    from lightning_4d import _compat

    _compat.set_backward_sync_control(strategy, lambda module, on: calls.append((type(module).__name__, on)))
    with strategy._backward_sync_control.no_backward_sync(nn.Linear(1, 1), enabled=True):
        assert calls == [("Linear", False)]
    assert calls == [("Linear", False), ("Linear", True)]
    with strategy._backward_sync_control.no_backward_sync(nn.Linear(1, 1), enabled=False):
        pass
    assert len(calls) == 2


def test_saved_optimizers_record(tmp_path) -> None:
    assert saved_optimizer_keys(str(tmp_path)) is None  # no checkpoint here: the load names the problem
    torch.save({"fourd_fabric": {"model": "model", "optimizers": ["opt", "opt2"]}, "step": 3}, tmp_path / "meta.pt")
    assert saved_optimizer_keys(str(tmp_path)) == ["opt", "opt2"]


def test_split_state_takes_the_one_set_up_model() -> None:
    net, other = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    wrapped = FullOutputModel(net, ParallelPlan(_PLAN), _mesh())
    unwrap = lambda m: m.module if isinstance(m, FullOutputModel) else m  # noqa: E731
    assert split_fabric_state({"m": wrapped, "opt": opt, "step": 2}, net, unwrap) == ("m", {"opt": opt}, {"step": 2})
    with pytest.raises(ValueError, match=r"one model the strategy set up.*\['m'\]"):
        split_fabric_state({"m": other}, net)
    with pytest.raises(ValueError, match=r"one model.*\['a', 'b'\]"):
        split_fabric_state({"a": net, "b": other}, net)
    with pytest.raises(ValueError, match="state_dict"):
        split_fabric_state({"m": net, "state_dict": {}}, net)


class _KVCacheGPT(nn.Module):
    """LitGPT's ``GPT.forward(idx, input_pos=None)``: its second argument is a KV-cache position, refused without
    a cache; called with token ids only, as a Fabric loop calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        if input_pos is not None:
            raise TypeError("You need to call `gpt.set_kv_cache()`")
        return self.head(self.emb(idx))


def test_cp_check_calls_a_model_refusing_positions_without_them() -> None:
    info = check_context_parallel(_KVCacheGPT(), torch.randint(0, 32, (2, 16)), None, cp=2, rank=0)
    assert info.positions is False  # the training step then calls it with token ids only
