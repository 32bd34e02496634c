"""FourDStrategy(tp=2) × dp=2 against Lightning's ModelParallelStrategy with the same plan, 4 CPU ranks.

Both runs train the same Llama-style model on the same data in one invocation (alternating, several
rounds, so machine noise hits both alike). The baseline shards the model by hand in
``configure_model`` with the TorchTitan TP+SP plan and FSDP2 per block. Printed: median step time of
each, their ratio (target ≤ 1.05), and parameter bytes per rank against the unsharded model
(target ≈ 1/(tp·dp) = 0.25).

Run: python bench/bench_tp.py [--rounds 3 --steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_4d import FourDStrategy
from lightning_4d.models import CausalLM, Llama, LlamaConfig
from lightning_4d.testing import run_world

CFG = LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=384, max_seq_len=64)


class _HandSharded(L.LightningModule):
    """The baseline: a plain LightningModule parallelised by hand for ModelParallelStrategy."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        parallelize_module(self.model, tp, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        })
        for block in self.model.layers:
            parallelize_module(block, tp, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
            block.attention.n_heads //= tp.size()
            block.attention.n_kv_heads //= tp.size()
        for i, block in enumerate(self.model.layers):
            fully_shard(block, mesh=dp, reshard_after_forward=i < len(self.model.layers) - 1)
        fully_shard(self.model, mesh=dp)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        x, y = batch
        with loss_parallel():
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss.backward()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=False)


class _Timer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t)


def _param_bytes(module: torch.nn.Module) -> int:
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _run(kind: str, steps: int) -> tuple[float, int]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(0)
    model = Llama(CFG)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (8 * 2 * steps, 65), generator=gen)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    if kind == "fourd":
        module: L.LightningModule = CausalLM(model, lr=1e-3)
        strategy: Any = FourDStrategy(tp=2)
    else:
        module = _HandSharded(model)
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    timer = _Timer()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])
    trainer.fit(module, loader)
    return statistics.median(timer.times[2:]), _param_bytes(module)


def _bench(rank: int, rounds: int, steps: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"fourd": [], "mps": []}
    mem: dict[str, int] = {}
    for _ in range(rounds):
        for kind in ("fourd", "mps"):
            t, b = _run(kind, steps)
            out[kind].append(t)
            mem[kind] = b
    full = sum(p.numel() * p.element_size() for p in Llama(CFG).parameters())
    return {"times": out, "mem": mem, "full": full}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    results = run_world(_bench, 4, args.rounds, args.steps, timeout_s=1800)
    r0 = results[0]
    fourd = statistics.median(r0["times"]["fourd"])
    mps = statistics.median(r0["times"]["mps"])
    print(f"step time  FourDStrategy(tp=2, dp=2): {fourd * 1e3:.1f} ms   ModelParallelStrategy: {mps * 1e3:.1f} ms")
    print(f"ratio FourD / ModelParallel = {fourd / mps:.3f}   (target <= 1.05, goal <= 1.00)")
    for kind in ("fourd", "mps"):
        per_rank = [r["mem"][kind] for r in results]
        print(f"parameter bytes per rank {kind}: {per_rank}  / unsharded {r0['full']} = "
              f"{max(per_rank) / r0['full']:.3f} (target ~ 1/(tp*dp) = 0.25)")


if __name__ == "__main__":
    main()
