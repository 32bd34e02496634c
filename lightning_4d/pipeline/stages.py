"""Cut an ordinary model into pipeline stages, keeping the original parameter names.

The model's repeated blocks live in one container (an ``nn.ModuleList`` / ``nn.ModuleDict``): by
default the one of identical-type children that holds the most parameters. Modules registered
before that container (in it parent, and in each ancestor up to the root) run on the first stage
(e.g. the token embedding); modules registered after it run on the last stage (final norm, head).

:func:`build_pipeline_stages` prunes the model **in place** (or a deep copy with ``copy=True``):
the blocks container becomes an ``nn.ModuleDict`` keyed by the original indices holding only this
rank's blocks, and absent pre/post modules are set to ``None``. So ``model.named_parameters()``
on every rank lists exactly its own parameters under their single-process names
(``layers.3.attention.wq.weight``), and optimizers / checkpoints stay layout-independent.

Each local stage gets a :class:`StageModule` — what ``PipelineStage(submod=...)`` runs and whose
``parameters()`` it uses for gradient handling. It *shares* (does not copy) the pruned model's
modules and registers them under the same paths, so its parameter names equal the model's too.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = nn.Embedding(10, 4)
    ...         self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
    ...         self.head = nn.Linear(4, 10)
    ...     def forward(self, x):
    ...         h = self.emb(x)
    ...         for layer in self.layers:
    ...             h = layer(h)
    ...         return self.head(h)
    >>> net = Net()
    >>> parts = build_pipeline_stages(net, pp_rank=1, pp=2)
    >>> sorted(name for name, _ in net.named_parameters())[:2]
    ['head.bias', 'head.weight']
    >>> [n for n, _ in parts.modules[0].named_parameters()][:2]
    ['layers.2.weight', 'layers.2.bias']
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch  # noqa: F401  (the doctests use it)
from torch import nn

from lightning_4d._compat import child_modules, is_loss_module, registered_submodule
from lightning_4d.hooks import PIPELINE_POST, PIPELINE_PRE, PIPELINE_SPLIT, hook_call
from lightning_4d.pipeline.partition import PipelineSplit, StageStyle, partition_blocks, stage_ids_for_rank
from lightning_4d.pipeline.tied import find_tied_parameters

__all__ = ["PipelineSplit", "StageModule", "PipelineParts", "find_pipeline_split", "build_pipeline_stages", "HOOK_HINT"]

HOOK_HINT = (
    f"implement {hook_call(PIPELINE_PRE)} (what runs before the blocks, on the first stage) and/or "
    f"{hook_call(PIPELINE_POST)} (what runs after them, on the last stage) on the LightningModule (or pass "
    f"pre_fn / post_fn), or {hook_call(PIPELINE_SPLIT)} to name the blocks container and the modules "
    f"before/after it"
)


def _set(root: nn.Module, path: str, value: Optional[nn.Module]) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = registered_submodule(root, parent_path)
    assert parent is not None
    setattr(parent, name, value)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_pipeline_split(root: nn.Module, blocks_path: Optional[str] = None) -> PipelineSplit:
    """Locate the blocks container and the modules before/after it.

    Args:
        root: the model (a LightningModule or plain ``nn.Module``).
        blocks_path: dotted path of the container (e.g. ``"model.layers"``); found automatically if ``None``
            as the ``ModuleList``/``ModuleDict`` of same-type children with the most parameters.

    Pre/post modules are the siblings registered before/after the path to the container, at every
    level from the root down (outer pre-modules run first, outer post-modules last). Loss modules
    (torch's loss classes) are never included, and parameter-free modules only in the
    container's direct parent (so a LightningModule's metrics or criterion stay out of the chain).

    Raises:
        ValueError: naming the model class when no container is found, or when a parameter sits
            directly on an ancestor of the container (its stage would be ambiguous).

    Example:
        >>> net = nn.Sequential()
        >>> net.add_module("emb", nn.Linear(2, 2)); net.add_module("blocks", nn.ModuleList([nn.Linear(2, 2)]))
        >>> find_pipeline_split(net)
        PipelineSplit(blocks_path='blocks', block_keys=('0',), pre=('emb',), post=())
    """
    cls = type(root).__name__
    if blocks_path is None:
        from lightning_4d.discovery import find_blocks

        try:
            blocks_path = find_blocks(root)[0]
        except ValueError as err:
            raise ValueError(
                f"{cls}: no container of repeated blocks (an nn.ModuleList / nn.ModuleDict of identical modules "
                f"holding parameters) was found to split into pipeline stages. Pass blocks_path, or implement "
                f"{hook_call(PIPELINE_SPLIT)} on the LightningModule."
            ) from err
    container = registered_submodule(root, blocks_path)
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(f"{cls}: blocks_path={blocks_path!r} is not an nn.ModuleList / nn.ModuleDict in the model.")
    pre_levels: list[list[str]] = []
    post_levels: list[list[str]] = []
    parts = blocks_path.split(".")
    parent: nn.Module = root
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        children = child_modules(parent)
        direct_parent = depth == len(parts) - 1
        # Loss modules never belong to the chain; above the container's own parent, parameter-free
        # modules (metrics, criteria on a LightningModule) are skipped too.
        names = [n for n, m in children.items() if n == part or (
            not is_loss_module(m) and (direct_parent or _num_params(m) > 0))]
        idx = names.index(part)
        own = [n for n, _ in parent.named_parameters(recurse=False, remove_duplicate=False)]
        if own:
            raise ValueError(
                f"{cls}: parameter(s) {[f'{prefix}.{n}'.lstrip('.') for n in own]} sit directly on an ancestor of the "
                f"blocks container {blocks_path!r}, so no pipeline stage owns them. Move them into a submodule, or "
                f"implement {hook_call(PIPELINE_SPLIT)}."
            )
        pre_levels.append([f"{prefix}.{n}".lstrip(".") for n in names[:idx]])
        post_levels.append([f"{prefix}.{n}".lstrip(".") for n in names[idx + 1:]])
        parent = children[part]
    pre = tuple(p for level in pre_levels for p in level)
    post = tuple(p for level in reversed(post_levels) for p in level)
    keys = tuple(child_modules(container))
    return PipelineSplit(blocks_path, keys, pre, post)


class StageModule(nn.Module):
    """One pipeline stage: pre-modules (first stage), this stage's blocks, post-modules (last stage).

    The modules are shared with the model and registered under their original paths, so
    ``named_parameters()`` yields the single-process names. ``forward`` on the first stage takes the
    model inputs; later stages take the previous stage's output.

    Args:
        root: the (pruned or full) model holding the modules.
        split: where the model splits.
        stage_index / num_stages: this stage and the pipeline length.
        block_keys: keys (original indices) of this stage's blocks, in order.
        pre_fn: ``pre_fn(*inputs) -> h`` replacing the chained pre-modules (first stage).
        post_fn: ``post_fn(h) -> output`` replacing the chained post-modules (last stage).

    Example:
        >>> net = nn.Sequential(); net.add_module("layers", nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> split = find_pipeline_split(net)
        >>> StageModule(net, split, 0, 1, ["0", "1"])(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """

    def __init__(
        self,
        root: nn.Module,
        split: PipelineSplit,
        stage_index: int,
        num_stages: int,
        block_keys: Sequence[str],
        pre_fn: Optional[Callable[..., Any]] = None,
        post_fn: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.blocks_path = split.blocks_path
        self.block_keys = list(block_keys)
        self.pre_paths = list(split.pre) if stage_index == 0 else []
        self.post_paths = list(split.post) if stage_index == num_stages - 1 else []
        self.pre_fn = pre_fn
        self.post_fn = post_fn
        container = registered_submodule(root, split.blocks_path)
        if container is None:
            raise ValueError(f"the model has no blocks container at {split.blocks_path!r}")
        blocks = nn.ModuleDict()
        for key in self.block_keys:
            block = child_modules(container).get(key)
            if block is None:
                raise ValueError(f"block {split.blocks_path}.{key} is not on this rank (pruned away?)")
            blocks[key] = block
        for path in self.pre_paths:
            if (mod := registered_submodule(root, path)) is not None:
                self._mount(path, mod)
        self._mount(split.blocks_path, blocks)
        for path in self.post_paths:
            if (mod := registered_submodule(root, path)) is not None:
                self._mount(path, mod)

    def _mount(self, path: str, module: nn.Module) -> None:
        node: nn.Module = self
        *parents, leaf = path.split(".")
        for part in parents:
            if registered_submodule(node, part) is None:
                node.add_module(part, nn.Module())
            node = child_modules(node)[part]
        node.add_module(leaf, module)

    @property
    def is_first(self) -> bool:
        """Whether this is stage 0 (runs the pre-modules)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this is the last stage (runs the post-modules)."""
        return self.stage_index == self.num_stages - 1

    def _module(self, path: str) -> Optional[nn.Module]:
        return registered_submodule(self, path)

    def forward(self, *args: Any) -> Any:
        if self.is_first:
            if self.pre_fn is not None:
                h = self.pre_fn(*args)  # e.g. (B, T) token ids -> (B, T, D)
            else:
                h = args if len(args) != 1 else args[0]
                for path in self.pre_paths:
                    mod = self._module(path)
                    if mod is not None:
                        h = mod(*h) if isinstance(h, tuple) else mod(h)
        else:
            h = args if len(args) != 1 else args[0]  # (B, T, D) activations from the previous stage
        blocks = self._module(self.blocks_path)
        assert blocks is not None
        for key in self.block_keys:
            block = blocks[key]
            h = block(*h) if isinstance(h, tuple) else block(h)  # (B, T, D)
        if self.is_last:
            if self.post_fn is not None:
                h = self.post_fn(h)
            else:
                for path in self.post_paths:
                    mod = self._module(path)
                    if mod is not None:
                        h = mod(*h) if isinstance(h, tuple) else mod(h)  # e.g. (B, T, V) logits
        return h

    def extra_repr(self) -> str:
        return f"stage={self.stage_index}/{self.num_stages}, blocks={self.block_keys}"


@dataclass
class PipelineParts:
    """This rank's share of a pipelined model (see :func:`build_pipeline_stages`).

    Attributes:
        model: the pruned model (exactly this rank's parameters, original names).
        modules: one :class:`StageModule` per local stage, ascending stage index.
        stage_ids: global indices of the local stages.
        num_stages: pipeline length ``pp · virtual_stages``.
        parts: block indices (positions in ``split.block_keys``) of every stage.
        split: where the model splits.
        tied: ``(pre_name, post_name)`` parameter pairs shared by the first and last stage.
    """

    model: nn.Module
    modules: list[StageModule]
    stage_ids: list[int]
    num_stages: int
    parts: list[list[int]]
    split: PipelineSplit
    tied: list[tuple[str, str]] = field(default_factory=list)


def build_pipeline_stages(
    model: nn.Module,
    pp_rank: int,
    pp: int,
    virtual_stages: int = 1,
    style: StageStyle = "loop",
    *,
    split: Optional[PipelineSplit] = None,
    blocks_path: Optional[str] = None,
    layers_per_stage: Optional[Sequence[int]] = None,
    embed_weight: float = 0.0,
    head_weight: float = 0.0,
    pre_fn: Optional[Callable[..., Any]] = None,
    post_fn: Optional[Callable[[Any], Any]] = None,
    copy: bool = False,
) -> PipelineParts:
    """Prune ``model`` to this rank's stages and build their :class:`StageModule` objects.

    Every rank must start from the same full model (same seed). The model is modified **in place**
    (``copy=False``, so a LightningModule's ``parameters()`` become the local ones) or a deep copy.
    Tied first/last-stage parameters are reported in ``PipelineParts.tied``; sum their gradients with
    :func:`lightning_4d.pipeline.tied.sync_tied_grads` after backward.

    Args:
        model: the full model.
        pp_rank, pp, virtual_stages, style: placement (see :func:`~lightning_4d.pipeline.partition.stage_ids_for_rank`).
        split / blocks_path: where to split (found automatically if both are ``None``).
        layers_per_stage, embed_weight, head_weight: passed to
            :func:`~lightning_4d.pipeline.partition.partition_blocks`.
        pre_fn / post_fn: custom first-stage prologue / last-stage epilogue (see :class:`StageModule`).
        copy: prune a deep copy and leave ``model`` untouched.

    Example:
        >>> net = nn.Sequential(); net.add_module("layers", nn.ModuleList(nn.Linear(2, 2) for _ in range(4)))
        >>> parts = build_pipeline_stages(net, pp_rank=0, pp=2, virtual_stages=2, style="v")
        >>> parts.stage_ids, [m.block_keys for m in parts.modules]
        ([0, 3], [['0'], ['3']])
    """
    if copy:
        model = _copy.deepcopy(model)
    split = split or find_pipeline_split(model, blocks_path)
    num_stages = pp * virtual_stages
    parts = partition_blocks(split.num_blocks, num_stages, layers_per_stage=layers_per_stage,
                             embed_weight=embed_weight, head_weight=head_weight)
    stage_ids = stage_ids_for_rank(pp_rank, pp, virtual_stages, style)
    tied = find_tied_parameters(model, split, {split.block_keys[i]: s for s, idx in enumerate(parts) for i in idx})
    keep = {split.block_keys[i] for s in stage_ids for i in parts[s]}
    container = registered_submodule(model, split.blocks_path)
    assert container is not None
    kept = nn.ModuleDict({k: m for k, m in child_modules(container).items() if k in keep})
    _set(model, split.blocks_path, kept)
    if 0 not in stage_ids:
        for path in split.pre:
            _set(model, path, None)
    if num_stages - 1 not in stage_ids:
        for path in split.post:
            _set(model, path, None)
    modules = [
        StageModule(model, split, s, num_stages, [split.block_keys[i] for i in parts[s]], pre_fn, post_fn)
        for s in stage_ids
    ]
    return PipelineParts(model, modules, stage_ids, num_stages, parts, split, tied)
