"""Pipeline stages that run the model's own forward, so blocks get exactly what they get in one process.

A Hugging Face decoder layer is called as ``layer(h, attention_mask=..., position_embeddings=...,
position_ids=...)``: the extras are computed by the model before its loop (rotary tables, masks).
Instead of calling ``block(h)``, every stage here runs the model's whole ``forward`` on the
micro-batch's inputs (each pipeline rank has the batch: data parallel samplers are keyed on the dp
rank), with three changes that :class:`StagedForward` makes while a stage runs:

- the modules that run before the blocks and hold parameters (the token embedding) are replaced on
  later stages by :class:`ShapeStub`\\s that return zeros of the right shape and dtype (computed on
  the meta device), so masks and rotary tables are derived on each stage without the weights; the outputs a
  later stage reads by value (Gemma 4's per-layer input embeddings, found by a probe at set-up) are computed on
  the first stage and sent on with the hidden state instead, the stand-ins returning them
  (:mod:`lightning_4d.pipeline.carried`);
- the blocks container (:class:`StagedBlocks`) hands out dispatchers: blocks before this stage pass the
  hidden state through, this stage's first block receives the activation from the previous stage,
  and the first block after this stage stops the forward (:class:`StageDone`) with the hidden state,
  which the stage returns and the schedule sends on;
- the modules after the blocks (final norm, head, soft-capping, output wrappers) run on the last stage
  as the model wrote them.

Which argument carries the hidden state, and what runs before/after the blocks, comes from
:func:`lightning_4d.analysis.trace.trace_model`; :func:`~lightning_4d.pipeline.checks.check_staged` replays all stages in one
process on a tiny input and compares with the plain forward before anything is split.

Example:
    >>> from lightning_4d.models import Llama, LlamaConfig
    >>> from lightning_4d.analysis.trace import trace_model
    >>> lm = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=8))
    >>> tokens = torch.randint(0, 32, (2, 8))
    >>> trace = trace_model(lm, "layers", tokens)
    >>> staged = StagedForward(lm, trace, {0: ["0"], 1: ["1"]})  # stage 0 runs block 0, stage 1 block 1
    >>> staged.num_stages, staged.order
    (2, ('0', '1'))
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from lightning_4d._compat import child_modules, meta_scalar_mode, pytree, registered_submodule
from lightning_4d.pipeline.carried import CarriedCalls, CarriedRecorder, carried_calls, describe_carried, \
    split_received, tensor_leaves
from lightning_4d.pipeline.partition import partition_blocks
from lightning_4d.pipeline.stages import HOOK_HINT, PipelineSplit, StageForward
from lightning_4d.analysis.trace import ModelTrace, example_tokens

__all__ = ["check_stage_owners", "ShapeStub", "StageDone", "StagedBlocks", "StagedForward", "prepare_staged"]


class StageDone(Exception):
    """Raised by the first block after the running stage: carries the stage's output hidden state."""

    def __init__(self, hidden: Any) -> None:
        super().__init__("pipeline stage finished")
        self.hidden = hidden


class ShapeStub(nn.Module):
    """Stands in for a module with parameters on stages that do not own it: returns zeros shaped like
    its output (computed on a meta-device copy), so code that only needs shapes keeps working.

    The stand-in answers what forward code reads off the module besides calling it: a parameter or buffer
    (``self.embed_tokens.weight.device`` in Llama 4) is a zero tensor of its shape and dtype on the running
    stage's device that holds one element (an expanded scalar: no memory however large the weight), a
    submodule is a stand-in too, and plain values (``padding_idx``, ``embed_scale``) are the module's own.
    Methods are not answered: they would compute with weights this stage does not hold. What the stand-in
    gets wrong shows in :func:`~lightning_4d.pipeline.checks.check_staged`, which compares the stages with the plain
    forward.

    Example:
        >>> stub = ShapeStub(nn.Embedding(10, 4))
        >>> stub(torch.zeros(2, 3, dtype=torch.long)).shape, stub.weight.shape, stub.padding_idx
        (torch.Size([2, 3, 4]), torch.Size([10, 4]), None)
    """
    fourd_stub = True

    def __init__(self, module: nn.Module, device: Optional[torch.device] = None) -> None:
        super().__init__()
        meta = copy.deepcopy(module).to("meta")
        if device is None:
            device = next((t.device for t in module.parameters() if not t.is_meta), torch.device("cpu"))
        object.__setattr__(self, "_meta", meta)  # not registered: no parameters on this stage
        object.__setattr__(self, "device", device)  # set by StagedForward.run to the micro-batch's device

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or "_meta" not in self.__dict__:
                raise
        value = getattr(self._meta, name)  # an AttributeError names the module's class
        if isinstance(value, torch.Tensor):
            return torch.zeros((), dtype=value.dtype, device=self.device).expand(value.shape)
        if isinstance(value, nn.Module):
            return ShapeStub(value, self.device)
        if callable(value):  # an AttributeError, so that hasattr() says False (initialisers, hooks)
            raise AttributeError(  # noqa: TRY004
                f"{type(self._meta).__name__}.{name}: a pipeline stage that does not own this module (it runs "
                f"before the blocks) has only a shape stand-in for it, whose methods cannot run; {HOOK_HINT}"
            )
        return value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = next((t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
                      self.device)
        to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        with torch.no_grad():
            out = self._meta(*pytree.tree_map(to_meta, args), **pytree.tree_map(to_meta, kwargs))
        replay = self.__dict__.get("_replay")
        if replay is not None:  # values the first stage computed and sent on (lightning_4d.pipeline.carried)
            if not replay:
                raise ValueError(f"{type(self._meta).__name__}: called more often on this pipeline stage than on the "
                                 f"first one, which sent its outputs on; {HOOK_HINT}")
            received = iter(replay.pop(0))
            return pytree.tree_map(lambda t: next(received) if isinstance(t, torch.Tensor) else t, out)
        probe = self.__dict__.get("_probe")
        made: list[torch.Tensor] = []

        def zeros(t: torch.Tensor) -> torch.Tensor:
            z = torch.zeros(t.shape, dtype=t.dtype, device=device)
            if probe is not None and z.is_floating_point():
                z.requires_grad_(True)  # the probe follows what a stage reads from this output
            made.append(z)
            return z

        result = pytree.tree_map(lambda t: zeros(t) if isinstance(t, torch.Tensor) else t, out)
        if probe is not None:
            path, calls = probe
            calls.append((path, made))
        return result

    def replay(self, values: Optional[list[list[torch.Tensor]]]) -> None:
        """Return ``values`` (per call, the output's tensors in order) from the next calls instead of zeros: the
        outputs the first stage computed (:mod:`lightning_4d.pipeline.carried`); ``None`` ends it."""
        object.__setattr__(self, "_replay", list(values) if values is not None else None)


class _Dispatcher:
    """What the model calls for one block while a stage runs: the call, and the block's plain attributes (a hybrid's
    loop reads ``layer.block_type`` to pick each layer's mask, also for blocks another stage holds).

    Example:
        >>> d = _Dispatcher(lambda h: h, {"block_type": "mamba"})
        >>> d(3), d.block_type
        (3, 'mamba')
    """

    def __init__(self, call: Callable[..., Any], attrs: dict[str, Any]) -> None:
        self._call, self._attrs = call, attrs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attrs = self.__dict__.get("_attrs", {})
        if name in attrs:
            return attrs[name]
        raise AttributeError(f"a pipeline stage's stand-in for a block has no attribute {name!r} (only the block's "
                             f"plain values: {sorted(attrs)})")


@dataclass
class _Stage:
    index: int
    keys: tuple[str, ...]
    first: int  # positions in the block order
    last: int
    is_first: bool
    activation: Any = None
    probing: bool = False  # set-up only: record what the stage's blocks receive, run none (carried_calls)
    consumed: list = field(default_factory=list)


class StagedBlocks(nn.ModuleDict):
    """The blocks container of a pipelined model: this rank's blocks under their original keys.

    Outside a stage's forward it is an ordinary ``ModuleDict``. While a stage runs it behaves like the
    original container (a list or a dict of *all* blocks) whose entries are dispatchers.
    """
    def __init__(self, blocks: dict[str, nn.Module], order: tuple[str, ...], was_list: bool) -> None:
        super().__init__(blocks)
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_was_list", was_list)
        object.__setattr__(self, "_staged", None)

    def _active(self) -> bool:
        return self._staged is not None and self._staged.stage is not None

    def _dispatchers(self) -> list[Callable[..., Any]]:
        return [self._staged.dispatcher(i) for i in range(len(self._order))]

    def __getitem__(self, idx: Union[int, str, slice],
                    ) -> Union[nn.Module, Callable[..., Any], list[Callable[..., Any]]]:
        if not self._active():
            return super().__getitem__(idx)
        if isinstance(idx, str):
            return self._staged.dispatcher(self._order.index(idx))
        return self._dispatchers()[idx]

    def __iter__(self) -> Iterator[Union[str, Callable[..., Any]]]:
        if not self._active():
            return super().__iter__()
        return iter(self._dispatchers() if self._was_list else self._order)

    def __len__(self) -> int:
        return len(self._order) if self._active() else super().__len__()

    def values(self) -> Iterable[Union[nn.Module, Callable[..., Any]]]:
        return self._dispatchers() if self._active() else super().values()

    def items(self) -> Iterable[tuple[str, Union[nn.Module, Callable[..., Any]]]]:
        return list(zip(self._order, self._dispatchers())) if self._active() else super().items()

    def keys(self) -> Iterable[str]:
        return list(self._order) if self._active() else super().keys()


class StagedForward(StageForward):
    """Runs one stage of a pipelined model through the model's own ``forward`` (see the module doc).

    Args:
        root: the module whose forward is the model (the LightningModule).
        trace: the model's :class:`~lightning_4d.analysis.trace.ModelTrace` (taken on the full model).
        stage_keys: block keys of every stage (all stages of the pipeline, by stage index).
    """

    inputs_to_every_stage = True  # later stages derive masks and rotary tables from the inputs

    def __init__(self, root: nn.Module, trace: ModelTrace, stage_keys: Mapping[int, Sequence[str]]) -> None:
        def holds_params(path: str) -> bool:
            mod = registered_submodule(root, path)
            return mod is not None and any(True for _ in mod.parameters())

        pre = tuple(p for p in trace.pre if holds_params(p))
        post = tuple(p for p in trace.post if holds_params(p))
        super().__init__(root, PipelineSplit(trace.blocks_path, tuple(trace.block_order), pre, post), stage_keys)
        self.trace = trace
        self.order = tuple(trace.block_order)
        self.hidden = trace.hidden
        self.stage: Optional[_Stage] = None
        self.carried: CarriedCalls = ()  # stand-in outputs later stages read: sent on from the first stage
        self.recorder: Optional[CarriedRecorder] = None

    # -- set-up ---------------------------------------------------------------------------------------
    def install(self, example: Any = None) -> None:
        """Make the shape stubs of the pre-block modules that hold parameters (from the full modules), install the
        blocks container, and find which stub outputs later stages read (:func:`~lightning_4d.pipeline.carried.
        carried_calls`, on ``example`` inputs: default :func:`~lightning_4d.analysis.trace.example_tokens`): those
        are recorded on the first stage and sent on."""
        for path in self.split.pre:
            self.stubs[path] = ShapeStub(registered_submodule(self.root, path))
        super().install()
        if not self.stubs or self.num_stages < 2:
            return
        inputs = example if example is not None else example_tokens(self.root)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        on_meta = any(p.is_meta for p in self.root.parameters())
        if on_meta:  # the stand-ins make their zeros where the inputs are
            inputs = pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, inputs)
        with meta_scalar_mode() if on_meta else nullcontext():
            self.carried = carried_calls(lambda i: self._probe(i, inputs), self.num_stages)
        if self.carried:
            modules = {p: m for p in self.stubs if (m := registered_submodule(self.root, p)) is not None}
            self.recorder = CarriedRecorder(modules, self.carried)

    def _probe(self, index: int, inputs: tuple) -> tuple[list[tuple[str, list[torch.Tensor]]], list[torch.Tensor]]:
        """Stage ``index`` in probe mode: the stand-ins' calls (the leaves they returned, requiring grad) and what
        the stage reads (its blocks' arguments besides the hidden state; on the last stage its output)."""
        keys = self.stage_keys[index]
        positions = [self.order.index(k) for k in keys]
        stage = _Stage(index, keys, min(positions), max(positions), False, probing=True)
        calls: list[tuple[str, list[torch.Tensor]]] = []
        for path, stub in self.stubs.items():
            object.__setattr__(stub, "_probe", (path, calls))
        self.stage = stage
        out = None
        try:
            with torch.enable_grad(), self._swap_pre(False):
                out = self.root(*inputs)
        except StageDone:
            pass
        finally:
            self.stage = None
            for stub in self.stubs.values():
                object.__setattr__(stub, "_probe", None)
        return calls, stage.consumed + (tensor_leaves(out) if index == self.num_stages - 1 else [])

    def container(self, blocks: dict[str, nn.Module], was_list: bool) -> StagedBlocks:
        """A :class:`StagedBlocks` that hands out this object's dispatchers while a stage runs."""
        staged = StagedBlocks(blocks, self.order, was_list)
        object.__setattr__(staged, "_staged", self)
        return staged

    def describe(self) -> str:
        stubs = ", ".join(self.stubs) or "none"
        carried = (f"; the outputs later stages read ({describe_carried(self.carried)}) computed on the first stage and "
                   f"sent on" if self.carried else "")
        shared = (f". The blocks also share state through their argument(s) {', '.join(map(repr, self.trace.shared_args))}"
                  f" (one container a block writes and a later block reads, e.g. Gemma 4's K and V under "
                  f"num_kv_shared_layers), which no pipeline stage boundary passes on: every block reading it must be "
                  f"on the stage of the block writing it, else use pp=1 (tp, dp and ep keep it) or a model without the "
                  f"sharing" if self.trace.shared_args else "")
        return (f"the model's forward with the blocks of other stages skipped and, on later stages, the modules before "
                f"the blocks ({stubs}) replaced by shape-only stand-ins (zeros of the right shape: what the blocks "
                f"receive, masks and rotary tables, is computed with them){carried}{shared}")

    # -- running --------------------------------------------------------------------------------------
    def dispatcher(self, pos: int) -> Callable[..., Any]:
        """What the model calls for block ``pos`` while a stage runs."""
        key = self.order[pos]

        def call(*args: Any, **kwargs: Any) -> Any:
            stage = self.stage
            assert stage is not None
            if pos < stage.first:
                return self.hidden.wrap(self.hidden.get(args, kwargs))  # an earlier stage's block
            if pos > stage.last:
                raise StageDone(self.hidden.get(args, kwargs))  # the output of this stage's last block
            if pos == stage.first and stage.activation is not None:
                args, kwargs = self.hidden.replace(args, kwargs, stage.activation)
            if stage.probing:  # what this block would read besides the hidden state; the hidden passes through
                hidden = self.hidden.get(args, kwargs)
                stage.consumed += tensor_leaves(self.hidden.replace(args, kwargs, None))
                if pos == stage.first and isinstance(hidden, torch.Tensor):
                    hidden = hidden.detach()  # a later stage receives it: it depends on no stand-in there
                return self.hidden.wrap(hidden)
            container = registered_submodule(self.root, self.trace.blocks_path)
            return child_modules(container)[key](*args, **kwargs)

        return _Dispatcher(call, self.trace.block_attrs.get(key, {}))

    @contextmanager
    def _swap_pre(self, is_first: bool) -> Iterator[None]:
        saved: dict[str, tuple[nn.Module, str, Optional[nn.Module]]] = {}
        if not is_first:
            for path, stub in self.stubs.items():
                parent_path, _, name = path.rpartition(".")
                parent = registered_submodule(self.root, parent_path)
                saved[path] = (parent, name, child_modules(parent).get(name))
                setattr(parent, name, stub)
        try:
            yield
        finally:
            for parent, name, mod in saved.values():
                if mod is not None:
                    setattr(parent, name, mod)

    def run(self, index: int, args: tuple, inputs: Any) -> Any:
        """Forward of stage ``index``: ``args`` are the model inputs (first stage) or the received
        activations; ``inputs`` the micro-batch's model inputs."""
        keys = self.stage_keys[index]
        positions = [self.order.index(k) for k in keys]
        is_first = index == 0
        received: tuple = ()
        if is_first:
            activation = None
        elif self.carried:  # (hidden, *carried): the stand-ins return what the first stage computed
            activation, received = args[0], tuple(args[1:])
            replay = split_received(self.carried, received)
            for path, stub in self.stubs.items():
                stub.replay(replay.get(path))
        else:
            activation = args[0] if len(args) == 1 else args
        model_inputs = args if is_first else (inputs if isinstance(inputs, tuple) else (inputs,))
        self.stage = _Stage(index, keys, min(positions), max(positions), is_first, activation)
        device = next((t.device for t in pytree.tree_leaves((args, inputs)) if isinstance(t, torch.Tensor)), None)
        for stub in self.stubs.values() if device is not None else ():
            object.__setattr__(stub, "device", device)  # the stand-ins' tensors live where the micro-batch is
        record = self.recorder if is_first and self.recorder is not None else nullcontext()
        try:
            with self._swap_pre(is_first), record:
                out = self.root(*model_inputs)
        except StageDone as done:
            if not self.carried:
                return done.hidden
            assert self.recorder is not None
            sent = self.recorder.values() if is_first else [t.view_as(t) for t in received]
            return (done.hidden, *sent)  # (B, T, H), then the carried values for the later stages
        finally:
            self.stage = None
            for stub in self.stubs.values() if received else ():
                stub.replay(None)
        if index != self.num_stages - 1:
            raise ValueError(
                f"{type(self.root).__name__}: its forward returned without calling the block after stage {index} "
                f"(blocks {list(keys)}); pipeline stages need every block called in order."
            )
        return out


def check_stage_owners(root: nn.Module, trace: ModelTrace) -> None:
    """Refuse modules with parameters that run both before and after the blocks (or between them): no single
    pipeline stage can own them.

    Example:
        >>> check_stage_owners(nn.Linear(2, 2), ModelTrace())  # nothing runs on both sides: fine
    """
    shared = [p for p in trace.elsewhere
              if (m := registered_submodule(root, p)) is not None and any(True for _ in m.parameters())]
    if shared:
        raise ValueError(
            f"{type(root).__name__}: {', '.join(shared)} hold(s) parameters and run(s) both before and after the "
            f"blocks of {trace.blocks_path} (or between them), so no single pipeline stage can own them. Call them "
            f"on one side only, or {HOOK_HINT}."
        )


def prepare_staged(root: nn.Module, trace: ModelTrace, num_stages: int) -> StagedForward:
    """Partition the blocks over ``num_stages`` stages, make the shape stubs and install the staged
    container on the full model (nothing is removed yet; :func:`~lightning_4d.pipeline.stages.prune_stages` does that).

    Example:
        >>> from lightning_4d.models import Llama, LlamaConfig
        >>> from lightning_4d.analysis.trace import trace_model
        >>> lm = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=8))
        >>> tokens = torch.randint(0, 32, (2, 8))
        >>> trace = trace_model(lm, "layers", tokens)
        >>> staged = prepare_staged(lm, trace, num_stages=2)
        >>> staged.stage_keys, list(staged.stubs)  # later stages get a stand-in for the embedding
        ({0: ('0',), 1: ('1',)}, ['tok_embeddings'])
    """
    check_stage_owners(root, trace)
    parts = partition_blocks(len(trace.block_order), num_stages)
    staged = StagedForward(root, trace, {s: [trace.block_order[i] for i in idx] for s, idx in enumerate(parts)})
    staged.install()
    return staged
