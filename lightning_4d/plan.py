"""The layout plan as one value: everything the rewrite decides, computed once on the unsharded model.

:func:`lightning_4d.layout.parallelize.plan_layout` derives a :class:`LayoutPlan` from one traced forward (on the meta
device or on real weights) without changing the model; :func:`lightning_4d.layout.parallelize.apply_layout` is the only
code that rewrites the model, and reads everything from the plan. A plan prints like TorchTitan's literal plans
(one line per module: ``"layers.0.attention.wq": Colwise()``), round-trips through JSON
(:meth:`LayoutPlan.to_json` / :meth:`LayoutPlan.from_json`: the recipes write ``layout_plan.json``) and can be
edited and given back (``FourDStrategy(plan=...)``, ``parallel.plan=FILE``): :meth:`LayoutPlan.check` validates
it against the model and the mesh, and the set-up value check then runs on the edited plan like on a derived one.

Example:
    >>> plan = LayoutPlan(degrees=(("tp", 1), ("pp", 1), ("ep", 1), ("dp", 1)), blocks_path="layers",
    ...                   block_order=("0", "1"))
    >>> LayoutPlan.from_json(plan.to_json()) == plan, str(plan).splitlines()[0]
    (True, 'LayoutPlan tp=1 pp=1 ep=1 dp=1 sp=True schedule=1f1b')
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

from lightning_4d.context_parallel.algorithm import plan_algorithm
from lightning_4d.tensor_parallel.apply import TPLayout
from lightning_4d.tensor_parallel.specs import StyleSpec
from lightning_4d.analysis.trace import HiddenArg, ModelTrace

if TYPE_CHECKING:
    from torch import nn

    from lightning_4d.mesh import ParallelDims

__all__ = ["ExpertEntry", "LayoutPlan", "PLAN_FILE", "PlanOptions", "load_plan"]

PLAN_FILE = "layout_plan.json"  # what the recipes write in the run directory
_VERSION = 1


class PlanOptions(Protocol):
    """The run's options a plan records (:class:`lightning_4d.config.FourDConfig` is one; a protocol, so the plan
    does not import the options, which import it)."""

    schedule: str
    data_parallel: str
    activation_checkpointing: Optional[str]
    cp_algorithm: str
    compile: Union[bool, str]
    float8: bool
    float8_recipe: str


@dataclass(frozen=True)
class ExpertEntry:
    """One expert-parallel module: its path, how it is rewritten (``in-place``: its own 3-D weights sharded;
    ``moe``: lightning_4d's MoE layer; ``mixtral``: an expert list rewritten into that layer), its experts and the
    renames of that rewrite (``(name in the user's model, name after it, index along dim 0 or None)``: what
    materialisation reads the user's weights by).

    Example:
        >>> str(ExpertEntry("layers.0.mlp.experts", "in-place", 8))
        '"layers.0.mlp.experts": experts(in-place, 8)'
    """

    path: str
    kind: str
    experts: int
    renames: tuple[tuple[str, str, Optional[int]], ...] = ()

    @property
    def layer(self) -> str:
        """The MoE layer the entry belongs to: the module around in-place experts or the package's ``experts``, a
        Mixtral-style block itself (rewritten into the package's layer).

        Example:
            >>> ExpertEntry("layers.0.mlp.experts", "moe", 8).layer, ExpertEntry("layers.0.moe", "mixtral", 8).layer
            ('layers.0.mlp', 'layers.0.moe')
        """
        return self.path if self.kind == "mixtral" else self.path.rpartition(".")[0]

    @property
    def experts_path(self) -> str:
        """The experts module once the layout is applied (a Mixtral-style block's ``experts`` after its rewrite)."""
        return f"{self.path}.experts" if self.kind == "mixtral" else self.path

    def __str__(self) -> str:
        renamed = f", {len(self.renames)} tensors renamed" if self.renames else ""
        return f'"{self.path}": experts({self.kind}, {self.experts}{renamed})'


@dataclass(frozen=True)
class LayoutPlan:
    """What the layout does to one model, as data (see the module doc).

    Attributes:
        degrees: ``(axis, size)`` for tp, pp, ep, dp (the mesh it was planned for; checked when applied).
        sequence_parallel / virtual_stages / schedule: the options it was planned with.
        blocks_path / block_order: the container of repeated blocks and their keys in call order.
        hidden: where blocks take and return the hidden state (``position``, ``keyword``, ``tuple_out``).
        pre / post / elsewhere: the modules that run before / after / around the blocks (traced).
        input_shape: the traced example's shape (inputs must have its rank).
        block_attrs: each block's plain attributes (what a stage's stand-in for another stage's block answers,
            e.g. a hybrid's ``block_type``).
        shared_args: block arguments that are one container several blocks write and read (Gemma 4's
            ``shared_kv_states``): named when pipeline stages cannot pass it on.
        stages: block keys of every pipeline stage (empty without a pipeline); ``pipeline_hooks``: stages
            chain the user's ``pipeline_pre_blocks`` → blocks → ``pipeline_post_blocks``.
        tensor_parallel: the TP/SP styles and rewrites (``None`` at tp=1).
        experts: the expert-parallel modules.
        activation_checkpointing / data_parallel: the wrapping modes.
        context_parallel: with ``cp > 1``, the algorithm attention runs across the cp ranks: its name
            (``allgather``, ``ulysses`` or ``ring``, :attr:`cp_algorithm`), a colon, what it does.
        compile: the ``torch.compile`` backend each block is compiled with (``"none"``: eager).
        float8: the Float8 scaling recipe (``"tensorwise"``, ``"rowwise"``; ``"none"``: no Float8);
            float8_linears: the linear layers converted; float8_experts: what happens to MoE experts.
    """

    degrees: tuple[tuple[str, int], ...]
    blocks_path: str
    block_order: tuple[str, ...]
    sequence_parallel: bool = True
    virtual_stages: int = 1
    schedule: str = "1f1b"
    hidden: tuple[Optional[int], Optional[str], Optional[int]] = (0, None, None)
    pre: tuple[str, ...] = ()
    post: tuple[str, ...] = ()
    elsewhere: tuple[str, ...] = ()
    input_shape: Optional[tuple[int, ...]] = None
    block_attrs: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)
    shared_args: tuple[str, ...] = ()
    stages: tuple[tuple[str, ...], ...] = ()
    pipeline_hooks: bool = False
    tensor_parallel: Optional[TPLayout] = None
    experts: tuple[ExpertEntry, ...] = ()
    activation_checkpointing: str = "none"
    data_parallel: str = "fsdp"
    context_parallel: str = ""  # cp > 1: how attention runs across the cp ranks
    compile: str = "none"  # the torch.compile backend of every block
    float8: str = "none"  # the Float8 scaling recipe
    float8_linears: tuple[str, ...] = ()
    float8_experts: str = ""
    version: int = _VERSION

    # -- reading ----------------------------------------------------------------------------------------
    def degree(self, axis: str) -> int:
        """The planned size of one axis (``tp``, ``pp``, ``ep``, ``dp``)."""
        return dict(self.degrees).get(axis, 1)

    @property
    def cp_algorithm(self) -> str:
        """The context-parallel algorithm the plan names (``"allgather"``, ``"ulysses"``; ``""`` without cp).

        Example:
            >>> LayoutPlan(degrees=(), blocks_path="", block_order=(), context_parallel="ulysses").cp_algorithm
            'ulysses'
        """
        return plan_algorithm(self.context_parallel)

    def model_trace(self) -> ModelTrace:
        """The structural part of the trace the plan was made from (what pipeline stages need)."""
        position, keyword, tuple_out = self.hidden
        return ModelTrace(blocks_path=self.blocks_path, block_order=self.block_order,
                          hidden=HiddenArg(position=position, keyword=keyword, tuple_out=tuple_out),
                          pre=self.pre, post=self.post, elsewhere=self.elsewhere,
                          block_attrs={k: dict(v) for k, v in self.block_attrs.items()},
                          shared_args=self.shared_args)

    def source_names(self) -> dict[str, tuple[str, Optional[int]]]:
        """``{name in the user's model: (name after the expert rewrite, index along dim 0 or None)}``."""
        return {old: (new, index) for e in self.experts for old, new, index in e.renames}

    def stage_keys(self) -> dict[int, list[str]]:
        """Block keys per pipeline stage, by stage index."""
        return {s: list(keys) for s, keys in enumerate(self.stages)}

    def lines(self) -> list[str]:
        """One line per decision, TorchTitan-style: the module path in quotes, then what happens to it."""
        head = " ".join(f"{a}={n}" for a, n in self.degrees)
        out = [f"LayoutPlan {head} sp={self.sequence_parallel} schedule={self.schedule}",
               f'blocks: "{self.blocks_path}" ({len(self.block_order)})']
        for s, keys in enumerate(self.stages):
            parts = (list(self.pre) if s == 0 else []) + [_span([f"{self.blocks_path}.{k}" for k in keys])]
            parts += list(self.post) if s == len(self.stages) - 1 else []
            hooks = " (pipeline hooks)" if self.pipeline_hooks else ""
            out.append(f"stage {s}: {', '.join(parts)}{hooks}")
        tpl = self.tensor_parallel
        if tpl is not None:
            entries: list[tuple[str, str]] = [(p, str(spec)) for p, spec in tpl.styles.items()]
            for region, attrs in tpl.local_heads.items():
                whole = tpl.heads.get(region, {})
                entries += [(region, f"{a}={v} (of {whole.get(a, '?')})") for a, v in sorted(attrs.items())]
            for region, attrs in tpl.configs.items():
                entries += [(region, f"config.{a}={v}") for a, v in sorted(attrs.items())]
            for owner, lists in tpl.head_lists.items():
                entries += [(f"{owner}.{c}", f"per-head list {list(s)}") for c, s in lists.items()]
            for owner, params in tpl.head_params.items():
                entries += [(f"{owner}.{c}", f"per-head slices {list(s)}") for c, s in params.items()]
            for owner, inputs in tpl.head_inputs.items():
                entries += [(owner, f"per-head input {k!r}: {h} heads {list(s)}") for k, (h, s) in inputs.items()]
            for owner, cuts in tpl.feature_inputs.items():
                entries += [(owner, f"input {k!r} cut to {w}/tp features") for k, w in cuts.items()]
            for fqn, (perm, dim) in tpl.permutations.items():
                entries.append((fqn, f"rows permuted along dim {dim} ({len(perm)} rows)"))
            entries += [(name, "replicated, gradient summed over tp") for name in tpl.partial_params]
            if tpl.boundary is not None:
                entries += [(tpl.boundary[0], "sequence cut on entry"), (tpl.boundary[1], "sequence gathered on exit")]
            out += [f'"{p}": {what}' for p, what in sorted(entries, key=_module_order)]
            out.append(f"loss parallel: {tpl.loss_parallel}")
        out += [str(e) for e in self.experts]
        if self.context_parallel:
            out.append(f"context parallel: {self.context_parallel}")
        out.append(f"activation checkpointing: {self.activation_checkpointing}")
        if self.float8 != "none":
            out += [f'"{name}": Float8Linear({self.float8})' for name in self.float8_linears]
            out += [f"float8 experts: {self.float8_experts}"] if self.float8_experts else []
        if self.compile != "none":
            out.append(f"compile: each block, torch.compile(backend={self.compile!r}, fullgraph where it holds), "
                       f"after activation checkpointing, before data parallelism")
        out.append(f"data parallel: {self.data_parallel}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def summary(self) -> str:
        """One line for the log: degrees, blocks, stages, how many modules each style takes, experts."""
        counts: dict[str, int] = {}
        for spec in (self.tensor_parallel.styles.values() if self.tensor_parallel else ()):
            counts[spec.kind] = counts.get(spec.kind, 0) + 1
        styles = ", ".join(f"{k}×{n}" for k, n in sorted(counts.items())) or "no TP styles"
        stages = f", {len(self.stages)} stages of {'/'.join(str(len(s)) for s in self.stages)} blocks" \
            if self.stages else ""
        return (f"layout plan {' '.join(f'{a}={n}' for a, n in self.degrees)}: {len(self.block_order)} blocks at "
                f"{self.blocks_path!r}{stages}; {styles}; {len(self.experts)} expert module(s)")

    # -- files --------------------------------------------------------------------------------------------
    def to_data(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_data`)."""
        data: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "tensor_parallel":
                data[f.name] = None if value is None else _tp_to_data(value)
            elif f.name == "experts":
                data[f.name] = [dataclasses.asdict(e) for e in value]
            elif f.name == "degrees":
                data[f.name] = dict(value)
            elif f.name == "shared_args" and not value:
                continue  # rare: written only when present
            else:
                data[f.name] = _lists(value)
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> "LayoutPlan":
        """The inverse of :meth:`to_data`; an unknown field or version is a clear error."""
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise ValueError(f"layout plan: unknown field(s) {extra}; known: {sorted(known)}")
        if data.get("version", _VERSION) != _VERSION:
            raise ValueError(f"layout plan version {data['version']} is not {_VERSION}: re-plan with this version")
        kw: dict[str, Any] = {}
        for name, value in data.items():
            if name == "tensor_parallel":
                kw[name] = None if value is None else _tp_from_data(value)
            elif name == "experts":
                kw[name] = tuple(ExpertEntry(**{**e, "renames": tuple(tuple(r) for r in e.get("renames", ()))})
                                 for e in value)
            elif name == "degrees":
                kw[name] = tuple((str(a), int(n)) for a, n in value.items())
            elif name in ("stages",):
                kw[name] = tuple(tuple(s) for s in value)
            elif isinstance(value, list):
                kw[name] = tuple(value)
            else:
                kw[name] = value
        return cls(**kw)

    def to_json(self) -> str:
        """The plan as JSON text (indented, keys in plan order)."""
        return json.dumps(self.to_data(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "LayoutPlan":
        """A plan from :meth:`to_json`'s text."""
        return cls.from_data(json.loads(text))

    def save(self, path: Union[str, Path]) -> Path:
        """Write :meth:`to_json` to ``path``; returns it."""
        path = Path(path)
        path.write_text(self.to_json() + "\n")
        return path

    # -- checks -------------------------------------------------------------------------------------------
    def check(self, module: "nn.Module", dims: "ParallelDims", options: Optional[PlanOptions] = None) -> None:
        """Refuse, naming the value, a plan that does not fit ``module``, the mesh or the run's ``options``: a degree
        that differs, a schedule, stages per rank, data-parallel mode, activation checkpointing or (asked for by
        name) context-parallel algorithm other than the options' (:meth:`check_options`), a path that is not a
        module of the model, a style that does not exist, stages that do not cover the blocks once each in order.
        Pure; the same on every rank.

        Example:
            >>> from torch import nn
            >>> from lightning_4d.mesh import ParallelDims
            >>> plan = LayoutPlan(degrees=(("tp", 2),), blocks_path="0", block_order=("0",))
            >>> plan.check(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])), ParallelDims(world_size=1))
            Traceback (most recent call last):
            ...
            ValueError: layout plan: it was made for tp=2 but this run has tp=1. Re-plan for this mesh (drop the plan option) or run with tp=2.
        """
        for axis, planned in self.degrees:
            have = getattr(dims, axis)
            if have != planned:
                raise ValueError(f"layout plan: it was made for {axis}={planned} but this run has {axis}={have}. "
                                 f"Re-plan for this mesh (drop the plan option) or run with {axis}={planned}.")
        if self.sequence_parallel != dims.sequence_parallel and dims.tp > 1:
            raise ValueError(f"layout plan: sequence_parallel={self.sequence_parallel} in the plan, "
                             f"{dims.sequence_parallel} in this run; make them agree")
        if (self.cp_algorithm != "") != (dims.cp > 1):  # an unknown algorithm names itself
            raise ValueError(f"layout plan: context_parallel={self.context_parallel!r} with cp={dims.cp}: name an "
                             f"algorithm (allgather, ulysses) exactly when cp > 1. Re-plan for this mesh.")
        if options is not None:
            self.check_options(options, dims)
        names = dict(module.named_modules())
        if self.blocks_path not in names:
            raise ValueError(f"layout plan: blocks_path {self.blocks_path!r} is not a module of "
                             f"{type(module).__name__}")
        container = names[self.blocks_path]
        keys = [k for k, _ in container.named_children()]
        if sorted(keys) != sorted(self.block_order):
            raise ValueError(f"layout plan: blocks {list(self.block_order)} but {self.blocks_path} holds {keys}")
        if self.stages:
            flat = [k for s in self.stages for k in s]
            if flat != list(self.block_order) or any(not s for s in self.stages):
                raise ValueError(f"layout plan: stages {[list(s) for s in self.stages]} must hold every block of "
                                 f"{list(self.block_order)} once, in order, at least one per stage")
            if len(self.stages) != dims.pp * dims.virtual_stages:
                raise ValueError(f"layout plan: {len(self.stages)} stages, but pp·virtual_stages = "
                                 f"{dims.pp * dims.virtual_stages}")
        tpl = self.tensor_parallel
        for path, spec in (tpl.styles.items() if tpl is not None else ()):
            if path not in names:
                raise ValueError(f"layout plan: {path!r} (style {spec}) is not a module of {type(module).__name__}")
            spec.build()  # an unknown style or option names itself
        for entry in self.experts:
            if entry.path not in names:
                raise ValueError(f"layout plan: expert module {entry.path!r} is not a module of "
                                 f"{type(module).__name__}")

    def check_options(self, options: PlanOptions, dims: "ParallelDims") -> None:
        """Refuse a run whose options disagree with the plan, naming both values: what applying the plan does is
        the plan's (the pipeline schedule and stages per rank with ``pp > 1``, the data-parallel mode, activation
        checkpointing; the context-parallel algorithm when the options name one rather than ``"auto"``), so an
        option the plan would silently override — and a check made for the option but not the plan (the V-shaped
        schedules' refusal of tied weights) — cannot slip by. Pure.

        Example:
            >>> from types import SimpleNamespace
            >>> from lightning_4d.mesh import ParallelDims
            >>> plan = LayoutPlan(degrees=(("pp", 2),), blocks_path="l", block_order=("0", "1"))
            >>> plan.check_options(SimpleNamespace(schedule="zbv", data_parallel="fsdp", activation_checkpointing=None,
            ...                                    cp_algorithm="auto"), ParallelDims(world_size=2, pp=2))
            Traceback (most recent call last):
            ...
            ValueError: layout plan: it was made for schedule='1f1b' but this run's options say schedule='zbv'. Run with schedule='1f1b' (as the plan was made) or re-plan for schedule='zbv' (drop the plan option).
        """
        from lightning_4d.speed.compile import compile_backend

        checkpointing = options.activation_checkpointing or "none"
        pairs = [("data_parallel", self.data_parallel, options.data_parallel),
                 ("activation_checkpointing", self.activation_checkpointing, checkpointing),
                 ("compile", self.compile, compile_backend(getattr(options, "compile", False)) or "none"),
                 ("float8", self.float8,
                  getattr(options, "float8_recipe", "tensorwise") if getattr(options, "float8", False) else "none")]
        if dims.pp > 1:
            pairs = [("schedule", self.schedule, options.schedule),
                     ("virtual_stages", self.virtual_stages, dims.virtual_stages)] + pairs
        if dims.cp > 1 and options.cp_algorithm != "auto":
            pairs.append(("cp_algorithm", self.cp_algorithm, options.cp_algorithm))
        for name, planned, asked in pairs:
            if planned != asked:
                shown = (lambda v: repr(None if v == "none" else v)) if name == "activation_checkpointing" else repr
                raise ValueError(f"layout plan: it was made for {name}={shown(planned)} but this run's options say "
                                 f"{name}={shown(asked)}. Run with {name}={shown(planned)} (as the plan was made) or "
                                 f"re-plan for {name}={shown(asked)} (drop the plan option).")

    # -- editing ------------------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> "LayoutPlan":
        """A copy with some fields changed (the plan itself never changes)."""
        return dataclasses.replace(self, **changes)

    def without_styles(self, prefix: str) -> "LayoutPlan":
        """A copy in which the modules at or under ``prefix`` keep their weights whole (no TP style, no head
        rewrite): e.g. one MLP replicated instead of sharded.

        Example:
            >>> plan = LayoutPlan(degrees=(), blocks_path="l", block_order=("0",),
            ...                   tensor_parallel=TPLayout(styles={"l.0.mlp.w1": StyleSpec("Colwise")}))
            >>> plan.without_styles("l.0.mlp").tensor_parallel.styles
            {}
        """
        if self.tensor_parallel is None:
            raise ValueError("without_styles: this plan has no tensor-parallel styles (tp=1): nothing is sharded")
        keep = lambda p: not (p == prefix or p.startswith(prefix + "."))  # noqa: E731
        return self.replace(tensor_parallel=_filter_tp(self.tensor_parallel, keep, lambda p: p))

    def for_blocks(self, kept: list[str], renamed: dict[str, str], parts: list[list[int]]) -> "LayoutPlan":
        """The plan of a copy of the model reduced to the blocks ``kept`` (old keys, in call order), renamed by
        ``renamed`` (old key → new key), with ``parts`` the positions in ``kept`` of every pipeline stage: what
        the set-up check applies to its reduced copy instead of tracing it again.

        Example:
            >>> plan = LayoutPlan(degrees=(), blocks_path="l", block_order=("0", "1", "2"), stages=(("0",), ("1", "2")))
            >>> reduced = plan.for_blocks(["0", "2"], {"0": "0", "2": "1"}, [[0], [1]])
            >>> reduced.block_order, reduced.stages
            (('0', '1'), (('0',), ('1',)))
        """
        base = self.blocks_path + "."

        def rename(path: str) -> Optional[str]:
            if not path.startswith(base):
                return path
            key, _, rest = path[len(base):].partition(".")
            if key not in renamed:
                return None
            return base + renamed[key] + (f".{rest}" if rest else "")

        order = tuple(renamed[k] for k in kept)
        new_stages = tuple(tuple(order[i] for i in idx) for idx in parts) if self.stages else ()
        tpl = self.tensor_parallel
        experts = tuple(dataclasses.replace(e, path=p) for e in self.experts if (p := rename(e.path)) is not None)
        ends = (f"{self.blocks_path}.{order[0]}", f"{self.blocks_path}.{order[-1]}")
        return self.replace(block_order=order, stages=new_stages, experts=experts,
                            block_attrs={renamed[k]: v for k, v in self.block_attrs.items() if k in renamed},
                            tensor_parallel=None if tpl is None else _filter_tp(tpl, lambda p: rename(p) is not None,
                                                                                 lambda p: rename(p) or p, ends))


def _module_order(item: tuple[str, str]) -> tuple:
    # numeric block keys sort as numbers: layers.2 before layers.10
    return tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in item[0].split(".")), item[1]


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def _lists(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_lists(v) for v in value]
    return value


def _slices(s: Any) -> list[tuple[int, int]]:
    return [tuple(x) for x in s]  # type: ignore[misc]


def _tp_to_data(tpl: TPLayout) -> dict[str, Any]:
    return {
        "styles": {p: spec.to_data(p) for p, spec in tpl.styles.items()},
        "heads": tpl.heads, "local_heads": tpl.local_heads, "configs": tpl.configs,
        "head_lists": {o: {c: [list(x) for x in s] for c, s in d.items()} for o, d in tpl.head_lists.items()},
        "head_params": {o: {c: [list(x) for x in s] for c, s in d.items()} for o, d in tpl.head_params.items()},
        "head_inputs": {o: [[k, h, [list(x) for x in s]] for k, (h, s) in d.items()]
                        for o, d in tpl.head_inputs.items()},
        "regions": tpl.regions, "loss_parallel": tpl.loss_parallel,
        "permutations": {f: [list(perm), dim] for f, (perm, dim) in tpl.permutations.items()},
        "partial_params": list(tpl.partial_params),
        "boundary": None if tpl.boundary is None else list(tpl.boundary),
        "hidden": dataclasses.asdict(tpl.hidden),
        "user_plan": tpl.user_plan,
        **({"feature_inputs": {o: [[k, w] for k, w in d.items()] for o, d in tpl.feature_inputs.items()}}
           if tpl.feature_inputs else {}),
    }


def _tp_from_data(d: dict[str, Any]) -> TPLayout:
    return TPLayout(
        styles={p: StyleSpec.from_data(s) for p, s in d["styles"].items()},
        heads={r: dict(a) for r, a in d["heads"].items()},
        local_heads={r: dict(a) for r, a in d["local_heads"].items()},
        configs={r: dict(a) for r, a in d["configs"].items()},
        head_lists={o: {c: _slices(s) for c, s in x.items()} for o, x in d["head_lists"].items()},
        head_params={o: {c: _slices(s) for c, s in x.items()} for o, x in d["head_params"].items()},
        head_inputs={o: {k: (int(h), _slices(s)) for k, h, s in x} for o, x in d["head_inputs"].items()},
        regions={b: list(r) for b, r in d["regions"].items()},
        loss_parallel=bool(d["loss_parallel"]),
        permutations={f: (list(perm), int(dim)) for f, (perm, dim) in d["permutations"].items()},
        partial_params=list(d["partial_params"]),
        boundary=None if d["boundary"] is None else (d["boundary"][0], d["boundary"][1]),
        hidden=HiddenArg(**d["hidden"]),
        user_plan=bool(d.get("user_plan", False)),
        feature_inputs={o: {k: int(w) for k, w in x} for o, x in d.get("feature_inputs", {}).items()},
    )


def _filter_tp(tpl: TPLayout, keep: Any, rename: Any,
               blocks: Optional[tuple[str, str]] = None) -> TPLayout:
    """A copy of ``tpl`` with the entries whose module path ``keep`` rejects dropped, the others renamed;
    ``blocks``: the (first, last) block of a reduced model, which cut and gather the sequence (SP) instead."""

    def by_path(d: dict[str, Any]) -> dict[str, Any]:
        return {rename(p): v for p, v in d.items() if keep(p)}

    boundary = tpl.boundary
    if boundary is not None:
        boundary = blocks or (rename(boundary[0]), rename(boundary[1]))
    return TPLayout(
        styles=by_path(tpl.styles), heads=by_path(tpl.heads), local_heads=by_path(tpl.local_heads),
        configs=by_path(tpl.configs), head_lists=by_path(tpl.head_lists), head_params=by_path(tpl.head_params),
        head_inputs=by_path(tpl.head_inputs), feature_inputs=by_path(tpl.feature_inputs),
        regions={rename(b): [r for r in regs if keep(f"{b}.{r}")] for b, regs in tpl.regions.items() if keep(b)},
        # the vocabulary-parallel head (a torch ColwiseParallel outside the blocks) makes the loss parallel
        loss_parallel=tpl.loss_parallel and all(keep(p) for p, s in tpl.styles.items() if s.kind == "ColwiseParallel"),
        permutations={rename(f): v for f, v in tpl.permutations.items() if keep(f.rpartition(".")[0])},
        partial_params=[rename(n) for n in tpl.partial_params if keep(n.rpartition(".")[0])],
        boundary=boundary, hidden=tpl.hidden, user_plan=tpl.user_plan,
    )


def load_plan(value: Union[str, Path, LayoutPlan]) -> LayoutPlan:
    """A plan given as a :class:`LayoutPlan`, or a path to its JSON file; a missing file names itself.

    Example:
        >>> load_plan("no/such/plan.json")
        Traceback (most recent call last):
        ...
        ValueError: layout plan file 'no/such/plan.json' does not exist; write one with LayoutPlan.save or take the layout_plan.json a recipe run wrote
    """
    if isinstance(value, LayoutPlan):
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"layout plan file '{value}' does not exist; write one with LayoutPlan.save or take the "
                         f"{PLAN_FILE} a recipe run wrote")
    return LayoutPlan.from_json(path.read_text())
