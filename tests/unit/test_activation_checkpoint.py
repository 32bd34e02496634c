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


def test_selective_saves_cudnn_attention_and_reducing_collectives() -> None:
    """As TorchTitan's policy: cuDNN attention (what torch picks on an H100) is saved, and so are DTensor's
    all-reduce / reduce-scatter outputs (a recomputation would send them again); all-gathers are recomputed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from lightning_4d.layout.activation_checkpoint import SAVE_OPS
    from lightning_4d.planner.fake_world import fake_world

    cudnn = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
    assert cudnn is None or cudnn.default in SAVE_OPS

    class RowParallel(torch.nn.Module):  # a row-parallel matmul: its partial sums all-reduced, then reduce-scattered
        def __init__(self, mesh: Any) -> None:
            super().__init__()
            self.lin, self.mesh = torch.nn.Linear(4, 4), mesh

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            partial = DTensor.from_local(self.lin(x), self.mesh, [Partial()])
            whole = partial.redistribute(placements=[Replicate()])  # all-reduce
            part = DTensor.from_local(self.lin(x), self.mesh, [Partial()]).redistribute(placements=[Shard(0)])
            gathered = part.redistribute(placements=[Replicate()])  # all-gather: recomputed
            return (whole.to_local().relu() + gathered.to_local()).sum()

    counts = {}
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        for mode in ("selective", "full"):
            block = RowParallel(mesh)
            apply_activation_checkpointing([block], mode)
            loss = block(torch.ones(2, 4, requires_grad=True))
            counter = _OpCounter()
            with counter:
                loss.backward()
            counts[mode] = counter.ops
    for op in ("all_reduce", "reduce_scatter_tensor"):
        assert counts["selective"][op] == 0 < counts["full"][op], (op, counts)
    assert counts["selective"]["all_gather_into_tensor"] > 0
