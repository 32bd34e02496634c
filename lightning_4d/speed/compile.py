"""Per-block ``torch.compile``: the ``compile`` option's rules and its application.

``FourDStrategy(compile=True)`` compiles each of this rank's transformer blocks with ``torch.compile``, after
TP/SP, context and expert parallelism and activation checkpointing and before FSDP2 wraps them — TorchTitan's
order (``torchtitan.distributed.compile.apply_compile``): the repeated block is compiled once and reused, the
collectives of the data-parallel wrapper stay outside the graphs. A block is compiled with ``fullgraph=True``;
one whose first call meets a graph break (a Python side effect, a data-dependent branch) is compiled again without
it, on its own, with a warning naming it — the other blocks keep their full graphs. Every pipeline schedule runs
compiled, the split-backward ones (``zbv``, ``dualpipev``) included: their two backward passes over one graph need
the compiled backward to keep its saved buffers (pytorch#161904), which is arranged here. ``compile`` is ``True``
(Inductor), ``False`` or a backend name (``"aot_eager"``, ``"eager"``: cheap backends for tests). The choice is
recorded in the layout plan (``LayoutPlan.compile``). The set-up value check runs on the eager rewrite, before.

Example:
    >>> compile_backend(True), compile_backend("aot_eager"), compile_backend(False)
    ('inductor', 'aot_eager', None)
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from lightning_4d._compat.compile import compile_defaults, graph_break_errors

__all__ = ["SPLIT_BACKWARD_SCHEDULES", "apply_compile", "check_compile", "compile_backend", "compiled_mode"]

log = logging.getLogger(__name__)

#: Schedules that run each block's backward in two passes (input gradients, then weight gradients, from one
#: retained graph): a compiled block's backward must then keep its saved tensors (no donated buffers,
#: pytorch#161904), which :func:`apply_compile` arranges.
SPLIT_BACKWARD_SCHEDULES = ("zbv", "dualpipev")


def compile_backend(value: Union[bool, str, None]) -> Optional[str]:
    """The ``torch.compile`` backend ``compile=value`` asks for (``None``: run eagerly); a bad value raises naming
    it, the rule and the fix.

    Example:
        >>> compile_backend("no-such-backend")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: compile='no-such-backend' is not a torch.compile backend ...
    """
    if value is None or value is False:
        return None
    if value is True:
        return "inductor"
    if isinstance(value, str):
        known = torch.compiler.list_backends(exclude_tags=())
        if value in known:
            return value
        raise ValueError(f"compile={value!r} is not a torch.compile backend of this torch (known: "
                         f"{', '.join(sorted(known))}). Use True (Inductor), False, or one of those names.")
    raise ValueError(f"compile={value!r} must be True (Inductor), False, or a torch.compile backend name such as "
                     f"'aot_eager'.")


def check_compile(value: Union[bool, str, None], schedule: str, pp: int, tp: int = 1) -> Optional[str]:
    """The backend of ``compile=value`` for this run (``None``: eager). Every schedule runs compiled: under the
    split-backward ones (``zbv``, ``dualpipev``) the compiled backward keeps its buffers (see
    :data:`SPLIT_BACKWARD_SCHEDULES`). Refused: Inductor with ``tp > 1`` (torch 2.13's Inductor cannot lower the
    device-mesh ops the tensor-parallel styles leave in a block's graph: ``device_mesh._get_submesh is not an
    OpOverload``); ``aot_eager`` compiles those blocks. Pure.

    Example:
        >>> check_compile("eager", "zbv", pp=2)
        'eager'
        >>> check_compile(True, "1f1b", pp=1, tp=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: compile=True (Inductor) with tp=2: ...
    """
    backend = compile_backend(value)
    if backend == "inductor" and tp > 1:
        raise ValueError(
            f"compile={value!r} (Inductor) with tp={tp}: torch's Inductor cannot lower the device-mesh ops that "
            f"tensor parallelism leaves in each block's graph (device_mesh._get_submesh is not an OpOverload). Use "
            f"compile='aot_eager' with tp > 1 (the graphs, without Inductor's kernels), or tp=1 with Inductor.")
    return backend


def compiled_mode(module: nn.Module) -> Optional[str]:
    """How ``module`` was compiled here: ``"fullgraph"``, ``"graph breaks"`` (recompiled without fullgraph after
    its first call broke the graph), ``"pending"`` (not called yet) or ``None`` (not compiled).

    Example:
        >>> compiled_mode(nn.Linear(2, 2)) is None
        True
    """
    return getattr(module, "fourd_compiled", None)


def apply_compile(blocks: Iterable[nn.Module], backend: str, split_backward: bool = False, **options: Any) -> int:
    """Compile each block's ``forward`` in place (activation checkpointing's wrapper included; its hooks — the
    sequence-parallel boundary, FSDP2's gathers — stay eager; parameter names and the module tree do not change), ``fullgraph`` first and per block without it after a graph break; returns how
    many blocks were compiled. ``split_backward``: the pipeline schedule runs each backward in two passes
    (:data:`SPLIT_BACKWARD_SCHEDULES`); ``options``: more ``torch.compile`` keywords (``mode``, ``dynamic``).

    Example:
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         return self.w(x).relu()
        >>> block = Block()
        >>> apply_compile([block], "eager"), compiled_mode(block)
        (1, 'pending')
        >>> _ = block(torch.ones(2, 4)); compiled_mode(block)
        'fullgraph'
    """
    compile_defaults(keep_backward_buffers=split_backward)
    count = 0
    for block in blocks:
        _compile_one(block, backend, options)
        count += 1
    return count


def _compile_one(block: nn.Module, backend: str, options: dict[str, Any]) -> None:
    impl = block.forward  # activation checkpointing's wrapper included; the hooks stay eager
    full = torch.compile(impl, backend=backend, fullgraph=True, **options)
    state: dict[str, Any] = {"loose": None}
    block.fourd_compiled = "pending"  # type: ignore[assignment]

    def call(*args: Any, **kwargs: Any) -> Any:
        loose = state["loose"]
        if loose is None:
            try:
                out = full(*args, **kwargs)
                if block.fourd_compiled == "pending":
                    block.fourd_compiled = "fullgraph"  # type: ignore[assignment]
                return out
            except graph_break_errors() as err:  # traced before anything ran: nothing to undo
                log.warning("lightning_4d: %s does not compile to one graph (%s); compiled with graph breaks "
                            "instead", type(block).__name__, str(err).splitlines()[0])
                loose = state["loose"] = torch.compile(impl, backend=backend, **options)
                block.fourd_compiled = "graph breaks"  # type: ignore[assignment]
        return loose(*args, **kwargs)

    block.forward = call  # type: ignore[method-assign]
