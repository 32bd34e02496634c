"""In-place expert parallelism on real MoE models, in one process (ep=1).

For every MoE family of :mod:`tests.distributed.byom_models` (transformers 5 Mixtral / Qwen2-MoE / Qwen3-MoE /
DeepSeek-V3, TorchTitan-style with softmax or sigmoid routing), the experts modules are recognised with the right
contract and router, the one-process replay of the expert-parallel scheme reproduces them, and installing the
wrapper with ep=1 leaves the model's output, gradients, parameter names and state-dict keys unchanged.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_4d.expert_parallel.inplace import (
    find_expert_modules,
    install_expert_parallel,
    is_inplace_experts,
    verify_experts,
)
from lightning_4d.expert_parallel.parallel import apply_inplace_expert_parallel
from tests.distributed.byom_models import MOE_EXPERTS, MOE_TOP_K, build_byom

# family -> (experts modules, contract, router relative to the MoE layer)
FAMILIES: dict[str, tuple[list[str], str, str]] = {
    "hf-mixtral": ([f"model.model.layers.{i}.mlp.experts" for i in (0, 1)], "assignments", "gate"),
    "hf-qwen2moe": ([f"model.model.layers.{i}.mlp.experts" for i in (0, 1)], "assignments", "gate"),
    "hf-qwen3moe": ([f"model.model.layers.{i}.mlp.experts" for i in (0, 1)], "assignments", "gate"),
    "hf-dsv3": (["model.model.layers.1.mlp.experts"], "assignments", "gate"),  # layer 0 is dense
    "titan-moe": ([f"layers.{i}.moe.experts" for i in (0, 1)], "grouped", "router.gate"),
    "titan-moe-sig": (["layers.1.moe.experts"], "grouped", "router.gate"),  # block 0 is dense
}


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(7))  # (B, T)


def _run(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(_tokens())  # (B, T, V)
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_are_recognised(family: str) -> None:
    names, contract, router = FAMILIES[family]
    torch.manual_seed(0)
    specs, rejected = find_expert_modules(build_byom(family))
    assert rejected == []
    assert [s.name for s in specs] == names
    for spec in specs:
        assert spec.contract == contract, spec
        assert spec.num_experts == MOE_EXPERTS, spec
        assert spec.router == router, spec


@pytest.mark.parametrize("family", list(FAMILIES))
def test_install_with_ep1_changes_nothing(family: str) -> None:
    torch.manual_seed(0)
    model = build_byom(family)
    ref_out, ref_grads = _run(model)
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())
    specs, _ = find_expert_modules(model)
    for spec in specs:
        module = model.get_submodule(spec.name)
        cls = type(module)
        for parts in (2, 4):  # the one-process replay of ep=2 and ep=4 matches the plain forward
            verify_experts(module, spec, parts=parts)
        install_expert_parallel(module, spec)  # ep_mesh=None: ep=1
        assert is_inplace_experts(module) and isinstance(module, cls)
        with pytest.raises(ValueError, match="already has expert parallelism installed"):
            install_expert_parallel(module, spec)
    # Same parameter objects under the same names, same checkpoint keys.
    assert list(model.state_dict()) == keys_before
    after = dict(model.named_parameters())
    assert after.keys() == params_before.keys()
    assert all(after[n] is p for n, p in params_before.items())
    out, grads = _run(model)
    assert torch.equal(out, ref_out), f"{family}: output changed (max abs {float((out - ref_out).abs().max()):.2e})"
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), f"{family}: gradient of {name} changed"
    n_tokens = _tokens().numel()
    for spec in specs:
        counts = model.get_submodule(spec.name).fourd_tokens_per_expert
        assert counts is not None and counts.shape == (MOE_EXPERTS,)
        assert int(counts.sum()) == n_tokens * MOE_TOP_K, (spec.name, counts)


@pytest.mark.parametrize("family", ["hf-qwen2moe", "titan-moe"])
def test_apply_inplace_expert_parallel_with_ep1(family: str) -> None:
    torch.manual_seed(0)
    model = build_byom(family)
    ref_out, _ = _run(model)
    specs = apply_inplace_expert_parallel(model, None)
    assert [s.name for s in specs] == FAMILIES[family][0]
    assert all(is_inplace_experts(model.get_submodule(s.name)) for s in specs)
    assert apply_inplace_expert_parallel(model, None) == []  # idempotent: installed modules are not redone
    out, _ = _run(model)
    assert torch.equal(out, ref_out)


def test_verify_rejects_a_forward_that_is_not_a_per_expert_sum() -> None:
    # A TorchTitan-style experts module whose output mixes experts (each expert's output is scaled by the number of
    # experts that received tokens): correct in one process, wrong when the experts are split across ranks.
    model = build_byom("titan-moe")
    spec = next(s for s in find_expert_modules(model)[0])
    module = model.get_submodule(spec.name)
    plain = type(module).forward

    def mixing_forward(self: nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return plain(self, x, num_tokens_per_expert) * int((num_tokens_per_expert > 0).sum())

    module.__class__ = type("MixingExperts", (type(module),), {"forward": mixing_forward})
    with pytest.raises(ValueError, match=spec.name.replace(".", r"\.")):
        verify_experts(module, spec, parts=2)
