"""Recognise a list of expert MLPs and its routing by what the code does, whatever the names.

An MoE layer written the Mixtral way (Hugging Face's Mixtral, LitGPT's ``LLaMAMoE``, a user's loop) has a ``gate``
router and an ``experts`` list of identical MLPs. Expert parallelism replaces it by the package's layer
(:mod:`.rewrite`), which needs three facts, found here without relying on names:

- :func:`swiglu_roles`: which of an expert's three linears is ``w1`` (its output goes through the activation),
  ``w3`` (multiplied by that) and ``w2`` (the projection back, ``F -> H``): from the linears' shapes, and for the
  two ``H -> F`` ones from one traced call of the expert (meta tensors are enough). Mixtral's ``w1 w2 w3``,
  transformers' ``gate_proj down_proj up_proj`` and LitGPT's ``fc_1 proj fc_2`` come out alike. The activation
  must be SiLU (the package's experts are SwiGLU): another one is named in the reason.
- :func:`layer_top_k`: how many experts each token visits: the ``k`` of the layer's own ``torch.topk`` over its
  router's ``E`` scores (its forward traced up to that call), else an int attribute of the layer or of its
  ``config`` named like a top-k (``top_k``, ``num_experts_per_tok``, LitGPT's ``n_expert_per_token``, ...).

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Expert(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc_1, self.fc_2, self.proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
    ...     def forward(self, x):
    ...         return self.proj(torch.nn.functional.silu(self.fc_1(x)) * self.fc_2(x))
    >>> swiglu_roles(Expert())
    ('fc_1', 'proj', 'fc_2')
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["TOP_K_NAMES", "layer_top_k", "swiglu_roles"]

#: Attribute names a layer (or its ``config``) may give its top-k under, when its forward's ``topk`` is not seen.
TOP_K_NAMES = ("top_k", "num_experts_per_tok", "n_expert_per_token", "num_experts_per_token", "moe_topk",
               "experts_per_token", "moe_top_k")
_MULTIPLY = {torch.mul, Tensor.mul, Tensor.__mul__, Tensor.__rmul__, Tensor.mul_}
_SILU = {F.silu, torch.nn.functional.silu}


class _FirstUse(TorchFunctionMode):
    """Records, for each watched tensor, the first function called on it."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched, self.first = watched, {}  # tensor id -> name; name -> function

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        for arg in [*args, *(kwargs or {}).values()]:
            name = self.watched.get(id(arg)) if isinstance(arg, Tensor) else None
            if name is not None:
                self.first.setdefault(name, func)
        return func(*args, **(kwargs or {}))


def swiglu_roles(mlp: nn.Module) -> Union[tuple[str, str, str], str]:
    """``(w1, w2, w3)``: the names of ``mlp``'s linears as ``w2(silu(w1 x) * w3 x)`` uses them, or the reason it
    is no such MLP (a string). Runs ``mlp`` once on a zero input (no gradient; meta weights are enough): ``w1`` and
    ``w3`` read the MLP's input, ``w1``'s output first goes through the activation, ``w3``'s is multiplied, ``w2``
    reads something else (their shapes must agree: ``H -> F`` twice, ``F -> H``).

    Example:
        >>> swiglu_roles(nn.Linear(2, 2))
        'it holds 0 linear layers, not the 3 of a SwiGLU MLP (w2(act(w1 x) * w3 x))'
    """
    linears = {n: m for n, m in mlp.named_children() if isinstance(m, nn.Linear)}
    if len(linears) != 3:
        return f"it holds {len(linears)} linear layers, not the 3 of a SwiGLU MLP (w2(act(w1 x) * w3 x))"
    shapes = {n: (m.in_features, m.out_features) for n, m in linears.items()}
    widths = [i for i, _ in shapes.values()]
    hidden = next((w for w in widths if widths.count(w) >= 2), None)  # the input width two projections read
    if hidden is None:
        return (f"its linears {shapes} (in, out) are not two H -> F projections and one F -> H projection "
                f"(w1, w3 and w2 of w2(act(w1 x) * w3 x))")
    weight = next(iter(linears.values())).weight
    x = torch.zeros(1, hidden, device=weight.device, dtype=weight.dtype)  # (1, H)
    inputs: dict[str, int] = {}
    outputs: dict[int, str] = {}
    hooks = []
    for n, lin in linears.items():
        hooks.append(lin.register_forward_pre_hook(lambda _m, a, n=n: inputs.setdefault(n, id(a[0])) and None))
        hooks.append(lin.register_forward_hook(lambda _m, _i, out, n=n: outputs.__setitem__(id(out), n) or None))
    mode = _FirstUse(outputs)
    try:
        with torch.no_grad(), mode:
            mlp(x)
    except Exception as err:  # noqa: BLE001 - the reason names it
        return f"calling it on a {tuple(x.shape)} test input raised {type(err).__name__}: {err}"
    finally:
        for hook in hooks:
            hook.remove()
    ups = [n for n in linears if inputs.get(n) == id(x)]
    downs = [n for n in linears if n in inputs and n not in ups]
    if len(ups) != 2 or len(downs) != 1 or shapes[ups[0]] != shapes[ups[1]] \
            or shapes[downs[0]] != tuple(reversed(shapes[ups[0]])):
        return (f"its linears {shapes} (in, out) are not two H -> F projections of its input and one F -> H "
                f"projection of what they compute (w1, w3 and w2 of w2(act(w1 x) * w3 x); traced: "
                f"{sorted(ups)} read the input)")
    multiplied = [n for n in ups if mode.first.get(n) in _MULTIPLY]
    activated = [n for n in ups if n in mode.first and mode.first[n] not in _MULTIPLY]
    if len(multiplied) != 1 or len(activated) != 1:
        return (f"its linears {ups} do not form act(w1 x) * w3 x (the first use of each output: "
                f"{ {n: getattr(mode.first.get(n), '__name__', None) for n in ups} })")
    act = mode.first[activated[0]]
    if act not in _SILU:
        return (f"its activation is {getattr(act, '__name__', act)} on {activated[0]}'s output, not SiLU: the "
                f"package's experts compute w2(silu(w1 x) * w3 x)")
    return activated[0], downs[0], multiplied[0]


class _StopAtTopK(TorchFunctionMode):
    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts, self.k = num_experts, None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.topk, Tensor.topk) and args and isinstance(args[0], Tensor):
            k = args[1] if len(args) > 1 else kwargs.get("k")
            if args[0].shape[-1] == self.num_experts and isinstance(k, int) and not isinstance(k, bool):
                self.k = k
                raise _Found
        return func(*args, **kwargs)


class _Found(Exception):
    pass


def layer_top_k(layer: nn.Module, num_experts: int, dim: int) -> Optional[int]:
    """The number of experts each token visits in ``layer`` (see the module docstring), ``None`` when neither its
    forward's ``topk`` nor an attribute tells. Runs ``layer`` on a zero ``(1, 2, dim)`` input up to its first
    ``torch.topk`` over ``num_experts`` scores (meta weights are enough; nothing after that call runs).

    Example:
        >>> layer_top_k(nn.Linear(2, 2), num_experts=4, dim=2) is None
        True
    """
    weight = next((p for p in layer.parameters()), None)
    x = torch.zeros(1, 2, dim, device=weight.device if weight is not None else None,
                    dtype=weight.dtype if weight is not None else None)  # (1, 2, H)
    mode = _StopAtTopK(num_experts)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), mode:  # the user's RNG stream is untouched
            layer(x)
    except Exception:  # noqa: BLE001 - _Found, or a forward that cannot run alone: the attributes decide
        pass
    if mode.k is not None:
        return mode.k
    for owner in (layer, getattr(layer, "config", None)):
        for name in TOP_K_NAMES:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None
