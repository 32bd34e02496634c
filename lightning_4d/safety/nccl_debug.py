"""NCCL's own post-mortem, on by default: its flight recorder keeps each rank's last collectives and dumps them when
the watchdog times out. The heartbeat (:mod:`lightning_4d.safety.heartbeat`) ends a run whose rank stopped; a
collective that desynchronised keeps every heartbeat alive, and then the dump says which collective each rank was
in (read it with ``python -m torch.distributed.flight_recorder.fr_trace <dump files>``).

Example:
    >>> env = {}
    >>> sorted(enable_flight_recorder(env))
    ['TORCH_NCCL_DUMP_ON_TIMEOUT', 'TORCH_NCCL_TRACE_BUFFER_SIZE']
    >>> enable_flight_recorder({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})  # the user's choice stays
    {'TORCH_NCCL_DUMP_ON_TIMEOUT': '1'}
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

__all__ = ["FLIGHT_RECORDER_ENV", "enable_flight_recorder"]

#: What is set where the environment does not say: the last 20000 collectives per rank (TorchTitan's default), dumped
#: at ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (torch's default: a file per rank in the temporary directory) on a watchdog
#: timeout.
FLIGHT_RECORDER_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def enable_flight_recorder(environ: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Set :data:`FLIGHT_RECORDER_ENV`'s variables that ``environ`` (default ``os.environ``) lacks; returns those
    set. NCCL reads them when a process group starts: call this before. Opt out with
    ``FourDStrategy(nccl_flight_recorder=False)``, or set the variables yourself (``TORCH_NCCL_TRACE_BUFFER_SIZE=0``
    turns the recorder off)."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in FLIGHT_RECORDER_ENV.items() if k not in environ}
    environ.update(added)
    return added
