"""``nn.Module`` and ``DataLoader`` internals, and meta-device materialisation.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2))
    >>> registered_submodule(net, "0") is net[0], registered_submodule(net, "1"), is_loss_module(nn.MSELoss())
    (True, None, True)
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.utils.data import DataLoader
    from transformers import PreTrainedModel

__all__ = ["InitCall", "MODULE_DICTS", "TENSOR_SLOTS", "callable_without_arguments", "release_freed_host_memory",
           "returnable_host_empty", "child_modules", "init_calls", "to_empty_keeping_ties", "is_loss_module",
           "own_tensors", "registered_submodule", "replace_batch_sampler", "swapped_parameters", "tensor_slots",
           "convert_shared_once"]


# ---------------------------------------------------------------------------------------------- nn.Module
#: The instance attributes holding ``nn.Module``'s own parameters and buffers (private dicts).
TENSOR_SLOTS = ("_parameters", "_buffers")
#: Every private dict of an ``nn.Module`` instance: its children, then :data:`TENSOR_SLOTS`.
MODULE_DICTS = ("_modules", *TENSOR_SLOTS)


def tensor_slots(module: nn.Module, parameters: bool = True) -> dict[str, Optional[torch.Tensor]]:
    """The live dict ``module`` keeps its own parameters (``parameters=True``) or buffers in (the private
    ``nn.Module._parameters`` / ``_buffers``): reading and writing it bypasses ``__getattr__`` / ``__setattr__``
    (what set-up's swaps and lazy materialisation need).

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> tensor_slots(lin)["weight"] is lin.weight, list(tensor_slots(nn.BatchNorm1d(2), parameters=False))[:2]
        (True, ['running_mean', 'running_var'])
    """
    return module._parameters if parameters else module._buffers


def own_tensors(module: nn.Module) -> list[tuple[str, Optional[torch.Tensor], bool]]:
    """``(name, tensor or None, is_parameter)`` of every parameter, then buffer, registered on ``module`` itself (not
    its children), slots set to ``None`` included (:func:`tensor_slots`).

    Example:
        >>> [(n, p) for n, _, p in own_tensors(nn.Linear(2, 2))]
        [('weight', True), ('bias', True)]
    """
    return ([(n, t, True) for n, t in module._parameters.items()]
            + [(n, t, False) for n, t in module._buffers.items()])


def child_modules(module: nn.Module) -> dict[str, nn.Module]:
    """``module``'s registered children by name, in registration order (the private ``nn.Module._modules``
    without ``None`` entries). Unlike ``named_children()``, a module registered under two names is listed
    under both."""
    return {name: child for name, child in module._modules.items() if child is not None}


def registered_submodule(root: nn.Module, path: str) -> Optional[nn.Module]:
    """The module registered at dotted ``path`` below ``root`` (``""``: ``root``), or ``None`` when a part is
    missing or set to ``None``. Walks the private ``nn.Module._modules``, so no other attribute (a
    property of a LightningModule, say) is evaluated — unlike ``get_submodule``."""
    mod: Optional[nn.Module] = root
    for part in path.split(".") if path else []:
        mod = getattr(mod, "_modules", {}).get(part) if mod is not None else None
    return mod


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, ``module.<name>`` is the given (plain, differentiable) tensor instead of its registered
    parameter, for every ``name`` of ``tensors``; the parameters are put back afterwards, even on error. Writes
    the private ``nn.Module._parameters`` (what ``torch.func.functional_call`` does internally) so the module's
    own forward can run on, say, the local shard of a DTensor parameter without calling ``module(...)`` again
    (which would re-run its hooks)."""
    saved = {name: module._parameters[name] for name in tensors}
    try:
        for name, tensor in tensors.items():
            module._parameters[name] = tensor  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(saved)


def is_loss_module(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's loss modules (private base ``torch.nn.modules.loss._Loss``;
    judged by the defining module where that is missing)."""
    from torch.nn.modules import loss

    base = getattr(loss, "_Loss", None)
    if base is not None:
        return isinstance(module, base)
    return type(module).__module__ == loss.__name__


def callable_without_arguments(fn: object) -> bool:
    """Whether ``fn`` is callable with no argument (an initialiser such as TorchTitan's ``init_weights(std)``,
    which needs one, is not called by the meta-device materialisation).

    Example:
        >>> callable_without_arguments(lambda x=1: x), callable_without_arguments(lambda x: x)
        (True, False)
    """
    if not callable(fn):
        return False
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device)`` that keeps tied parameters tied: a plain ``to_empty`` from the meta device
    replaces each parameter object module by module, so a weight shared by two modules would become two (and a
    model's own re-tying would then decide which initialisation survives). Under torch's
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` the objects are kept, their data swapped.

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(nn.Embedding(3, 2), nn.Linear(2, 3, bias=False))
        >>> net[1].weight = net[0].weight
        >>> to_empty_keeping_ties(net, torch.device("cpu")); net[1].weight is net[0].weight
        True
    """
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


# ---------------------------------------------------------------------------------------------- DataLoader
def replace_batch_sampler(dataloader: DataLoader, batch_sampler: Iterable[list]) -> None:
    """Swap ``dataloader.batch_sampler`` in place. ``DataLoader.__setattr__`` forbids it after
    construction, so this goes around the guard; it relies on the (internal) iterators reading
    ``batch_sampler`` when an iteration starts, as they do in torch 2.x."""
    object.__setattr__(dataloader, "batch_sampler", batch_sampler)


# ---------------------------------------------------------------------------------------------- initialisers
@dataclass
class InitCall:
    """One initialiser call of a model, in a single process's order (see :func:`init_calls`): ``fn()`` may write
    the tensors of ``module`` (its whole subtree when ``recurse``)."""

    fn: Callable[[], Any]
    module: nn.Module
    recurse: bool
    label: str


def _hf_pretrained_class() -> Optional[type]:
    import sys

    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - a broken install
        return None
    return PreTrainedModel


def _hf_init_calls(model: nn.Module, name: str) -> list[InitCall]:
    """A Hugging Face ``PreTrainedModel.init_weights()`` as the per-module calls it makes: transformers 5's
    ``initialize_weights`` is ``smart_apply(self._initialize_weights)`` — children first, each sub-model with its
    own ``_initialize_weights`` — inside ``transformers.initialization.guard_torch_init_functions()`` and
    ``no_grad``; ``_init_weights(module)`` initialises that module's own tensors. (Private transformers API,
    pinned by ``tests/unit/test_compat.py``; weights are tied by object identity already.)"""
    from transformers import PreTrainedModel
    from transformers import initialization as hf_init

    custom = model.is_custom_code()
    calls: list[InitCall] = []

    def guarded(owner: PreTrainedModel, module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), hf_init.guard_torch_init_functions():
                owner._initialize_weights(module, custom)
        return run

    def visit(module: nn.Module, owner: PreTrainedModel, path: str) -> None:
        for child_name, child in module.named_children():
            child_path = f"{path}.{child_name}" if path else child_name
            visit(child, child if isinstance(child, PreTrainedModel) else owner, child_path)
        calls.append(InitCall(guarded(owner, module), module, False, f"{type(owner).__name__}._init_weights({path or type(module).__name__})"))

    visit(model, model, name)
    return calls


def init_calls(root: nn.Module) -> list[InitCall]:
    """The initialisers of a model in a single process's order: every module's ``reset_parameters()``
    (module order, on its subtree), then every ``init_weights()`` (a Hugging Face model's expanded into its
    per-module ``_init_weights``, one module at a time).

    Example:
        >>> [c.label for c in init_calls(nn.Sequential(nn.Linear(1, 1)))]
        ['0.reset_parameters()']
    """
    hf = _hf_pretrained_class()
    calls: list[InitCall] = []
    for name, sub in root.named_modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable_without_arguments(reset):
            calls.append(InitCall(reset, sub, True, f"{name or type(sub).__name__}.reset_parameters()"))
    for name, sub in root.named_modules():
        init = getattr(sub, "init_weights", None)
        if not callable_without_arguments(init):
            continue
        if hf is not None and isinstance(sub, hf) and type(sub).init_weights is hf.init_weights:
            calls.extend(_hf_init_calls(sub, name))
        else:
            calls.append(InitCall(init, sub, True, f"{name or type(sub).__name__}.init_weights()"))
    return calls


_RETURNABLE_MIN_BYTES = 1 << 20  # below this, the heap's reuse is cheaper than a mapping of its own


def returnable_host_empty(shape: "tuple[int, ...] | torch.Size", dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory goes back to the operating system the moment it is freed: large
    ones get an anonymous memory mapping of their own (Python's ``mmap``, wrapped by ``torch.frombuffer``) instead
    of a block of the C heap, which glibc keeps resident after a free once its adaptive ``mmap`` threshold has
    grown (so a sequence of transient full tensors at set-up would leave the process's resident memory at their
    sum). Small ones (< 1 MiB) come from ``torch.empty``.

    Example:
        >>> t = returnable_host_empty((1024, 512), torch.float32)
        >>> t.shape, t.dtype
        (torch.Size([1024, 512]), torch.float32)
    """
    import math
    import mmap

    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < _RETURNABLE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)  # keeps the map alive


def release_freed_host_memory() -> bool:
    """Return the C heap's freed memory to the operating system (glibc's ``malloc_trim(0)``; a no-op returning
    ``False`` elsewhere). After set-up on the CPU, the freed full tensors of the initialisation would otherwise
    stay in the process's resident memory.

    Example:
        >>> isinstance(release_freed_host_memory(), bool)
        True
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def convert_shared_once(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], shared: Iterable[torch.Tensor],
                        recurse: bool = True) -> nn.Module:
    """``nn.Module._apply(fn)`` on ``module`` (private: what ``to``, ``to_empty``, ``double`` ... run), converting each tensor of ``shared`` (registered in several submodules) once: a plain ``_apply`` converts
    it once per owner, holding a copy per owner at the conversion's peak. The caller shares the results again.

    Example:
        >>> a, b = nn.Module(), nn.Module()
        >>> table = torch.zeros(2)
        >>> a.register_buffer("t", table); b.register_buffer("t", table)
        >>> root = nn.ModuleList([a, b])
        >>> _ = convert_shared_once(root, lambda t: t.double(), [table])
        >>> a.t is b.t, a.t.dtype
        (True, torch.float64)
    """
    ids = {id(t) for t in shared}
    memo: dict[int, torch.Tensor] = {}

    def once(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in ids:
            return fn(t)
        if id(t) not in memo:
            memo[id(t)] = fn(t)
        return memo[id(t)]

    return nn.Module._apply(module, once, recurse)
