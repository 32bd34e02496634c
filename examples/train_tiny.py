"""A small data-parallel training run on CPU with FourDStrategy (replaced by the Hydra recipe later).

Run: python examples/train_tiny.py --devices 4
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from lightning_4d import FourDStrategy
from lightning_4d.data import SyntheticDataModule
from lightning_4d.models import CausalLM, Llama, LlamaConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64))
    data = SyntheticDataModule(vocab_size=256, seq_len=64, batch_size=8, kind="repeat")
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=FourDStrategy(tp=args.tp),
                        max_steps=args.steps, log_every_n_steps=5, enable_checkpointing=False)
    trainer.fit(CausalLM(model, lr=3e-3), datamodule=data)


if __name__ == "__main__":
    main()
