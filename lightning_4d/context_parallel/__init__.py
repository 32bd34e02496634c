"""Context parallelism (``cp``): every sample's sequence split over ``cp`` ranks, attention across them exact.

- :mod:`.zigzag`: which tokens a rank holds (a head and a tail chunk of ``2·cp``), pure.
- :mod:`.sharding`: one batch cut for this rank (tokens, targets, global positions).
- :mod:`.shard`: this rank's share of a batch's sequence (what attention needs to stay exact).
- :mod:`.attention`: the ``scaled_dot_product_attention`` calls of the model made global (K/V all-gather, Ulysses
  or ring), each under its own mask recomputed from global indices.
- :mod:`.masks`: the mask kinds (causal, sliding window, causal chunks, bidirectional; per packed document) and the
  pieces one attention runs in, pure.
- :mod:`.blockwise`: attention in those pieces merged by log-sum-exp (no ``(T/cp × T)`` mask).
- :mod:`.layer_masks`: each attention call's mask, as the set-up check read it, found again while the model trains.
- :mod:`.lengths`: the windows, chunks and top-k a model declares, shrunk for the set-up check.
- :mod:`.probe`: each call's mask read from a whole-sequence run.
- :mod:`.collectives`: the all-gather along the sequence (its backward a reduce-scatter).
- :mod:`.ulysses`: q/k/v all-to-all heads ↔ sequence (DeepSpeed-Ulysses).
- :mod:`.ring`: K/V passed around the cp ranks, the next chunk's transfer overlapping the current chunk's attention.
- :mod:`.algorithm`: which algorithm runs a model (``cp_algorithm``), pure.
- :mod:`.cost`: bytes on the wire and activation memory per algorithm, closed form.
- :mod:`.check`: the set-up refusal of attention that cannot be split (named module) and the reading of the masks.
- :mod:`.refusals`: the refusals that name a family's fix, and the fallback for masks that cannot be read.
- :mod:`.local_masks`: for masks not read at set-up, each call's local mask checked on the device, once a step.
- :mod:`.gathered`: the K/V all-gather attention (one gathered buffer, attended chunk by chunk).

Example:
    >>> from lightning_4d.context_parallel import zigzag_indices
    >>> zigzag_indices(8, cp=2, rank=0).tolist()
    [0, 1, 6, 7]
"""

from lightning_4d.context_parallel.attention import ContextParallelAttention
from lightning_4d.context_parallel.shard import SequenceShard, UnsplittableAttention
from lightning_4d.context_parallel.masks import MaskSpec
from lightning_4d.context_parallel.sharding import shard_batch, takes_positions
from lightning_4d.context_parallel.zigzag import (
    check_sequence_length, gathered_order, restore_order, zigzag_indices, zigzag_ranges, zigzag_split,
)

__all__ = ["ContextParallelAttention", "MaskSpec", "SequenceShard", "UnsplittableAttention", "check_sequence_length",
           "gathered_order", "restore_order", "shard_batch", "takes_positions", "zigzag_indices", "zigzag_ranges",
           "zigzag_split"]
