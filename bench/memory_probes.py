"""Host-memory probes of one process, shared by the memory benchmarks: :mod:`lightning_4d.materialize.host_memory`'s.

Example:
    >>> rss() > 0 and kernel_peak() >= rss() // 2
    True
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_4d.materialize.host_memory import clear_peak, kernel_peak, rss, status_kb  # noqa: E402

__all__ = ["clear_peak", "kernel_peak", "rss", "status_kb"]
