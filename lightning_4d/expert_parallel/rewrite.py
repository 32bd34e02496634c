"""Find mixture-of-experts blocks in a user model and replace Mixtral-style ones by :class:`~.moe.MoE`.

A Mixtral-style block has a bias-free ``gate`` ``nn.Linear(H, E)`` and an ``experts`` ``nn.ModuleList`` of
``E`` identical SwiGLU MLPs, whatever their linears are called (Mixtral's ``w1 w2 w3``, Hugging Face's
``gate_proj down_proj up_proj``, LitGPT's ``fc_1 proj fc_2``: told apart by shape and by which output goes
through the activation, :func:`~.expert_lists.swiglu_roles`); its top-k is the ``k`` of its own ``torch.topk``
over the router's scores, else an attribute of the block or its ``config`` (:func:`~.expert_lists.layer_top_k`).
Its math: ``softmax(gate(x))`` over all experts in fp32 -> top-k -> renormalise (unless the block has
``norm_topk_prob = False``; LitGPT's ``softmax(topk(gate(x)))`` is the same) -> ``Σ w_j · expert_j(x)``.
Expert parallelism rewrites a block only when ``ep > 1``: otherwise it runs as written. The replacement computes exactly this (no aux
loss, no bias), with the weights copied into the stacked layout. An optional ``shared_expert(s)``
SwiGLU child is kept as the shared experts. Each replacement records ``source_key_map`` (e.g.
``"experts.3.w1.weight" -> ("experts.w1", 3)``) used by :func:`export_original_state_dict` and
:func:`convert_original_state_dict` to translate checkpoints between the two namings.

When the block's parameters are materialised, the rewrite runs both blocks on a few random tokens and
raises if they disagree (e.g. a different activation), naming the module.

Example:
    >>> class Expert(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w1, self.w2, self.w3 = nn.Linear(8, 16, False), nn.Linear(16, 8, False), nn.Linear(8, 16, False)
    ...     def forward(self, x):
    ...         return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))
    >>> class Block(nn.Module):  # forward omitted: only names are needed to detect it
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gate, self.top_k = nn.Linear(8, 4, False), 2
    ...         self.experts = nn.ModuleList(Expert() for _ in range(4))
    >>> [name for name, _ in find_moe_modules(nn.Sequential(Block()))]
    ['0']
    >>> net = rewrite_moe_modules(nn.Sequential(Block()), verify=False)  # verify=True also runs both forwards
    >>> type(net[0]).__name__, sorted(export_original_state_dict(net))[:2]
    ('MoE', ['0.experts.0.w1.weight', '0.experts.0.w2.weight'])
    >>> net.load_state_dict(convert_original_state_dict(net, export_original_state_dict(net)))
    <All keys matched successfully>
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_4d.expert_parallel.expert_lists import TOP_K_NAMES, layer_top_k, swiglu_roles
from lightning_4d.expert_parallel.moe import MoE
from lightning_4d.analysis.layer_kinds import is_expert_list
from lightning_4d.core.precision import allowed_difference, max_difference

__all__ = ["source_names", "find_moe_modules", "mixtral_source_keys", "moe_from_mixtral", "rewrite_moe_modules",
           "export_original_state_dict", "convert_original_state_dict"]

_NAMINGS = (("w1", "w2", "w3"), ("gate_proj", "down_proj", "up_proj"))  # as (w1, w2, w3)
_SHARED = ("shared_experts", "shared_expert")


def find_moe_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every :class:`~.moe.MoE` and Mixtral-style (MoE-like) block, outermost only.

    Example:
        >>> find_moe_modules(nn.Sequential(MoE(8, 16, 4, 2), nn.Linear(8, 8)))[0][0]
        '0'
    """
    found: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p, _ in found if p) or (found and found[0][0] == ""):
            continue
        if isinstance(mod, MoE) or is_expert_list(mod):
            found.append((name, mod))
    return found


def _fail(name: str, why: str, fix: str = "") -> ValueError:
    return ValueError(
        f"MoE-like module '{name}' cannot be made expert-parallel (ep > 1 replaces it by lightning_4d's MoE layer): "
        f"{why}. What the rewrite needs: a bias-free `gate` Linear(H, E); an `experts` ModuleList of E identical "
        f"SwiGLU MLPs w2(silu(w1 x) * w3 x) without biases, whatever the linears are called; its top-k as the k of "
        f"its forward's torch.topk over the E router scores, or an int attribute of the module or its `config` "
        f"({' / '.join(TOP_K_NAMES[:3])}). Fix: {fix + '; or ' if fix else ''}build the layer with "
        f"lightning_4d.expert_parallel.MoE(dim, hidden_dim, num_experts, top_k); or use ep=1 (the layer then runs "
        f"as written under every other layout).")


def _swiglu_names(mlp: nn.Module) -> Optional[tuple[str, str, str]]:
    for names in _NAMINGS:  # the known conventions, told by name (no forward needed)
        if all(isinstance(getattr(mlp, n, None), nn.Linear) for n in names):
            return names
    roles = swiglu_roles(mlp)
    return roles if isinstance(roles, tuple) else None


def _check_mlp(name: str, mlp: nn.Module, names: tuple[str, str, str]) -> None:
    lins = [getattr(mlp, n) for n in names]
    if any(lin.bias is not None for lin in lins):
        raise _fail(name, "an expert Linear has a bias")
    act = getattr(mlp, "act_fn", None)
    if act is not None and not (isinstance(act, nn.SiLU) or act is torch.nn.functional.silu
                                or type(act).__name__ in ("SiLU", "SiLUActivation")):
        raise _fail(name, f"the expert activation is {act!r}, not SiLU")
    own = {id(p) for lin in lins for p in lin.parameters()}
    extra = [n for n, p in mlp.named_parameters() if id(p) not in own]
    if extra:
        raise _fail(name, f"an expert has parameters besides its three projections: {extra}")


def mixtral_source_keys(block: nn.Module) -> dict[str, tuple[str, Optional[int]]]:
    """The rename :func:`moe_from_mixtral` makes, without building anything: ``{name in the block: (name in the
    MoE layer, index along dim 0 or None)}`` (experts stacked per projection). Empty for a block whose experts are
    not SwiGLU MLPs (the rewrite refuses it, naming why).

    Example:
        >>> mixtral_source_keys(nn.Linear(2, 2))
        {}
    """
    experts = getattr(block, "experts", None)
    names = _swiglu_names(experts[0]) if isinstance(experts, nn.ModuleList) and len(experts) else None
    if names is None:
        return {}
    keys: dict[str, tuple[str, Optional[int]]] = {"gate.weight": ("router.gate.weight", None)}
    for target, src in zip(("w1", "w2", "w3"), names):
        for i in range(len(experts)):
            keys[f"experts.{i}.{src}.weight"] = (f"experts.{target}", i)
    shared_name = next((s for s in _SHARED if getattr(block, s, None) is not None), None)
    shared_names = _swiglu_names(getattr(block, shared_name)) if shared_name else None
    for target, src in zip(("w1", "w2", "w3"), shared_names or ()):
        keys[f"{shared_name}.{src}.weight"] = (f"shared_experts.{target}.weight", None)
    return keys


def moe_from_mixtral(block: nn.Module, name: str = "block", verify: bool = True) -> MoE:
    """Build an :class:`~.moe.MoE` computing exactly what the Mixtral-style ``block`` computes.

    Raises ``ValueError`` naming the module if the block does not fit (see the module docstring).

    Example:
        >>> moe_from_mixtral(nn.Linear(8, 4), "layers.0.block_sparse_moe")
        Traceback (most recent call last):
        ...
        ValueError: MoE-like module 'layers.0.block_sparse_moe' cannot be made expert-parallel ...: `gate` is not a...
    """
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if not isinstance(gate, nn.Linear) or gate.bias is not None:
        raise _fail(name, "`gate` is not a bias-free nn.Linear")
    if not isinstance(experts, nn.ModuleList) or len(experts) == 0:
        raise _fail(name, "`experts` is not a non-empty nn.ModuleList")
    if float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
        raise _fail(name, "router jitter noise is not supported", "set `jitter_noise = 0`")
    if any(type(e) is not type(experts[0]) for e in experts):
        raise _fail(name, f"the experts are not identical (classes {sorted({type(e).__name__ for e in experts})})")
    names = _swiglu_names(experts[0])
    if names is None:
        raise _fail(name, f"its experts are not SwiGLU MLPs (expert 0: {swiglu_roles(experts[0])})")
    k = layer_top_k(block, len(experts), gate.weight.shape[1])
    if k is None:
        raise _fail(name, f"its top-k is unknown: its forward called no torch.topk over the {len(experts)} router "
                          f"scores on a test input, and neither it nor its `config` has an int attribute "
                          f"{' / '.join(TOP_K_NAMES)}", f"set `{name.rpartition('.')[2] or 'block'}.top_k = k`")
    for e in experts:
        _check_mlp(name, e, names)
    w1, w2, w3 = (getattr(experts[0], n).weight for n in names)
    if any(getattr(e, n).weight.shape != getattr(experts[0], n).weight.shape for e in experts for n in names):
        raise _fail(name, "the experts have different shapes")
    num, hidden, dim = len(experts), w1.shape[0], w1.shape[1]
    if gate.weight.shape != (num, dim):
        raise _fail(name, f"gate weight shape {tuple(gate.weight.shape)} != (num_experts={num}, dim={dim})")
    shared_name = next((s for s in _SHARED if getattr(block, s, None) is not None), None)
    shared = getattr(block, shared_name) if shared_name else None
    shared_names = _swiglu_names(shared) if shared is not None else None
    if shared is not None:
        if shared_names is None:
            raise _fail(name, f"`{shared_name}` is not a SwiGLU MLP ({swiglu_roles(shared)})")
        _check_mlp(name, shared, shared_names)
    known = {id(p) for m in [gate, experts] + ([shared] if shared is not None else []) for p in m.parameters()}
    extra = [n for n, p in block.named_parameters() if id(p) not in known]
    if extra:
        raise _fail(name, f"it has parameters the MoE layer has no place for: {extra}")
    if k > num:
        raise _fail(name, f"top_k={k} exceeds the {num} experts")
    device, dtype = w1.device, w1.dtype
    with torch.random.fork_rng(devices=[]), torch.device(device):  # the user's RNG stream is untouched
        moe = MoE(dim, hidden, num, k, renormalize=bool(getattr(block, "norm_topk_prob", True)),
                  shared_hidden_dim=shared_names and getattr(shared, shared_names[0]).out_features)
    moe = moe.to(dtype)
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate.weight)
        for target, src in zip(("w1", "w2", "w3"), names):
            stacked = torch.stack([getattr(e, src).weight.detach() for e in experts])  # (E, out, in)
            getattr(moe.experts, target).copy_(stacked)
        if shared is not None:
            for target, src in zip(("w1", "w2", "w3"), shared_names):
                getattr(moe.shared_experts, target).weight.copy_(getattr(shared, src).weight)
    moe.source_key_map = mixtral_source_keys(block)
    moe.train(block.training)
    if verify and not w1.is_meta and type(w1.data) is torch.Tensor:  # skip meta and DTensor weights
        _verify(block, moe, name)
    return moe


def _verify(block: nn.Module, moe: MoE, name: str) -> None:
    w = moe.router.gate.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 4, moe.dim, generator=gen).to(device=w.device, dtype=w.dtype)  # (2, 4, H)
    modes = (block.training, moe.training)
    block.eval(), moe.eval()
    try:
        with torch.no_grad():
            try:
                ref = block(x)
            except Exception as err:  # noqa: BLE001 - reported with the module name
                raise _fail(name, f"calling it on a {tuple(x.shape)} test input raised {type(err).__name__}: {err} "
                                  f"(pass verify=False to skip this check)") from err
            got = moe(x)
    finally:
        block.train(modes[0]), moe.train(modes[1])
    if isinstance(ref, (tuple, list)):
        logits = ref[1] if len(ref) > 1 else None
        ref = ref[0]
        if isinstance(logits, torch.Tensor) and logits.shape[-1] == moe.num_experts:
            moe.return_router_logits = True
    diff, scale = max_difference(got, ref) or (0.0, 0.0)
    if not isinstance(ref, torch.Tensor) or diff > allowed_difference(ref, scale):
        raise _fail(name, "its forward does not compute Mixtral's math (softmax -> top-k -> renormalise -> "
                          "sum of w_j * w2(silu(w1 x) * w3 x)); a test input gave different outputs")


def rewrite_moe_modules(model: nn.Module, verify: bool = True) -> nn.Module:
    """Replace every Mixtral-style block of ``model`` (in place) by an equivalent :class:`~.moe.MoE`;
    returns the model (a new object only if ``model`` itself is such a block).

    Example:
        >>> rewrite_moe_modules(nn.Sequential(nn.Linear(2, 2)))  # no Mixtral-style block: unchanged
        Sequential(
          (0): Linear(in_features=2, out_features=2, bias=True)
        )
    """
    for name, mod in find_moe_modules(model):
        if isinstance(mod, MoE):
            continue
        new = moe_from_mixtral(mod, name or type(mod).__name__, verify=verify)
        if name == "":
            return new
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return model


def _maps(model: nn.Module) -> dict[str, dict[str, tuple[str, Optional[int]]]]:
    return {n: m.source_key_map for n, m in model.named_modules() if isinstance(m, MoE) and m.source_key_map}


def source_names(model: nn.Module) -> dict[str, tuple[str, Optional[int]]]:
    """Original names of rewritten tensors → ``(name in ``model``, index along dim 0 or None)``, e.g.
    ``layers.0.moe.experts.3.w1.weight → (layers.0.moe.experts.w1, 3)`` for Mixtral experts stacked by
    :func:`rewrite_moe_modules` (empty when nothing was rewritten).

    Example:
        >>> source_names(nn.Linear(1, 1))
        {}
    """
    out: dict[str, tuple[str, Optional[int]]] = {}
    for prefix, mapping in _maps(model).items():
        pre = f"{prefix}." if prefix else ""
        for orig, (new, idx) in mapping.items():
            out[pre + orig] = (pre + new, idx)
    return out


def export_original_state_dict(model: nn.Module, state_dict: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """The model's state dict with rewritten blocks under their original (Mixtral / HF) names,
    stacked experts split back into ``experts.{i}.*.weight``. DTensors are gathered with
    ``full_tensor()`` (a collective). Buffers the original lacks (e.g. ``expert_bias``) are kept.

    Example:
        >>> sorted(export_original_state_dict(nn.Linear(2, 2)))  # nothing rewritten: the model's own names
        ['bias', 'weight']
    """
    sd = dict(model.state_dict() if state_dict is None else state_dict)
    for prefix, mapping in _maps(model).items():
        pre = f"{prefix}." if prefix else ""
        for orig, (new, idx) in mapping.items():
            value = sd.get(pre + new)
            if value is None:
                continue
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            sd[pre + orig] = full if idx is None else full[idx]
        for new in {new for new, _ in mapping.values()}:
            sd.pop(pre + new, None)
    return sd


def convert_original_state_dict(model: nn.Module, original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`export_original_state_dict` for unsharded tensors: original names ->
    the rewritten model's names (experts stacked). Keys of other modules pass through.

    Example:
        >>> sorted(convert_original_state_dict(nn.Linear(2, 2), {"weight": torch.ones(2, 2)}))
        ['weight']
    """
    sd = dict(original)
    for prefix, mapping in _maps(model).items():
        pre = f"{prefix}." if prefix else ""
        stacks: dict[str, dict[int, torch.Tensor]] = {}
        for orig, (new, idx) in mapping.items():
            if pre + orig not in sd:
                continue
            value = sd.pop(pre + orig)
            if idx is None:
                sd[pre + new] = value
            else:
                stacks.setdefault(new, {})[idx] = value
        for new, parts in stacks.items():
            sd[pre + new] = torch.stack([parts[i] for i in sorted(parts)])
    return sd
