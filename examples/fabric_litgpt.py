"""Pretrain LitGPT's Llama in a Lightning Fabric loop shaped like LitGPT's own (``litgpt/pretrain.py``), with 4D
parallelism from ``lightning_4d.fabric.FourDStrategy``. A tiny configuration and synthetic tokens: nothing is
downloaded; runs on CPU.

Under tp / dp (and ep) the loop is LitGPT's, unchanged: ``model(x)``, ``chunked_cross_entropy``, ``fabric.backward``.
Under pp (and cp) the forward and backward run inside the pipeline schedule, so the step is
``fabric.strategy.train_step(model, batch, loss_fn)``; ``--train-step`` uses it under every layout. See
docs/fabric.md.

Run (4 processes, Fabric launches them):
    python examples/fabric_litgpt.py --devices 4 --pp 2
    python examples/fabric_litgpt.py --devices 4 --pp 2 --steps 10 --save out/ckpt
    python examples/fabric_litgpt.py --devices 4 --steps 10 --resume out/ckpt   # another layout: dp=4
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from litgpt import GPT, Config
from litgpt.utils import chunked_cross_entropy
from torch.utils.data import DataLoader, TensorDataset

from lightning_4d.fabric import FourDStrategy


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (under tp it runs on vocabulary-sharded logits, inside ``loss_parallel``)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_tokens(samples: int, seq: int, vocab: int) -> TensorDataset:
    """Sequences counting up from a random start (mod ``vocab``): learnable, so the loss falls."""
    starts = torch.randint(0, vocab, (samples, 1), generator=torch.Generator().manual_seed(0))
    tokens = (starts + torch.arange(seq + 1)) % vocab  # (N, T + 1)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def fit(fabric: L.Fabric, state: dict[str, Any], loader: DataLoader, args: argparse.Namespace) -> None:
    model, optimizer = state["model"], state["optimizer"]
    dims = fabric.strategy.dims
    step_function = args.train_step or dims.pp > 1 or dims.cp > 1
    while state["step_count"] < args.steps:
        for input_ids, targets in loader:
            state["iter_num"] += 1
            is_accumulating = state["iter_num"] % args.accumulate != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                if step_function:  # forward, loss and backward; the global-batch loss, equal on every rank
                    loss = fabric.strategy.train_step(model, (input_ids, targets), loss_fn, accumulate=args.accumulate)
                else:  # LitGPT's own lines: model(x) returns the full logits on every rank
                    logits = model(input_ids)
                    loss = chunked_cross_entropy(logits, targets)
                    fabric.backward(loss / args.accumulate)
                    loss = fabric.all_reduce(loss.detach())  # this rank's batch -> the data-parallel mean
            if is_accumulating:
                continue
            norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the global norm over every shard
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
            fabric.print(f"step {state['step_count']}: loss {loss.item():.4f}, grad norm {norm.item():.3f}")
            if state["step_count"] >= args.steps:
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="samples per data-parallel rank")
    parser.add_argument("--train-step", action="store_true", help="use strategy.train_step under every layout")
    parser.add_argument("--save", help="checkpoint directory written at the end (sharded, layout-independent)")
    parser.add_argument("--resume", help="checkpoint directory to resume from (saved under any layout)")
    args = parser.parse_args()

    strategy = FourDStrategy(tp=args.tp, pp=args.pp)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)  # the same initial weights on every rank
    config = Config(name="tiny-llama", block_size=64, vocab_size=256, padded_vocab_size=256, n_layer=4, n_head=4,
                    n_embd=64, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                    norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=128)
    with fabric.init_module():
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)  # plan -> check on a reduced copy -> rewrite -> shards
    fabric.print(strategy.layout_plan.summary())

    data = synthetic_tokens(1024, config.block_size, config.vocab_size)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.micro_batch_size, shuffle=True))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    if args.resume:
        fabric.load(args.resume, state)
        fabric.print(f"resumed from {args.resume} at step {state['step_count']}")
    fit(fabric, state, loader, args)
    if args.save:
        fabric.save(args.save, state)

    with torch.no_grad():  # validation, as LitGPT's: full logits on every rank (under pp: the schedule's forward)
        input_ids, targets = data.tensors[0][:8], data.tensors[1][:8]
        fabric.print(f"validation loss {chunked_cross_entropy(model(input_ids), targets).item():.4f}")


if __name__ == "__main__":
    main()
