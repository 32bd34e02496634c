"""Expert parallelism for a model's *own* experts module, in place: transformers 5 and TorchTitan style.

Modern MoE code keeps the experts of a layer in one module holding 3-D parameters ``[E, ...]`` (transformers 5
``experts.gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]``, TorchTitan ``w1 w2 w3``), next to a router
holding an ``(E, H)`` weight. Such a module is recognised *by structure* (:func:`inspect_experts`) and its
forward is one of three contracts, told apart by its signature:

- ``"assignments"`` (transformers): ``experts(hidden (N, H), top_k_index (N, k), top_k_weights (N, k)) -> (N, H)``,
  the weighted sum over each token's ``k`` experts;
- ``"grouped"`` (TorchTitan): ``experts(x (M, H) sorted by expert, num_tokens_per_expert (E,)) -> (M, H)``;
- ``"dense"`` (Llama 4): ``experts(x (E·N, H)) -> (E·N, H)``, every expert on every token (rows expert-major, the
  router's scores already applied by the layer): the grouped contract with ``N`` tokens per expert.

:func:`install_expert_parallel` keeps the module, its class (a subclass is swapped in, as FSDP2 does), its
parameter names and the checkpoint layout: parameters become DTensors ``Shard(0)`` over the ep mesh (global
shape ``[E, ...]``), and the forward sends each assignment to the rank owning its expert (all-to-all), runs the
*user's own forward* there on the local experts (the parameters temporarily replaced by their local shards,
expert ids made local), and sends the results back. The router, shared experts and everything else of the
model are untouched, so routing (ties, grouping, correction bias, normalisation, router dtype) is exactly the
model's. Before anything is sharded, :func:`verify_experts` replays that scheme in one process on random
tokens and compares with the plain forward, so a forward that does not fit the contract fails at setup with
the module's name, never silently.

Example:
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> model = MixtralForCausalLM(MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_local_experts=4))
    >>> specs, rejected = find_expert_modules(model)
    >>> [s.name for s in specs][:1], specs[0].contract, rejected
    (['model.layers.0.mlp.experts'], 'assignments', [])
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_4d import _compat
from lightning_4d.expert_parallel.dispatch import combine, dispatch
from lightning_4d.expert_parallel.experts import GroupedExperts, local_tensor, scale_grad
from lightning_4d.expert_parallel.permute import expert_counts, make_permutation, permute, unpermute
from lightning_4d.expert_parallel.zero_experts import two_sizes_reason, zero_expert_router
from lightning_4d.analysis.layer_kinds import holds_stacked_experts
from lightning_4d.core.precision import allowed_difference, max_difference

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ExpertsSpec", "inspect_experts", "find_expert_modules", "verify_experts", "install_expert_parallel",
           "is_inplace_experts", "Contract"]

Contract = Literal["assignments", "grouped", "dense"]
_COUNT_ATTR_HINTS = ("expert",)  # int attributes equal to E whose name contains this are made local too


@dataclass
class ExpertsSpec:
    """A recognised experts module (see the module docstring).

    Attributes:
        name: its qualified name in the model.
        contract: ``"assignments"`` or ``"grouped"``.
        num_experts: ``E`` (dim 0 of every parameter).
        params: names of its parameters (all ``[E, ...]``).
        count_attrs: int attributes equal to ``E`` (``num_experts``...), set to ``E/ep`` during the local call.
        router: where the ``(E, H)`` router weight is, relative to the parent (``../`` per level up).
        zero_experts: ``Z``, the router's rows beyond ``E`` (LongCat-Flash's zero experts: identities the layer
            computes itself, outside this module, mapping their assignments to weight-0 ids in ``[0, E)``); 0 when
            the router has exactly ``E`` rows.
    """

    name: str
    contract: Contract
    num_experts: int
    params: list[str]
    count_attrs: list[str] = field(default_factory=list)
    router: str = ""
    zero_experts: int = 0


@dataclass
class _State:
    spec: ExpertsSpec
    forward: Callable[..., Any]  # the user's forward (unbound)
    group: Optional[dist.ProcessGroup] = None
    ep: int = 1
    grad_scale: float = 1.0
    tokens: Optional[torch.Tensor] = None  # (E,) assignments per expert in the last forward (this rank)


def _contract(module: nn.Module) -> Optional[Contract]:
    try:
        sig = inspect.signature(type(module).forward)  # follows functools.wraps to the user's signature
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p for p in list(sig.parameters.values())[1:] if p.kind in kinds]
    required = [p for p in params if p.default is inspect.Parameter.empty]
    # GPT-OSS declares ``forward(hidden_states, router_indices=None, routing_weights=None)``.
    count = len(params) if len(params) in (2, 3) else len(required)
    return {3: "assignments", 2: "grouped", 1: "dense"}.get(count)  # type: ignore[return-value]


def inspect_experts(module: nn.Module, name: str, parent: Optional[nn.Module],
                    ancestors: tuple[nn.Module, ...] = ()) -> ExpertsSpec | str:
    """An :class:`ExpertsSpec` when ``module`` is an experts module with 3-D parameters next to a router, else
    the reason it is not one (a string). Pure.

    Rules: every direct parameter has the same leading size ``E >= 2`` and at least one is 3-D; no child module
    holds parameters; the nearest enclosing module — ``parent``, then each of ``ancestors`` (innermost first, up to
    a container of blocks) — that holds another parameter of shape ``(E, H)`` outside the experts holds the router
    (TorchTitan keeps it one level up: ``moe.router.gate`` beside ``moe.routed_experts.inner_experts``); the forward
    takes ``(hidden, top_k_index, top_k_weights)`` or ``(x, num_tokens_per_expert)``. Failing an ``(E, H)`` router,
    a router of ``E + Z`` rows in the parent is accepted when the parent records both counts as int attributes
    (LongCat-Flash: ``num_routed_experts == E``, ``zero_expert_num == Z``): its ``Z`` zero experts are identities
    the layer computes itself (see :func:`~.zero_experts.zero_expert_router`).

    Example:
        >>> class Experts(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w1 = nn.Parameter(torch.zeros(4, 16, 8))
        ...     def forward(self, x, num_tokens_per_expert): ...
        >>> class Moe(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.gate, self.experts = nn.Linear(8, 4, bias=False), Experts()
        >>> moe = Moe(); spec = inspect_experts(moe.experts, "experts", moe)
        >>> spec.contract, spec.num_experts, spec.router
        ('grouped', 4, 'gate')
    """
    own = dict(module.named_parameters(recurse=False))
    if not own or not any(p.dim() == 3 for p in own.values()):
        return "it has no 3-D parameter [E, ...]"
    sizes = {p.shape[0] for p in own.values()}
    if len(sizes) == 2 and all(p.dim() == 3 for p in own.values()):
        return two_sizes_reason(own)
    if len(sizes) != 1 or min(p.dim() for p in own.values()) < 2:
        shapes = {n: tuple(p.shape) for n, p in own.items()}
        return f"its parameters do not share one leading expert dimension: {shapes}"
    e = sizes.pop()
    if e < 2:
        return f"its leading dimension is {e}: a single expert is a dense layer"
    nested = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
    if nested:
        return f"its children {nested} hold parameters (only the stacked [E, ...] tensors are supported)"
    if parent is None:
        return "it has no parent module holding a router"
    router = ""
    for level, enclosing in enumerate((parent,) + tuple(ancestors)):
        if level and isinstance(enclosing, (nn.ModuleList, nn.ModuleDict)):
            break  # a container of blocks: another layer's router is not this one's
        for sub, mod in enclosing.named_modules():
            if mod is module or (mod is not enclosing and any(m is module for m in mod.modules())):
                continue
            if any(p.dim() == 2 and p.shape[0] == e for p in mod.parameters(recurse=False)):
                router = "../" * level + sub
                break
        if router:
            break
    zero = 0
    if not router:
        found = zero_expert_router(module, parent, e)
        if found is None:
            return f"no sibling holds a router weight of shape ({e}, hidden), nor a module around its parent"
        router, zero = found
    contract = _contract(module)
    if contract == "dense" and "expert" not in name.rpartition(".")[2]:
        contract = None  # a one-input forward is taken for every-token experts only where the model says so
    if contract is None:
        return ("its forward takes neither (hidden_states, top_k_index, top_k_weights), (x, num_tokens_per_expert) "
                "nor (x) with every expert's rows")
    counts = [a for a, v in vars(module).items()
              if isinstance(v, int) and not isinstance(v, bool) and v == e and any(h in a for h in _COUNT_ATTR_HINTS)]
    return ExpertsSpec(name, contract, e, list(own), counts, router, zero)


def find_expert_modules(model: nn.Module) -> tuple[list[ExpertsSpec], list[tuple[str, str]]]:
    """``(specs, rejected)``: every experts module :func:`inspect_experts` recognises, and every MoE-looking
    module (a direct parameter with 3+ dimensions) it does not, with the reason.

    Example:
        >>> find_expert_modules(nn.Linear(2, 2))
        ([], [])
    """
    parents = {id(c): m for m in model.modules() for c in m.children()}
    specs: list[ExpertsSpec] = []
    rejected: list[tuple[str, str]] = []
    for name, mod in model.named_modules():
        if is_inplace_experts(mod):
            specs.append(mod.fourd_experts.spec)  # type: ignore[union-attr]
            continue
        if not holds_stacked_experts(mod) or isinstance(mod, GroupedExperts):  # the package's own layer is handled apart
            continue
        chain: list[nn.Module] = []
        up = parents.get(id(mod))
        while up is not None and len(chain) < 4:
            chain.append(up)
            up = parents.get(id(up))
        found = inspect_experts(mod, name, chain[0] if chain else None, tuple(chain[1:]))
        if isinstance(found, str):
            rejected.append((name, found))
        else:
            specs.append(found)
    return specs, rejected


def is_inplace_experts(module: nn.Module) -> bool:
    """Whether :func:`install_expert_parallel` was applied to ``module``.

    Example:
        >>> is_inplace_experts(nn.Linear(2, 2))
        False
    """
    return isinstance(getattr(module, "fourd_experts", None), _State)


# ------------------------------------------------------------------------------------- the local call
def _call_local(module: nn.Module, st: _State, tensors: dict[str, torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """The user's forward on this rank's experts: parameters replaced by ``tensors`` (``[E/ep, ...]``) and the
    module's expert-count attributes by ``E/ep`` for the call."""
    n_local = next(iter(tensors.values())).shape[0]
    saved = {a: getattr(module, a) for a in st.spec.count_attrs}
    try:
        for a in saved:
            setattr(module, a, n_local)
        with _compat.swapped_parameters(module, tensors):
            return st.forward(module, *args)
    finally:
        for a, v in saved.items():
            setattr(module, a, v)


def _touch(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A zero that depends on every local weight, so each gets a (zero) gradient even with no tokens (as it
    does in one process, where the full ``[E, ...]`` tensor is always used)."""
    return sum(t.reshape(-1)[:1].sum() * 0 for t in tensors.values())  # type: ignore[return-value]


def _local_tensors(module: nn.Module, st: _State) -> dict[str, torch.Tensor]:
    return {n: scale_grad(local_tensor(getattr(module, n)), st.grad_scale) for n in st.spec.params}


def _assignments_forward(module: nn.Module, st: _State, hidden: torch.Tensor, idx: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    e = st.spec.num_experts
    tensors = _local_tensors(module, st)
    if st.group is None:
        with torch.no_grad():  # ids >= E (zero experts the layer computes itself) are not counted
            st.tokens = expert_counts(idx.clamp(max=e), e + 1)[:e] if st.spec.zero_experts else expert_counts(idx, e)
        return _call_local(module, st, tensors, hidden, idx, weights)  # (N, H)
    # A router of exactly E rows yields ids in [0, E), counted on the device (an id beyond is an index error). One with
    # zero experts beyond them (LongCat-Flash) must have the layer map those to ids < E: checked on the host, one
    # more sync per layer for such models only.
    top = int(idx.max()) if st.spec.zero_experts and idx.numel() else 0
    if top >= e:
        raise ValueError(
            f"experts module '{st.spec.name}' ({type(module).__bases__[-1].__name__}) received expert id "
            f"{top} but holds {e} experts (ids 0..{e - 1}); the model's layer passes it ids of experts "
            f"it does not hold (zero / identity experts the router counts: {st.spec.zero_experts}), which expert "
            f"parallelism cannot send to an owner. Fix: map such assignments in the layer to weight-0 ids in "
            f"[0, {e}) as LongCat-Flash does, "
            f"or use ep=1.")
    plan = make_permutation(idx, e)
    st.tokens = plan.routed_per_expert  # (E,)
    xs = permute(hidden, plan)  # (M, H) sorted by expert
    recv, info = dispatch(xs, plan.tokens_per_expert, st.group)  # (R, H) by local expert
    counts = info.tokens_per_local_expert  # (E/ep,)
    local_ids = torch.repeat_interleave(torch.arange(counts.numel(), device=recv.device), counts,
                                        output_size=recv.shape[0])  # (R,): the size is known, no host sync
    ones = torch.ones(recv.shape[0], 1, dtype=weights.dtype, device=recv.device)  # (R, 1)
    ys = _call_local(module, st, tensors, recv, local_ids.unsqueeze(1).to(idx.dtype), ones)  # (R, H)
    back = combine(ys + _touch(tensors).to(ys.dtype), info)  # (M, H)
    return unpermute(back, plan, weights, out_shape=hidden.shape).to(hidden.dtype)  # (N, H)


def _grouped_forward(module: nn.Module, st: _State, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    tensors = _local_tensors(module, st)
    with torch.no_grad():
        st.tokens = counts.detach().to(torch.long).clone()  # (E,)
    if st.group is None:
        return _call_local(module, st, tensors, x, counts)  # (M, H)
    recv, info = dispatch(x, counts.to(torch.long), st.group)  # (R, H) by local expert
    local_counts = info.tokens_per_local_expert.to(device=counts.device, dtype=counts.dtype)  # (E/ep,)
    ys = _call_local(module, st, tensors, recv, local_counts)  # (R, H)
    return combine(ys + _touch(tensors).to(ys.dtype), info)  # (M, H)


def _dense_forward(module: nn.Module, st: _State, x: torch.Tensor) -> torch.Tensor:
    e = st.spec.num_experts
    counts = torch.full((e,), x.shape[0] // e, dtype=torch.long, device=x.device)  # (E,) N tokens each
    tensors = _local_tensors(module, st)
    with torch.no_grad():
        st.tokens = counts.clone()
    if st.group is None:
        return _call_local(module, st, tensors, x)  # (E·N, H)
    recv, _info = dispatch(x, counts, st.group)  # (E/ep · ep·N, H): this rank's experts, every rank's tokens
    ys = _call_local(module, st, tensors, recv)
    return combine(ys + _touch(tensors).to(ys.dtype), _info)  # (E·N, H)


def _bind(module: nn.Module, st: _State, args: tuple, kwargs: dict) -> list[Any]:
    if not kwargs:
        return list(args)
    sig = inspect.signature(st.forward)
    bound = sig.bind(module, *args, **kwargs)
    return list(bound.args[1:])


class _InPlaceExperts:
    """Mixin swapped into the class of an installed experts module (see :func:`install_expert_parallel`)."""

    fourd_experts: _State

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        st = self.fourd_experts
        values = _bind(self, st, args, kwargs)  # type: ignore[arg-type]
        if st.spec.contract == "assignments":
            return _assignments_forward(self, st, *values[:3])  # type: ignore[arg-type]
        if st.spec.contract == "dense":
            return _dense_forward(self, st, values[0])  # type: ignore[arg-type]
        return _grouped_forward(self, st, *values[:2])  # type: ignore[arg-type]

    @property
    def fourd_tokens_per_expert(self) -> Optional[torch.Tensor]:
        """Assignments per expert ``(E,)`` routed by this rank in the last forward (``None`` before one)."""
        return self.fourd_experts.tokens


_CLASSES: dict[type, type] = {}


def _subclass(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (_InPlaceExperts, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


# ------------------------------------------------------------------------------------------- set-up
@torch.no_grad()
def verify_experts(module: nn.Module, spec: ExpertsSpec, parts: int = 2) -> None:
    """Replay the expert-parallel scheme for ``parts`` ranks in one process on random tokens and compare with the
    plain forward; raise ``ValueError`` naming the module when they differ (or the forward fails). Skipped for
    meta parameters. Uses its own random generator (the global RNG is untouched).

    Example:
        >>> class Experts(nn.Module):  # TorchTitan style: rows sorted by expert
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.randn(4, 8, 8))
        ...     def forward(self, x, num_tokens_per_expert):
        ...         return x @ self.w[0]  # every row through expert 0: not a per-assignment sum
        >>> class Moe(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.gate, self.experts = nn.Linear(8, 4, bias=False), Experts()
        >>> moe = Moe()
        >>> verify_experts(moe.experts, inspect_experts(moe.experts, "mlp.experts", moe), parts=2)
        Traceback (most recent call last):
        ...
        ValueError: experts module 'mlp.experts' (Experts): running its experts in 2 groups ... does not reproduce...
    """
    params = {n: getattr(module, n) for n in spec.params}
    first = next(iter(params.values()))
    if first.is_meta or type(first.data) is not torch.Tensor:
        return
    e, parts = spec.num_experts, max(1, min(parts, spec.num_experts))
    if e % parts:
        return  # the ep check reports this with the layout's numbers
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden_dim = _hidden_size(module, spec)
    n, k = 7, min(2, e)
    hidden = torch.randn(n, hidden_dim, generator=gen).to(device=first.device, dtype=first.dtype)  # (N, H)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).to(first.device)  # (N, k)
    st = _State(spec, type(module).forward)
    what = {"assignments": "(hidden_states, top_k_index, top_k_weights)", "grouped": "(x, num_tokens_per_expert)",
            "dense": "(x) with N rows per expert, expert-major"}[spec.contract]
    try:
        if spec.contract == "assignments":
            weights = torch.rand(n, k, generator=gen).to(first.device)  # (N, k) fp32 like the routers'
            ref = st.forward(module, hidden, idx, weights)
            got = torch.zeros_like(ref)
            for r in range(parts):
                lo, hi = r * e // parts, (r + 1) * e // parts
                tok, slot = torch.nonzero((idx >= lo) & (idx < hi), as_tuple=True)
                local = {n_: p.detach()[lo:hi] for n_, p in params.items()}
                ones = torch.ones(tok.numel(), 1, dtype=weights.dtype, device=first.device)
                ys = _call_local(module, st, local, hidden[tok], (idx[tok, slot] - lo).unsqueeze(1), ones)
                got.index_add_(0, tok, (ys * weights[tok, slot].unsqueeze(1)).to(got.dtype))
        elif spec.contract == "dense":
            x = torch.randn(e * n, hidden_dim, generator=gen).to(device=first.device, dtype=first.dtype)  # (E·N, H)
            ref = st.forward(module, x)
            got = torch.cat([_call_local(module, st, {n_: p.detach()[r * e // parts:(r + 1) * e // parts]
                                                      for n_, p in params.items()},
                                         x[r * e // parts * n:(r + 1) * e // parts * n]) for r in range(parts)])
        else:
            counts = torch.bincount(idx.reshape(-1), minlength=e)  # (E,)
            x = hidden[torch.sort(idx.reshape(-1), stable=True).indices // k]  # (M, H) sorted by expert
            ref = st.forward(module, x, counts)
            outs, start = [], 0
            for r in range(parts):
                lo, hi = r * e // parts, (r + 1) * e // parts
                m = int(counts[lo:hi].sum())
                local = {n_: p.detach()[lo:hi] for n_, p in params.items()}
                outs.append(_call_local(module, st, local, x[start:start + m], counts[lo:hi]))
                start += m
            got = torch.cat(outs)
    except Exception as err:  # noqa: BLE001 - reported with the module's name
        raise ValueError(
            f"experts module '{spec.name}' ({type(module).__name__}) was recognised as taking {what}, but running "
            f"its forward on a subset of its experts failed ({type(err).__name__}: {err}). Expert parallelism runs "
            f"each rank's experts through that forward. Fix: make the forward work on any number of experts "
            f"(read E from the parameters), or give the model lightning_4d.expert_parallel.MoE layers.") from err
    diff, scale = max_difference(got, ref) or (0.0, 0.0)
    if diff > allowed_difference(ref, scale):
        raise ValueError(
            f"experts module '{spec.name}' ({type(module).__name__}): running its experts in {parts} groups (as "
            f"expert parallelism does) does not reproduce its forward on random tokens (max abs difference "
            f"{diff:.2e}, allowed {allowed_difference(ref, scale):.2e}), so its forward is not a per-assignment sum over {what}. Fix: use ep=1 for this "
            f"model, or give it lightning_4d.expert_parallel.MoE layers.")


def _hidden_size(module: nn.Module, spec: ExpertsSpec) -> int:
    for attr in ("hidden_dim", "hidden_size", "dim"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    # The smallest non-expert dimension of the 3-D weights: the hidden size of up/down projections.
    return min(d for n in spec.params for d in getattr(module, n).shape[1:] if getattr(module, n).dim() == 3)


def install_expert_parallel(module: nn.Module, spec: ExpertsSpec, ep_mesh: Optional[DeviceMesh] = None,
                            grad_scale: float = 1.0) -> None:
    """Make ``module`` (recognised as ``spec``) expert-parallel in place: its parameters become DTensors
    ``Shard(0)`` over ``ep_mesh`` (names and global shapes unchanged; nothing is sharded when ``ep_mesh`` is
    ``None`` or of size 1) and its forward dispatches assignments to the experts' owners. ``grad_scale``
    multiplies the experts' gradients (see :func:`~.parallel.expert_grad_scale`). Issues no collective.

    Example:
        >>> # not run: needs a process group
        >>> install_expert_parallel(model.get_submodule(spec.name), spec, mesh["ep"], grad_scale=0.5)  # doctest: +SKIP
    """
    from torch.distributed.tensor import DTensor, Shard

    if is_inplace_experts(module):
        raise ValueError(f"experts module '{spec.name}' already has expert parallelism installed")
    st = _State(spec, type(module).forward, grad_scale=grad_scale)
    ep = ep_mesh.size() if ep_mesh is not None else 1
    if ep > 1:
        if spec.num_experts % ep:
            raise ValueError(f"experts module '{spec.name}': num_experts={spec.num_experts} is not divisible by ep={ep}")
        n_local = spec.num_experts // ep
        first = ep_mesh.get_local_rank() * n_local
        for name in spec.params:
            p = getattr(module, name)
            if isinstance(p.data, DTensor):
                raise ValueError(f"experts module '{spec.name}': parameter {name} is already a DTensor")
            local = p.detach()[first:first + n_local].clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        st.group, st.ep = ep_mesh.get_group(), ep
    module.__class__ = _subclass(type(module))
    module.fourd_experts = st  # type: ignore[assignment]
