"""From the unsharded model to this rank's part of the layout: derive the plan, check it on a reduced copy, apply
it (pipeline split, EP, TP/SP, activation checkpointing, data parallelism) in TorchTitan's order."""
