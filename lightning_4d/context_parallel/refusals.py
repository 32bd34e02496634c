"""The set-up check's refusals that name a family's fix, and the fallback for masks that cannot be read.

:func:`refuse_traced` turns what the traced forward saw (:mod:`.check`) into an error naming the module and a fix that
applies: attention written by hand (transformers' ``eager``: switch to ``sdpa``; eager-only families with attention
sinks, GPT-OSS and MiMo-V2-Flash, for which transformers has no SDPA: cp=1), a top-k selection of keys
(DeepSeek-V3.2's DSA indexer: cp=1). :func:`family_hint` adds the fix of a known setting to the value check's "output
differs" error (Llama 4's ``attn_temperature_tuning``). :func:`check_unread_masks` decides for a model whose masks are
not read (built on the meta device, its copy over the check's budget).

Example:
    >>> refuse_traced(torch.nn.Linear(2, 2), hand_written=[], selections=[], seq_len=16)
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch import nn

from lightning_4d._compat.hf_loading import sdpa_support
from lightning_4d.context_parallel.lengths import declared_lengths
from lightning_4d.context_parallel.shard import UnsplittableAttention

__all__ = ["check_unread_masks", "family_hint", "refuse_traced"]

log = logging.getLogger(__name__)


def refuse_traced(module: nn.Module, hand_written: Sequence[str], selections: Sequence[str], seq_len: int) -> None:
    """Refuse what the set-up check's traced forward saw (:mod:`.check`, check 2): attention written by hand
    (``hand_written``: the modules computing ``(T, T)`` scores themselves), a top-k selection of keys
    (``selections``), naming the first module and a fix that applies to its family.

    Example:
        >>> refuse_traced(torch.nn.Linear(2, 2), [], [], 16)  # nothing seen: nothing refused
    """
    if selections:
        raise UnsplittableAttention(
            f"context parallelism cannot split the attention of {selections[0]}: it selects keys by top-k over "
            f"({seq_len}, {seq_len}) scores (a sparse-attention indexer, e.g. DeepSeek-V3.2's DSA with index_topk), "
            f"and on a cp rank the selection would run over that rank's keys only. Train this model with cp=1 (for "
            f"long sequences, tp / pp and activation checkpointing keep each rank's activations down).")
    if not hand_written:
        return
    where = hand_written[0]
    owner = next((m for m in module.modules() if sdpa_support(m) is not None), None)
    eager_only = owner is not None and sdpa_support(owner) is False
    sinks = any(getattr(m, "sinks", None) is not None for m in module.modules())
    if eager_only:
        why = (f"attention sinks (a learnt logit per head in the softmax: GPT-OSS, MiMo-V2-Flash), which SDPA does "
               f"not compute, " if sinks else "")
        raise UnsplittableAttention(
            f"context parallelism cannot split the attention of {where}: it computes ({seq_len}, {seq_len}) attention "
            f"scores itself with {why}and transformers offers no SDPA attention for {type(owner).__name__} "
            f"(_supports_sdpa=False), so no call can be made global across the cp ranks. Train this model with cp=1 "
            f"(for long sequences, tp / pp and activation checkpointing keep each rank's activations down).")
    raise UnsplittableAttention(
        f"context parallelism cannot split the attention of {where}: it computes ({seq_len}, {seq_len}) attention "
        f"scores itself (matmul / softmax) instead of calling torch.nn.functional.scaled_dot_product_attention, the "
        f"call made global across the cp ranks. Use an SDPA attention (transformers: attn_implementation='sdpa'), or "
        f"cp=1.")


#: Settings known to compute something from the local chunk, and the fix that applies to their family.
_HINTS = {
    "attn_temperature_tuning": (
        "Here: Llama 4's attention temperature tuning scales the queries of its NoPE layers by a function of "
        "torch.arange over the local length; set attn_temperature_tuning=False in the config (the same model for "
        "sequences shorter than its floor_scale), or use cp=1."),
}


def family_hint(module: nn.Module, name: Optional[str]) -> str:
    """The family's fix (:data:`_HINTS`) for a difference the set-up check first saw in module ``name`` of
    ``module``: a setting on it, on a module above it or on their config (``""``: none known).

    Example:
        >>> family_hint(torch.nn.Sequential(torch.nn.Linear(2, 2)), "0")
        ''
    """
    if not name:
        return ""
    parts = name.split(".")
    for depth in range(len(parts), -1, -1):
        owner = module.get_submodule(".".join(parts[:depth]))
        for holder in (owner, getattr(owner, "config", None)):
            for attr, text in _HINTS.items():
                if getattr(holder, attr, False) is True:
                    return " " + text
    return ""


def check_unread_masks(model: nn.Module, need: float, budget: Optional[float]) -> None:
    """A model on the meta device whose copy (``need`` bytes) is over the check's ``budget``: its masks are not read.
    Refused when it declares a window, chunk or top-k (:mod:`.lengths`: which layers apply them, and how, cannot be
    told without values); else trained causal (per document when packed), each call's local mask checked against
    that on the device (:mod:`.local_masks`).

    Raises:
        UnsplittableAttention: naming the declared lengths and the fixes.

    Example:
        >>> check_unread_masks(torch.nn.Linear(2, 2), need=1e12, budget=None)  # declares nothing
    """
    declared = sorted({f"{name}={value}" for _, name, value in declared_lengths(model)})
    if declared:
        raise UnsplittableAttention(
            f"context parallelism cannot read the attention masks of {type(model).__name__}, built on the meta device: "
            f"it declares {', '.join(declared)}, and which layers apply them, and how, is read from a run with values "
            f"on a copy of the model, which would hold {need / 2**20:.0f} MiB, over the set-up check's budget"
            f"{f' of {budget / 2**20:.0f} MiB' if budget is not None else ' (256 MiB by default)'}. Pass "
            f"FourDStrategy(reduced_check_budget=<bytes>) with room for it, build the model for real, or use cp=1.")
    log.warning("lightning_4d: context parallelism: the attention masks of %s (built on the meta device, a copy of "
                "%.0f MiB over the set-up check's budget) are not read; each attention call's local mask is checked "
                "at every step instead (causal, or causal per document).", type(model).__name__, need / 2**20)
