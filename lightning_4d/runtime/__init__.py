"""The training step: sequence shards, the pipeline or plain step, the once-per-step gradient reductions; the
processes' mesh, the set-up model called as the user's own, and the Lightning Fabric strategy over them."""
