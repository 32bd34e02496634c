"""Activation checkpointing: what is recomputed, identical gradients, names unchanged."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from lightning_4d._compat import dispatch_mode_base, op_name
from lightning_4d.layout.activation_checkpoint import apply_activation_checkpointing
from lightning_4d.models import Llama, LlamaConfig


class _OpCounter(dispatch_mode_base()):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.ops[op_name(func)] += 1
        return func(*args, **(kwargs or {}))


def _run(mode: str | None) -> tuple[Counter[str], dict[str, torch.Tensor], list[str]]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, dropout=0.1))
    apply_activation_checkpointing(list(model.layers), mode)
    x = torch.randint(0, 64, (2, 16))
    torch.manual_seed(1)  # dropout masks
    loss = model(x).float().pow(2).mean()
    counter = _OpCounter()
    with counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return counter.ops, grads, [n for n, _ in model.named_parameters()]


def test_checkpointing_recomputes_and_keeps_gradients() -> None:
    none_ops, ref, names = _run(None)
    full_ops, full, full_names = _run("full")
    sel_ops, sel, _ = _run("selective")
    assert full_names == names  # parameter names unchanged
    # "full" recomputes each block's forward in backward: its 7 projections per block are run again.
    assert full_ops["mm"] - none_ops["mm"] == 2 * 7
    # "selective" keeps matmul outputs (no extra mm) but recomputes the cheap SwiGLU activation.
    assert sel_ops["mm"] == none_ops["mm"]
    assert sel_ops["silu"] > none_ops["silu"]
    for name, g in ref.items():
        # dropout masks are replayed exactly in the recomputation
        torch.testing.assert_close(full[name], g, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sel[name], g, rtol=1e-6, atol=1e-7)


def test_bad_mode() -> None:
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        apply_activation_checkpointing([torch.nn.Linear(2, 2)], "some")
