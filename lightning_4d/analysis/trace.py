"""How a model actually runs: one forward on a tiny input, recorded (one process, no communication).

Tensor and pipeline parallelism need facts that a model's *registration* order does not give: which
module is the token embedding and which the output head (Hugging Face keeps ``lm_head`` beside
``model``, not after ``model.layers``), what else each block receives (rotary tables, masks,
position ids: ``layer(h, position_embeddings=..., attention_mask=...)``), which argument carries the
hidden state from block to block, and how a fused projection's output is cut (``split`` of a
concatenated ``q|k|v`` or a per-head ``view``). :func:`trace_model` runs the model once in eval mode
without gradients and records them in a :class:`ModelTrace`. The records themselves live in
:mod:`lightning_4d.analysis.trace_records` (re-exported here); the recorder that runs inside the blocks in
:mod:`lightning_4d.analysis.trace_consumers`, following the linears' output features with :mod:`lightning_4d.analysis.trace_columns`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = nn.Embedding(10, 4)
    ...         self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    ...         self.head = nn.Linear(4, 10)
    ...     def forward(self, x):
    ...         h = self.emb(x)
    ...         for layer in self.layers:
    ...             h = layer(h)
    ...         return self.head(h)
    >>> t = trace_model(Net(), "layers", torch.zeros(1, 3, dtype=torch.long))
    >>> t.pre, t.post, t.block_order, t.hidden.position
    (('emb',), ('head',), ('0', '1'), 0)
"""

from __future__ import annotations

import inspect
from collections.abc import MutableMapping, MutableSequence
from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from lightning_4d._compat import child_modules, pytree, registered_submodule
from lightning_4d._compat.dispatch import view_base
from lightning_4d.analysis.int_reads import watch_int_reads
from lightning_4d.analysis.hooks import PIPELINE_HOOKS, PIPELINE_POST, PIPELINE_PRE, PIPELINE_SPLIT, hook_call
from lightning_4d.analysis.feature_inputs import is_index_output
from lightning_4d.analysis.layer_kinds import holds_routed_experts, is_linear, is_norm
from lightning_4d.analysis.trace_consumers import _Consumers, _Facts
from lightning_4d.analysis.trace_records import SPLIT_OPS, ColumnLayout, Consumer, HiddenArg, ModelTrace

__all__ = ["ColumnLayout", "Consumer", "HiddenArg", "ModelTrace", "trace_model", "example_tokens", "first_param_name",
           "SPLIT_OPS"]


def example_tokens(module: nn.Module, tp: int = 1, seq: Optional[int] = None) -> torch.Tensor:
    """Tiny token ids valid for every ``nn.Embedding`` of ``module`` (``example_input_array`` wins, unless ``seq``
    asks for another length): the package's one example input (the trace, the reduced check and the pipeline's
    sequential check use it; the context-parallel check with its own ``seq``).

    Example:
        >>> example_tokens(nn.Sequential(nn.Embedding(5, 2))).shape
        torch.Size([2, 8])
        >>> example_tokens(nn.Sequential(nn.Embedding(5, 2)), seq=12).shape
        torch.Size([2, 12])
    """
    sample = getattr(module, "example_input_array", None)
    if sample is not None and (seq is None or tuple(getattr(sample, "shape", ()))[1:2] == (seq,)):
        return sample
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        raise ValueError(
            f"Cannot build an example input for {type(module).__name__} (it has no nn.Embedding). Set "
            f"`self.example_input_array` on the module to a small batch of inputs."
        )
    high = min(m.num_embeddings for m in tables)
    seq = seq or max(8, 2 * tp)
    device = tables[0].weight.device if tables[0].weight.device.type != "meta" else torch.device("cpu")
    return torch.randint(0, high, (2, seq), generator=torch.Generator().manual_seed(0)).to(device)


def first_param_name(module: nn.Module) -> Optional[str]:
    """Name of the first parameter of ``module.forward`` (its main input when passed by keyword)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return named[0].name if named else None


def _structure(block: nn.Module) -> tuple[tuple[str, str], ...]:
    """What makes two blocks the same kind: their module paths and classes (a Mamba layer and an attention layer of
    one hybrid list differ; the layers of a plain decoder do not)."""
    return tuple((n, type(m).__qualname__) for n, m in block.named_modules())


def trace_model(root: nn.Module, blocks_path: str, example: Any) -> ModelTrace:
    """Run ``root(example)`` once (eval, no grad) and record what :class:`ModelTrace` describes. The per-block facts
    are those of the first block; a block of another structure (a hybrid's Mamba layer after an attention layer) has
    those of the first block like it, in :meth:`ModelTrace.for_block`.

    Raises:
        ValueError: when the blocks are not each called once, in order, on the previous block's output.
    """
    trace = ModelTrace(blocks_path=blocks_path)
    container = registered_submodule(root, blocks_path)
    if container is None:
        raise ValueError(f"{type(root).__name__} has no module at {blocks_path!r}")
    blocks = child_modules(container)
    block_ids = {id(m): k for k, m in blocks.items()}
    names: dict[int, str] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), name)
    first_of_kind: dict[tuple, str] = {}
    rep_of = {key: first_of_kind.setdefault(_structure(block), key) for key, block in blocks.items()}
    # every block records its facts; a kind's are its first block's, completed by the later blocks of the kind
    # (modules a block skips by depth: Zamba2's shared block runs one adapter of its list per use)
    facts = {key: _Facts() for key in blocks}
    # module id -> (path inside its block, block key); a module shared by several blocks is recorded in the first
    in_rep: dict[int, tuple[str, str]] = {}
    for key in facts:
        for n, m in blocks[key].named_modules():
            if n:
                in_rep.setdefault(id(m), (n, key))
    block_calls: list[tuple[str, tuple, dict, Any]] = []
    events: list[tuple[str, str]] = []  # ("block", key) or ("module", path) in entry order
    recording: list[str] = []  # the representative block running now (its first call)
    module_inputs: dict[int, torch.Tensor] = {}
    mode = _Consumers()

    def current(mod: nn.Module) -> Optional[tuple[str, _Facts]]:
        found = in_rep.get(id(mod))
        if found is None or not recording or found[1] != recording[-1]:
            return None
        return found[0], facts[found[1]]

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        nonlocal mode
        path = names.get(id(mod))
        if path is None:
            return
        if path not in trace.order:
            trace.order.append(path)
        events.append(("module", path))
        key = block_ids.get(id(mod))
        if key in facts and facts[key].mode is None:
            # a fresh recorder per kind: what this block's linears produce, from nothing earlier blocks left
            mode.__exit__(None, None, None)
            mode = _Consumers()
            mode.columns.names = {id(b): n for n, b in blocks[key].named_buffers()}
            mode.columns.params = {id(p): (p, n) for n, p in blocks[key].named_parameters()}
            mode.__enter__()
            mode.features.label_call(args, kwargs)  # the block's own arguments (Gemma 4's per-layer input)
            facts[key].mode = mode
            recording.append(key)
        here = current(mod)
        if here is None:
            return
        rel, f = here
        main = args[0] if args else (kwargs.get(first_param_name(mod) or "") if kwargs else None)
        if isinstance(main, torch.Tensor):
            f.parent_inputs.setdefault(rel, mode.root(main))
            f.input_ndim.setdefault(rel, main.dim())
            if is_linear(mod):
                f.inputs.setdefault(rel, mode.root(main))
                f.sources.setdefault(rel, mode.origin_of(main))
            else:
                f.module_sources.setdefault(rel, mode.origin_of(main))
                module_inputs[id(mod)] = main
            mode.biases.label_call(rel, args, kwargs, main)

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        main = module_inputs.pop(id(mod), None)
        if main is not None and isinstance(out, torch.Tensor) and out.shape == main.shape and is_norm(mod):
            mode.columns.same(main, out)  # a norm keeps the features where they are
        here = current(mod)
        if here is not None and not is_linear(mod) and is_index_output(out):
            here[1].index_modules.add(here[0])  # DeepSeek-V3.2's indexer: top-k positions, no features
        if here is not None and is_linear(mod) and isinstance(out, torch.Tensor):
            rel, f = here
            mode.watch[id(out)] = (rel, out)
            mode.tag(out, frozenset({rel}))
            mode.columns.watch(rel, out)
            f.last_linear[rel.rpartition(".")[0]] = rel
        if id(mod) in block_ids:
            block_calls.append((block_ids[id(mod)], args, kwargs, out))
            if recording and recording[-1] == block_ids[id(mod)]:
                recording.pop()

    handles = []
    for mod in {id(m): m for m in root.modules()}.values():
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    was_training = root.training
    root.eval()
    args = example if isinstance(example, tuple) else (example,)
    opaque = _opaque_moe_on_meta(root)
    # the ints each module of a block reads in its forward (a library's own classes: torch's are not watched)
    watched = {f"{key}/{n}": m for key, block in blocks.items() for n, m in block.named_modules()
               if n and not type(m).__module__.startswith("torch.")}
    try:
        with torch.no_grad(), watch_int_reads(watched) as reads:
            mode.__enter__()
            try:
                trace.output = root(*args)
            finally:
                mode.__exit__(None, None, None)
    finally:
        for h in handles:
            h.remove()
        for mod in opaque:
            del mod.forward
        root.train(was_training)
    for path, found in reads.items():
        key, _, rel = path.partition("/")
        facts[key].int_reads[rel] = found
    _analyse_blocks(trace, root, blocks, block_calls)
    _classify_outside(trace, root, blocks_path, events)
    trace.block_attrs = {key: {k: v for k, v in vars(block).items() if not k.startswith("_")
                               and isinstance(v, (int, float, str, bool, type(None)))} for key, block in blocks.items()}
    first = next(iter(blocks))
    done: dict[str, ModelTrace] = {}
    for key, rep in rep_of.items():
        if facts[key].mode is not None:
            done[rep] = facts[key].into(trace) if rep not in done else _completed(done[rep], facts[key].into(trace))
    own = done.get(first)
    if own is not None:
        trace = replace(own, kinds={})
    trace.kinds = {key: done[rep] for key, rep in rep_of.items() if rep != first and rep in done}
    return trace


def _completed(trace: ModelTrace, later: ModelTrace) -> ModelTrace:
    """``trace`` (a kind's first block) with the facts of modules only a later block of its kind ran (its own win)."""
    ran = set(trace.sources) | set(trace.module_sources)

    def fill(mine: dict, theirs: dict) -> dict:
        return {**{k: v for k, v in theirs.items() if k not in mine}, **mine}

    return replace(trace, consumers=fill(trace.consumers, later.consumers), columns=fill(trace.columns, later.columns),
                   score_biases=fill(trace.score_biases, later.score_biases),
                   last_linear=fill(trace.last_linear, later.last_linear), sources=fill(trace.sources, later.sources),
                   module_sources=fill(trace.module_sources, later.module_sources),
                   input_ndim=fill(trace.input_ndim, later.input_ndim),
                   int_reads=fill(trace.int_reads, later.int_reads),
                   takes_block_input=trace.takes_block_input | {r for r in later.takes_block_input if r not in ran})


def _opaque_moe_on_meta(root: nn.Module) -> list[nn.Module]:
    """On the meta device (a planner dry run) routing has no data: MoE layers pass their input through
    during the trace (their structure is not needed; shapes are kept)."""
    if not any(p.is_meta for p in root.parameters()):
        return []
    layers = [m for m in root.modules() if holds_routed_experts(m) and any(True for _ in m.parameters())]
    for mod in layers:
        mod.forward = lambda x, *args, **kwargs: x  # (B, T, H) -> (B, T, H)
    return layers


def _carries(arg: Any, out: Any) -> bool:
    """Whether block argument ``arg`` is the previous block's output ``out``: the tensor itself or a whole view of it
    (Gemma 4 slices the hidden state ``h[:, -0:]`` before its KV-shared layers, the whole sequence)."""
    if arg is out:
        return True
    if not (isinstance(arg, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    base, out_base = view_base(arg), view_base(out)
    return (base is not None and base is (out if out_base is None else out_base) and arg.shape == out.shape
            and arg.stride() == out.stride() and arg.storage_offset() == out.storage_offset())


def _analyse_blocks(trace: ModelTrace, root: nn.Module, blocks: dict[str, nn.Module], calls: list) -> None:
    cls = type(root).__name__
    keys = tuple(k for k, *_ in calls)
    if keys != tuple(blocks):
        raise ValueError(
            f"{cls}: the blocks of {trace.blocks_path} ran in the order {list(keys)} during one forward; pipeline "
            f"and sequence parallelism need each block called once, in order ({list(blocks)}). Implement "
            f"{' / '.join(hook_call(h) for h in PIPELINE_HOOKS)}."
        )
    trace.block_order = keys
    _, args0, kwargs0, out0 = calls[0]
    tuple_out = len(out0) if isinstance(out0, (tuple, list)) else None
    carrier = out0[0] if tuple_out is not None else out0
    position, keyword = None, None
    if len(calls) > 1:
        _, args1, kwargs1, _ = calls[1]
        position = next((i for i, a in enumerate(args1) if _carries(a, carrier)), None)
        if position is None:
            keyword = next((k for k, v in kwargs1.items() if _carries(v, carrier)), None)
    else:
        position = next((i for i, a in enumerate(args0) if isinstance(a, torch.Tensor)), None)
        if position is None:
            keyword = next((k for k, v in kwargs0.items() if isinstance(v, torch.Tensor)), None)
    if position is None and keyword is None:
        raise ValueError(
            f"{cls}: block {trace.blocks_path}.{keys[min(1, len(keys) - 1)]} does not receive the previous block's "
            f"output as an argument, so the hidden state cannot be followed from block to block. Implement "
            f"{hook_call(PIPELINE_SPLIT)} with {hook_call(PIPELINE_PRE)} / {hook_call(PIPELINE_POST)}."
        )
    trace.hidden = HiddenArg(position=position, keyword=keyword, tuple_out=tuple_out)
    trace.shared_args = _shared_args(calls)


def _shared_args(calls: list) -> tuple[str, ...]:
    """The block arguments that are one mutable container handed to several blocks and holding tensors after the
    forward: state blocks may write and later blocks read (Gemma 4's ``shared_kv_states``, read under
    ``num_kv_shared_layers``), which does not cross a pipeline stage boundary; named when the staged check fails."""
    seen: dict[int, tuple[str, set[int]]] = {}
    for index, (_, args, kwargs, _) in enumerate(calls):
        for key, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
            if isinstance(value, (MutableMapping, MutableSequence)):
                seen.setdefault(id(value), (str(key), set()))[1].add(index)
    containers = {id(v): v for _, args, kwargs, _ in calls for v in [*args, *kwargs.values()]}
    return tuple(sorted({key for ident, (key, users) in seen.items() if len(users) > 1
                         and any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(_contents(containers[ident])))}))


def _contents(container: Any) -> list[Any]:
    return list(container.values()) if isinstance(container, MutableMapping) else list(container)


def _classify_outside(trace: ModelTrace, root: nn.Module, blocks_path: str, events: list[tuple[str, str]]) -> None:
    """Outermost modules outside the blocks (not their ancestors): before, after, or elsewhere."""
    ancestors = {".".join(blocks_path.split(".")[:i]) for i in range(len(blocks_path.split(".")))}
    prefix = blocks_path + "."
    positions = [i for i, (_, p) in enumerate(events) if p.startswith(prefix) and p.count(".") == blocks_path.count(".") + 1]
    first, last = positions[0], positions[-1]
    seen: dict[str, list[int]] = {}
    for i, (_, path) in enumerate(events):
        if path in ancestors or path == blocks_path or path.startswith(prefix):
            continue
        parent = path.rpartition(".")[0]
        if parent not in ancestors:  # not outermost: its ancestor outside the blocks is recorded
            continue
        seen.setdefault(path, []).append(i)
    pre, post, elsewhere = [], [], []
    for path, idx in seen.items():
        if all(i < first for i in idx):
            pre.append(path)
        elif all(i > last for i in idx):
            post.append(path)
        else:
            elsewhere.append(path)
    trace.pre, trace.post, trace.elsewhere = tuple(pre), tuple(post), tuple(elsewhere)
