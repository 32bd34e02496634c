"""Cut an ordinary model into pipeline stages, keeping the original parameter names.

The model's repeated blocks live in one container (an ``nn.ModuleList`` / ``nn.ModuleDict``): by
default the one of identical-type children that holds the most parameters. Modules registered
before that container (in it parent, and in each ancestor up to the root) run on the first stage
(e.g. the token embedding); modules registered after it run on the last stage (final norm, head).

One mechanism makes the stages: a :class:`StageForward` says how they run, either :class:`ChainForward` (pre →
blocks → post on one tensor: a plain chain, or what the user's pipeline hooks name) or
:class:`~lightning_4d.pipeline.staged.StagedForward` (the model's own forward, stage by stage), and
:func:`prune_stages` prunes the model **in place** to this rank's stages: the blocks container becomes an
``nn.ModuleDict`` keyed by the original indices holding only this rank's blocks, and absent pre/post modules
are set to ``None`` (or a stand-in). So ``model.named_parameters()`` on every rank lists exactly its own
parameters under their single-process names (``layers.3.attention.wq.weight``), and optimizers / checkpoints
stay layout-independent. :func:`build_pipeline_stages` does both for a chain without a plan.

Each local stage gets a :class:`StageModule` — what ``PipelineStage(submod=...)`` runs and whose
``parameters()`` it uses for gradient handling. It *shares* (does not copy) the pruned model's
modules and registers them under the same paths, so its parameter names equal the model's too.

Example:
    >>> net = nn.Sequential(); net.add_module("emb", nn.Embedding(10, 4))
    >>> net.add_module("layers", nn.ModuleList(nn.Linear(4, 4) for _ in range(4)))
    >>> net.add_module("head", nn.Linear(4, 10))
    >>> parts = build_pipeline_stages(net, pp_rank=1, pp=2)
    >>> sorted(name for name, _ in net.named_parameters())[:2]
    ['head.bias', 'head.weight']
    >>> [n for n, _ in parts.modules[0].named_parameters()][:2]
    ['layers.2.weight', 'layers.2.bias']
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch  # noqa: F401  (the doctests use it)
from torch import nn

from lightning_4d._compat import child_modules, is_loss_module, registered_submodule
from lightning_4d.analysis.hooks import PIPELINE_POST, PIPELINE_PRE, PIPELINE_SPLIT, hook_call
from lightning_4d.pipeline.partition import PipelineSplit, StageStyle, partition_blocks, stage_ids_for_rank
from lightning_4d.pipeline.tied import find_tied_parameters

__all__ = ["HOOK_HINT", "INPUTS_KW", "ChainForward", "PipelineParts", "PipelineSplit", "StageForward", "StageModule",
           "build_pipeline_stages", "find_pipeline_split", "prune_stages"]

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
        from lightning_4d.analysis.discovery import find_blocks

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


INPUTS_KW = "fourd_inputs"  # the micro-batch's model inputs, passed by the schedule to every stage that needs them


class StageForward:
    """How a model's pipeline stages run: the one interface that pruning (:func:`prune_stages`), the stage modules,
    the set-up check (:func:`~lightning_4d.pipeline.checks.check_staged`) and the runner use. Two kinds exist:
    :class:`ChainForward` (what the pipeline hooks name, chained: pre → blocks → post) and
    :class:`~lightning_4d.pipeline.staged.StagedForward` (the model's own forward run stage by stage).

    Attributes:
        root: the model holding the modules.
        split: the blocks container (keys in call order) and the modules with parameters before / after it.
        stage_keys: block keys of every stage, by stage index; ``num_stages`` their number.
        stubs: what replaces a module before the blocks on ranks without stage 0 (absent: ``None``).
        inputs_to_every_stage: whether each stage gets the micro-batch's inputs as keyword :data:`INPUTS_KW`.

    Example:
        >>> net = nn.Sequential(); net.add_module("layers", nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> chain = ChainForward(net, find_pipeline_split(net), {0: ["0"], 1: ["1"]})
        >>> chain.num_stages, chain.run(1, (chain.run(0, (torch.ones(1, 2),), None),), None).shape
        (2, torch.Size([1, 2]))
    """

    inputs_to_every_stage = False

    def __init__(self, root: nn.Module, split: PipelineSplit, stage_keys: Mapping[int, Sequence[str]]) -> None:
        self.root = root
        self.split = split
        self.stage_keys = {s: tuple(k) for s, k in stage_keys.items()}
        self.num_stages = len(self.stage_keys)
        self.stubs: dict[str, nn.Module] = {}

    def install(self) -> None:
        """Replace the blocks container by :meth:`container` over its blocks (pruning deletes from it)."""
        found = registered_submodule(self.root, self.split.blocks_path)
        assert found is not None
        _set(self.root, self.split.blocks_path, self.container(child_modules(found), isinstance(found, nn.ModuleList)))

    def container(self, blocks: dict[str, nn.Module], was_list: bool) -> nn.ModuleDict:
        """The installed blocks container: an ``nn.ModuleDict`` under the original keys."""
        return nn.ModuleDict(blocks)

    def run(self, index: int, args: tuple, inputs: Any) -> Any:
        """Forward of stage ``index``: ``args`` are the model inputs (stage 0) or the previous stage's output;
        ``inputs`` the micro-batch's model inputs (``None`` unless :attr:`inputs_to_every_stage`)."""
        raise NotImplementedError

    def describe(self) -> str:
        """What the stages run, for the set-up check's errors."""
        raise NotImplementedError


class ChainForward(StageForward):
    """Stages that chain what the pipeline hooks name: pre-modules (or ``pre_fn``) on stage 0, this stage's blocks
    on one tensor, post-modules (or ``post_fn``) on the last stage.

    Args:
        root / split / stage_keys: see :class:`StageForward`.
        pre_fn: ``pre_fn(*inputs) -> h`` replacing the chained pre-modules (first stage).
        post_fn: ``post_fn(h) -> output`` replacing the chained post-modules (last stage).

    Example:
        >>> net = nn.Sequential(); net.add_module("layers", nn.ModuleList([nn.Linear(2, 2)]))
        >>> ChainForward(net, find_pipeline_split(net), {0: ["0"]}, post_fn=torch.relu).describe()
        "a chain [] → layers[*] → ['pipeline_post_blocks'] on one tensor"
    """

    def __init__(self, root: nn.Module, split: PipelineSplit, stage_keys: Mapping[int, Sequence[str]],
                 pre_fn: Optional[Callable[..., Any]] = None, post_fn: Optional[Callable[[Any], Any]] = None) -> None:
        super().__init__(root, split, stage_keys)
        self.pre_fn = pre_fn
        self.post_fn = post_fn

    def run(self, index: int, args: tuple, inputs: Any) -> Any:
        if index == 0:
            h = self.run_pre(args)
        else:
            h = args if len(args) != 1 else args[0]  # (B, T, D) activations from the previous stage
        blocks = child_modules(registered_submodule(self.root, self.split.blocks_path))
        for key in self.stage_keys[index]:
            h = blocks[key](*h) if isinstance(h, tuple) else blocks[key](h)  # (B, T, D)
        return self.run_post(h) if index == self.num_stages - 1 else h

    def run_pre(self, args: tuple) -> Any:
        """What runs before the blocks on stage 0: ``pre_fn(*args)`` or the pre-modules in order."""
        return self.pre_fn(*args) if self.pre_fn is not None else _chain(self.root, self.split.pre, args)

    def run_post(self, h: Any) -> Any:
        """What runs after the blocks on the last stage: ``post_fn(h)`` or the post-modules in order."""
        return self.post_fn(h) if self.post_fn is not None else _chain(self.root, self.split.post, (h,))

    def describe(self) -> str:
        pre = [PIPELINE_PRE] if self.pre_fn is not None else list(self.split.pre)
        post = [PIPELINE_POST] if self.post_fn is not None else list(self.split.post)
        return f"a chain {pre} → {self.split.blocks_path}[*] → {post} on one tensor"


def _chain(root: nn.Module, paths: Sequence[str], args: tuple) -> Any:
    """The modules at ``paths`` called in order on ``args`` (those absent on this rank skipped)."""
    h: Any = args if len(args) != 1 else args[0]
    for path in paths:
        mod = registered_submodule(root, path)
        if mod is not None:
            h = mod(*h) if isinstance(h, tuple) else mod(h)
    return h


class StageModule(nn.Module):
    """One pipeline stage: what ``PipelineStage(submod=...)`` runs and whose ``parameters()`` it uses. Holds the
    pre-modules (stage 0), this stage's blocks and the post-modules (last stage), shared with the model and
    registered under their original paths, so ``named_parameters()`` yields the single-process names; its forward
    is ``stage_forward.run`` for this stage.

    Example:
        >>> net = nn.Sequential(); net.add_module("layers", nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> stage = StageModule(ChainForward(net, find_pipeline_split(net), {0: ["0", "1"]}), 0)
        >>> stage(torch.ones(1, 2)).shape, [n for n, _ in stage.named_parameters()][:1]
        (torch.Size([1, 2]), ['layers.0.weight'])
    """

    def __init__(self, stage_forward: StageForward, stage_index: int) -> None:
        super().__init__()
        root, split = stage_forward.root, stage_forward.split
        self.stage_forward = stage_forward
        self.stage_index = stage_index
        self.num_stages = stage_forward.num_stages
        self.block_keys = list(stage_forward.stage_keys[stage_index])
        container = registered_submodule(root, split.blocks_path)
        if container is None:
            raise ValueError(f"the model has no blocks container at {split.blocks_path!r}")
        blocks = nn.ModuleDict()
        for key in self.block_keys:
            block = child_modules(container).get(key)
            if block is None:
                raise ValueError(f"block {split.blocks_path}.{key} is not on this rank (pruned away?)")
            blocks[key] = block
        pre = split.pre if self.is_first else ()
        post = split.post if self.is_last else ()
        for path in pre:
            if (mod := registered_submodule(root, path)) is not None:
                self._mount(path, mod)
        self._mount(split.blocks_path, blocks)
        for path in post:
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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.stage_forward.run(self.stage_index, args, kwargs.get(INPUTS_KW))

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


def prune_stages(stage_forward: StageForward, stage_ids: Sequence[int]) -> PipelineParts:
    """Prune the model in place to this rank's stages and build their :class:`StageModule` objects: the one way
    pipeline stages are made (from the plan's stage assignment, whichever way the stages run). Blocks of other
    stages are deleted from the (installed, :meth:`StageForward.install`) container; modules before the blocks
    become their stand-in (or ``None``) unless this rank runs stage 0, modules after them ``None`` unless it runs
    the last stage. Tied first/last-stage parameters are reported in ``PipelineParts.tied``.

    Example:
        >>> net = nn.Sequential(); net.add_module("layers", nn.ModuleList(nn.Linear(2, 2) for _ in range(4)))
        >>> chain = ChainForward(net, find_pipeline_split(net), {0: ["0"], 1: ["1", "2"], 2: ["3"]})
        >>> chain.install()
        >>> parts = prune_stages(chain, [1])
        >>> parts.parts, list(net.layers), [m.block_keys for m in parts.modules]
        ([[0], [1, 2], [3]], ['1', '2'], [['1', '2']])
    """
    root, split = stage_forward.root, stage_forward.split
    tied = find_tied_parameters(root, split, {k: s for s, keys in stage_forward.stage_keys.items() for k in keys})
    keep = {k for s in stage_ids for k in stage_forward.stage_keys[s]}
    container = registered_submodule(root, split.blocks_path)
    assert isinstance(container, nn.ModuleDict), "install() the stage forward before pruning"
    for key in [k for k in child_modules(container) if k not in keep]:
        del container[key]
    if 0 not in stage_ids:
        for path in split.pre:
            _set(root, path, stage_forward.stubs.get(path))
    if stage_forward.num_stages - 1 not in stage_ids:
        for path in split.post:
            _set(root, path, None)
    modules = [StageModule(stage_forward, s) for s in stage_ids]
    order = {k: i for i, k in enumerate(split.block_keys)}
    parts = [[order[k] for k in stage_forward.stage_keys[s]] for s in range(stage_forward.num_stages)]
    return PipelineParts(root, modules, list(stage_ids), stage_forward.num_stages, parts, split, tied)


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
    """Partition a model whose forward is a chain pre → blocks → post (:class:`ChainForward`) and prune it to this
    rank's stages (:func:`prune_stages`), without Lightning or a plan.

    Every rank must start from the same full model (same seed). The model is modified **in place**
    (``copy=False``, so a LightningModule's ``parameters()`` become the local ones) or a deep copy.
    Sum the gradients of ``PipelineParts.tied`` with :func:`lightning_4d.pipeline.tied.sync_tied_grads`.

    Args:
        model: the full model.
        pp_rank, pp, virtual_stages, style: placement (see :func:`~lightning_4d.pipeline.partition.stage_ids_for_rank`).
        split / blocks_path: where to split (found automatically if both are ``None``).
        layers_per_stage, embed_weight, head_weight: passed to
            :func:`~lightning_4d.pipeline.partition.partition_blocks`.
        pre_fn / post_fn: custom first-stage prologue / last-stage epilogue (see :class:`ChainForward`).
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
    parts = partition_blocks(split.num_blocks, pp * virtual_stages, layers_per_stage=layers_per_stage,
                             embed_weight=embed_weight, head_weight=head_weight)
    stage_ids = stage_ids_for_rank(pp_rank, pp, virtual_stages, style)
    chain = ChainForward(model, split, {s: [split.block_keys[i] for i in idx] for s, idx in enumerate(parts)},
                         pre_fn, post_fn)
    chain.install()
    return prune_stages(chain, stage_ids)
