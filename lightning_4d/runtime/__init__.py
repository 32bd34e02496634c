"""The training step: sequence shards, the pipeline or plain step, the once-per-step gradient reductions."""
