"""Lightning callbacks that measure what 4D parallelism does: communication per mesh axis, the pipeline
bubble, expert load and throughput / MFU — logged with ``pl_module.log`` (so the values reach
``trainer.callback_metrics`` with or without a logger), aggregated over ranks, with figures.

- :class:`CommunicationMonitor` — count, bytes and seconds of each collective kind per mesh axis.
- :class:`PipelineBubbleMonitor` — measured bubble per stage vs theory, Chrome trace and PNG timeline.
- :class:`ExpertLoadMonitor` — tokens per expert, imbalance, dropped tokens, aux loss, heatmap.
- :class:`FourDThroughputMonitor` — tokens/s, MFU, peak memory per rank.

Each is constructible without arguments and records every ``every_n_steps`` training batches (default:
the Trainer's ``log_every_n_steps``). Each does nothing when what it measures is absent: communication
without a process group of more than one rank, the bubble without pipeline parallelism, expert load
for a model without MoE layers; throughput works under any strategy. Values are identical on every
rank (one packed all-gather per recorded step, not one ``sync_dist`` reduction per key).

Example:
    >>> from lightning_4d.callbacks import CommunicationMonitor, ExpertLoadMonitor
    >>> callbacks = [CommunicationMonitor(), ExpertLoadMonitor()]
    >>> # not run: needs a Trainer
    >>> trainer = L.Trainer(strategy=FourDStrategy(tp=2, ep=2), callbacks=callbacks)  # doctest: +SKIP
"""

from lightning_4d.callbacks.communication import CommEvent, CommRecorder, CommunicationMonitor
from lightning_4d.callbacks.experts import ExpertLoadMonitor, load_stats, plot_expert_heatmap
from lightning_4d.callbacks.pipeline import (
    BubbleStats,
    PipelineBubbleMonitor,
    bubble_stats,
    chrome_trace,
    plot_timeline,
)
from lightning_4d.callbacks.summary import FourDModelSummary
from lightning_4d.callbacks.throughput import FourDThroughputMonitor, mfu, peak_memory_bytes

__all__ = [
    "BubbleStats",
    "CommEvent",
    "CommRecorder",
    "CommunicationMonitor",
    "ExpertLoadMonitor",
    "FourDModelSummary",
    "FourDThroughputMonitor",
    "PipelineBubbleMonitor",
    "bubble_stats",
    "chrome_trace",
    "load_stats",
    "mfu",
    "peak_memory_bytes",
    "plot_expert_heatmap",
    "plot_timeline",
]
