"""``torch.compile`` internals: Dynamo's settings, its graph-break error and its counters.

Example:
    >>> from lightning_4d._compat.compile import graph_break_errors
    >>> all(issubclass(e, Exception) for e in graph_break_errors())
    True
"""

from __future__ import annotations

import torch

__all__ = ["compile_defaults", "compiled_graphs", "graph_break_errors", "reset_compiled"]


def graph_break_errors() -> tuple[type[Exception], ...]:
    """What Dynamo raises when ``fullgraph=True`` meets a graph break (private ``torch._dynamo.exc.Unsupported``;
    ``UserError`` for a branch on a tensor's value)."""
    from torch._dynamo import exc

    return (exc.Unsupported, exc.UserError)


def compiled_graphs() -> int:
    """Graphs Dynamo compiled in this process so far (private ``torch._dynamo.utils.counters``): a count that
    stays put once nothing recompiles."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def reset_compiled() -> None:
    """Forget every compiled graph and the counters (``torch._dynamo.reset`` is public; the counters are not)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def compile_defaults(keep_backward_buffers: bool = False) -> None:
    """TorchTitan's Dynamo settings for compiled blocks (private ``torch._dynamo.config``): data-dependent scalars
    (MoE token counts) stay in the graph instead of breaking it. ``keep_backward_buffers``: a compiled backward may
    run twice over one retained graph (the zero-bubble schedules' input- then weight-gradient passes), so it must not
    free its saved tensors as it goes (private ``torch._functorch.config.donated_buffer``, pytorch#161904)."""
    torch._dynamo.config.capture_scalar_outputs = True
    if keep_backward_buffers:
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
