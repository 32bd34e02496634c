"""Layout-independent initial values, drawn piece by piece: the bounded scratch a rank holds while it does.

A meta-built model's initial values are a function of the seed and the parameter's name, never of the layout:
every element's random draw comes from a counter-based generator keyed by ``(seed, tensor name, draw number)`` and
addressed by the element's position in the unsharded tensor (:mod:`lightning_4d.materialize`). A rank computes its
own elements only, in chunks of at most :data:`CHUNK_ELEMENTS`; what it holds beyond its share while doing so is
:func:`scratch_bytes`, the one owner of that number (the planner's set-up term imports it).

Example:
    >>> scratch_bytes() == CHUNK_ELEMENTS * SCRATCH_BYTES_PER_ELEMENT
    True
"""

from __future__ import annotations

__all__ = ["CHUNK_ELEMENTS", "SCRATCH_BYTES_PER_ELEMENT", "scratch_bytes"]

CHUNK_ELEMENTS = 1 << 20  # elements of a rank's shard computed at once
# Per element of a chunk: its int64 position, the 64-bit counter hash and two temporaries, two float64 values.
SCRATCH_BYTES_PER_ELEMENT = 8 * 6


def scratch_bytes() -> int:
    """Bytes one rank holds beyond its share while it initialises its shards (one chunk's working set).

    Example:
        >>> scratch_bytes() < 256 << 20
        True
    """
    return CHUNK_ELEMENTS * SCRATCH_BYTES_PER_ELEMENT
