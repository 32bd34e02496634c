"""Context parallelism (``cp``): every sample's sequence split over ``cp`` ranks, attention across them exact.

- :mod:`.zigzag`: which tokens a rank holds (a head and a tail chunk of ``2·cp``), pure.
- :mod:`.sharding`: one batch cut for this rank (tokens, targets, global positions).
- :mod:`.attention`: the ``scaled_dot_product_attention`` calls of the model made global (K/V all-gather or
  Ulysses, the causal / per-document / sliding-window mask from global positions).
- :mod:`.windows`: each layer's sliding window, tracked while the layer runs.
- :mod:`.collectives`: the all-gather along the sequence (its backward a reduce-scatter).
- :mod:`.ulysses`: the other algorithm, q/k/v all-to-all heads ↔ sequence (DeepSpeed-Ulysses).
- :mod:`.algorithm`: which of the two runs a model (``cp_algorithm``: ``auto`` / ``allgather`` / ``ulysses``), pure.
- :mod:`.check`: the set-up refusal of attention that cannot be split (named module).

Example:
    >>> from lightning_4d.context_parallel import zigzag_indices
    >>> zigzag_indices(8, cp=2, rank=0).tolist()
    [0, 1, 6, 7]
"""

from lightning_4d.context_parallel.attention import (
    ContextParallelAttention, SequenceShard, UnsplittableAttention, causal_mask,
)
from lightning_4d.context_parallel.sharding import shard_batch, takes_positions
from lightning_4d.context_parallel.zigzag import (
    check_sequence_length, gathered_order, restore_order, zigzag_indices, zigzag_split,
)

__all__ = ["ContextParallelAttention", "SequenceShard", "UnsplittableAttention", "causal_mask",
           "check_sequence_length", "gathered_order", "restore_order", "shard_batch", "takes_positions",
           "zigzag_indices", "zigzag_split"]
