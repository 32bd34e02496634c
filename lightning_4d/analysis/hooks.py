"""The hooks a model may define to steer the rewrite, declared once.

Every hook is optional: the automatic paths (block discovery, the traced tensor-parallel plan, the staged
pipeline) need none. A hook is a method (or, for the two data hooks, an attribute) of the module handed to the
strategy — the ``LightningModule``, or for ``fourd_weight_source`` any submodule — found by the name below. Each
has a ``typing.Protocol`` with its exact signature; the rewrite looks every hook up through :func:`user_hook`
and names it in its error messages through :func:`hook_call`, so a hook's name and signature are written here
only.

=============================  ==========================================================================
hook                           what it tells the rewrite
=============================  ==========================================================================
``fourd_blocks_path(self)``    the dotted path of the repeated blocks container (``"model.layers"``)
``fourd_tp_plan(self, ...)``   an explicit tensor-parallel plan ``{module path: ParallelStyle}``
``fourd_loss_parallel``        (attribute) the plan leaves the output vocab-sharded: loss-parallel loss
``configure_pipeline_split``   the pipeline split: a blocks path, or a ``PipelineSplit`` naming pre/post modules
``pipeline_pre_blocks``        what runs before the blocks (first stage): ``inputs -> hidden``
``pipeline_post_blocks``       what runs after the blocks (last stage): ``hidden -> outputs``
``fourd_weight_source``        (attribute) where a meta-built module's weights come from: ``names()``, ``get()``, ``get_rows()``
=============================  ==========================================================================

Example:
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def fourd_blocks_path(self) -> str:
    ...         return "layers"
    >>> user_hook(Net(), BLOCKS_PATH)(), user_hook(Net(), TP_PLAN) is None
    ('layers', True)
    >>> isinstance(Net(), BlocksPathHook), hook_call(TP_PLAN)
    (True, '`fourd_tp_plan(self, tp_mesh, sequence_parallel)`')
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "BLOCKS_PATH", "LOSS_PARALLEL", "PIPELINE_HOOKS", "PIPELINE_POST", "PIPELINE_PRE", "PIPELINE_SPLIT", "TP_PLAN",
    "WEIGHT_SOURCE", "BlocksPathHook", "LossParallelHook", "PipelinePostHook", "PipelinePreHook", "PipelineSplit",
    "PipelineSplitHook", "TPPlanHook", "WeightSource", "WeightSourceHook", "hook_call", "user_hook",
    "weight_source",
]

BLOCKS_PATH = "fourd_blocks_path"
TP_PLAN = "fourd_tp_plan"
LOSS_PARALLEL = "fourd_loss_parallel"
PIPELINE_SPLIT = "configure_pipeline_split"
PIPELINE_PRE = "pipeline_pre_blocks"
PIPELINE_POST = "pipeline_post_blocks"
WEIGHT_SOURCE = "fourd_weight_source"
PIPELINE_HOOKS = (PIPELINE_SPLIT, PIPELINE_PRE, PIPELINE_POST)  # any of them: the explicit pre → blocks → post


@dataclass(frozen=True)
class PipelineSplit:
    """Where a model splits: the blocks container and the modules before / after it (dotted paths); what
    :class:`PipelineSplitHook` may return.

    Example:
        >>> PipelineSplit("layers", ("0", "1"), pre=("tok_embeddings",), post=("norm", "output")).num_blocks
        2
    """

    blocks_path: str
    block_keys: tuple[str, ...]
    pre: tuple[str, ...] = ()
    post: tuple[str, ...] = ()

    @property
    def num_blocks(self) -> int:
        """Number of repeated blocks."""
        return len(self.block_keys)


@runtime_checkable
class BlocksPathHook(Protocol):
    """Names the repeated blocks container (else the largest list of same-type children is taken)."""

    def fourd_blocks_path(self) -> str: ...


@runtime_checkable
class TPPlanHook(Protocol):
    """An explicit tensor-parallel plan fragment, ``{module path: ParallelStyle}``: it becomes the layout plan's
    styles (:class:`lightning_4d.tensor_parallel.specs.StyleSpec`). ``tp_mesh`` is the ``tp`` sub-mesh, or ``None``
    when the plan is derived without a process group (``recipes/plan.py``, ``plan_layout`` alone)."""

    def fourd_tp_plan(self, tp_mesh: Optional[DeviceMesh], sequence_parallel: bool) -> Mapping[str, ParallelStyle]: ...


@runtime_checkable
class LossParallelHook(Protocol):
    """With :class:`TPPlanHook`: ``True`` when the plan leaves the logits sharded over the vocabulary."""

    fourd_loss_parallel: bool


@runtime_checkable
class PipelineSplitHook(Protocol):
    """The pipeline split: a blocks path (pre / post modules found around it) or a full ``PipelineSplit``."""

    def configure_pipeline_split(self) -> Union[str, PipelineSplit]: ...


@runtime_checkable
class PipelinePreHook(Protocol):
    """What runs before the blocks, on the first stage: the model inputs to the first block's input."""

    def pipeline_pre_blocks(self, inputs: Any) -> Any: ...


@runtime_checkable
class PipelinePostHook(Protocol):
    """What runs after the blocks, on the last stage: the last block's output to the model's output."""

    def pipeline_post_blocks(self, h: Any) -> Any: ...


@runtime_checkable
class WeightSource(Protocol):
    """Pretrained weights streamed into the local shards. A module of the model that has an attribute
    ``fourd_weight_source`` holding one (e.g. :meth:`lightning_4d.models.HFLogits.from_pretrained` built on the
    meta device) gets its tensors from it instead of its initialisers; ``names()`` are the tensor names relative
    to that module (``module.named_parameters()`` / ``named_buffers()`` names). A source may also define
    ``get_rows(name, start, stop)`` (rows ``[start, stop)`` of dim 0, e.g. experts of a stacked tensor): a rank
    then reads only the rows holding its elements (:mod:`lightning_4d.materialize.load_sources`; an optional ``release()`` is
    called after each tensor's pieces); with ``get`` alone it reads each tensor it holds a part of whole, one at a
    time.

    Example:
        >>> import torch
        >>> class Zeros:
        ...     def names(self): return ["weight"]
        ...     def get(self, name): return torch.zeros(2, 2)
        >>> isinstance(Zeros(), WeightSource)
        True
    """

    def names(self) -> Iterable[str]:
        """The tensor names this source provides."""
        ...

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` in the module's own layout (read now; the caller frees it)."""
        ...


@runtime_checkable
class WeightSourceHook(Protocol):
    """A module whose values are read from :class:`WeightSource` instead of its initialisers."""

    fourd_weight_source: WeightSource


_PROTOCOLS: dict[str, type] = {
    BLOCKS_PATH: BlocksPathHook, TP_PLAN: TPPlanHook, LOSS_PARALLEL: LossParallelHook,
    PIPELINE_SPLIT: PipelineSplitHook, PIPELINE_PRE: PipelinePreHook, PIPELINE_POST: PipelinePostHook,
    WEIGHT_SOURCE: WeightSourceHook,
}


def user_hook(module: object, name: str) -> Optional[Callable[..., Any]]:
    """The model's hook method ``name`` (one of the names above), bound, or ``None`` when it does not define it.

    Example:
        >>> user_hook(object(), PIPELINE_PRE) is None
        True
    """
    if name not in _PROTOCOLS or name in (LOSS_PARALLEL, WEIGHT_SOURCE):
        raise KeyError(f"{name!r} is not a hook method of lightning_4d.analysis.hooks: {sorted(_PROTOCOLS)}")
    fn = getattr(module, name, None)
    return fn if callable(fn) else None


def weight_source(module: object) -> Optional[WeightSource]:
    """``module.fourd_weight_source``, or ``None`` when it has none.

    Example:
        >>> weight_source(object()) is None
        True
    """
    return getattr(module, WEIGHT_SOURCE, None)


def hook_call(name: str) -> str:
    """The hook as error messages name it: ```name(self, args)``` for a method, ```self.name``` for an attribute.

    Example:
        >>> hook_call(PIPELINE_POST), hook_call(LOSS_PARALLEL)
        ('`pipeline_post_blocks(self, h)`', '`self.fourd_loss_parallel`')
    """
    member = getattr(_PROTOCOLS[name], name, None)
    if not callable(member):
        return f"`self.{name}`"
    return f"`{name}({', '.join(inspect.signature(member).parameters)})`"
