"""Host-memory probes of this process (Linux ``/proc``; ``ru_maxrss`` otherwise): what the set-up simulation and
the memory benchmarks measure.

Example:
    >>> rss() > 0 and kernel_peak() >= rss() // 2
    True
"""

from __future__ import annotations

import resource

__all__ = ["clear_peak", "kernel_peak", "rss", "status_kb"]


def status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``, ``RssAnon`` ...).

    Example:
        >>> status_kb("VmRSS") > 0
        True
    """
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss() -> int:
    """Resident bytes now.

    Example:
        >>> rss() > 1 << 20
        True
    """
    return status_kb("VmRSS") * 1024


def kernel_peak() -> int:
    """Peak resident bytes since the kernel's counter was last reset (``VmHWM``; ``ru_maxrss``, which cannot be
    reset, as a fallback).

    Example:
        >>> kernel_peak() > 0
        True
    """
    try:
        return status_kb("VmHWM") * 1024
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def clear_peak() -> bool:
    """Reset the kernel's peak RSS of this process to its current RSS (Linux >= 4.0); ``False`` if not allowed.

    Example:
        >>> isinstance(clear_peak(), bool)
        True
    """
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False
