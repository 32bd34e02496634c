"""Batch conventions: ``(inputs, targets)`` tuples, dict batches in the package's or Hugging Face's convention,
and packed samples carrying document boundaries as ``position_ids``.

Two conventions for the targets, told apart by the key:

- **shifted** (the package's): ``(inputs, targets)`` tuples and dicts with ``targets`` (or ``y``): ``targets[:, t]``
  is the token that follows ``inputs[:, t]`` (the data pipeline already shifted it). Used as they are.
- **aligned** (Hugging Face's): dicts with ``labels`` (``DataCollatorForLanguageModeling(mlm=False)``,
  ``DataCollatorWithFlattening``): ``labels`` has the shape of ``input_ids`` and the model shifts. They are turned
  into shifted targets once, at batch entry (:func:`shift_labels`: ``labels[:, 1:]`` plus an ignored last
  position), before any micro-batching or sequence sharding, so the loss is transformers' own: the token mean of
  ``logits[:, :-1]`` against ``labels[:, 1:]`` over the targets that are not ``-100``.

A dict's ``attention_mask`` is not passed to the model (attention is causal): right padding is accepted (it changes
nothing for the tokens before it; their labels are ``-100`` on the padding), left padding is refused. A dict may also
carry ``position_ids`` (``(B, T)``, restarting at 0 where a document starts, as transformers'
packed collators write them): the inputs are then :class:`PackedInputs` ``(tokens, position_ids)`` and the model is
called ``model(tokens, position_ids)``, so attention stays within each document. ``(inputs, targets, position_ids)``
triples (the package's packed datasets) are the same.

Example:
    >>> import torch
    >>> ids = torch.tensor([[5, 6, 7, 8]])
    >>> inputs, targets = split_batch({"input_ids": ids, "labels": ids})
    >>> targets.tolist()
    [[6, 7, 8, -100]]
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["INPUT_KEYS", "PackedInputs", "batch_tokens", "call_model", "check_takes_positions", "document_ids",
           "shift_labels", "split_batch"]

INPUT_KEYS = ("inputs", "input_ids", "tokens", "x")
SHIFTED_KEYS = ("targets", "y")  # already shifted: used as they are
LABELS_KEY = "labels"  # aligned with the inputs (Hugging Face): shifted here
POSITIONS_KEY = "position_ids"
MASK_KEY = "attention_mask"  # checked (right padding only), not passed on


class PackedInputs(NamedTuple):
    """Token ids ``(B, T)`` and their ``position_ids`` ``(B, T)`` (0 where a document starts). A tuple, so pipeline
    micro-batching splits both along the batch and stages call ``model(tokens, position_ids)``.

    Example:
        >>> x = PackedInputs(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[0, 0, 1]]))
        >>> x.tokens.shape
        torch.Size([1, 3])
    """

    tokens: Tensor
    position_ids: Tensor


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which document each token belongs to, ``(B, T)``: a new one starts wherever the position does not follow the
    previous one by 1 (transformers' rule for packed sequences, ``masking_utils.find_packed_sequence_indices``).

    >>> document_ids(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist()
    [[0, 0, 0, 1, 1, 2]]
    """
    first = position_ids[:, :1] - 1  # (B, 1): the first token continues nothing
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)  # (B, T)


def shift_labels(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Hugging Face ``labels`` (aligned with the inputs) as shifted targets of the same shape: ``targets[:, t] =
    labels[:, t + 1]``, the last position ignored (transformers' ``ForCausalLMLoss`` pads and shifts the same way).

    Example:
        >>> shift_labels(torch.tensor([[1, 2, -100, 4]])).tolist()
        [[2, -100, 4, -100]]
    """
    if labels.dim() < 1:
        raise ValueError(f"labels of shape {tuple(labels.shape)}: need (batch, sequence) token ids.")
    pad = torch.full_like(labels[..., :1], ignore_index)  # (B, 1)
    return torch.cat([labels[..., 1:], pad], dim=-1)  # (B, T)


def _check_same_shape(name: str, value: Tensor, inputs: Any, rule: str) -> None:
    if isinstance(inputs, Tensor) and isinstance(value, Tensor) and value.shape != inputs.shape:
        raise ValueError(
            f"{name} of shape {tuple(value.shape)} but inputs of shape {tuple(inputs.shape)}: {rule}. Pad or cut "
            f"both to the same (batch, sequence) shape (a collator with padding does), or override `split_batch`.")


def _with_positions(inputs: Any, position_ids: Optional[Tensor]) -> Any:
    if position_ids is None:
        return inputs
    _check_same_shape("position_ids", position_ids, inputs, "packed samples carry one position per input token")
    return PackedInputs(inputs, position_ids)


def _check_attention_mask(mask: Any, inputs: Any) -> None:
    """An ``attention_mask`` is not passed to the model (attention is causal, or per document with ``position_ids``):
    right padding (each row ones, then zeros) changes nothing for the tokens before the padding, anything else
    (left padding, holes) would be silently ignored, so it is refused."""
    if not isinstance(mask, Tensor):
        return
    _check_same_shape("attention_mask", mask, inputs, "one entry per input token")
    keep = mask != 0  # (B, T)
    if bool((keep[..., 1:] & ~keep[..., :-1]).any()):  # a kept token after a padded one
        raise ValueError(
            "attention_mask with a padded position before a kept one (left padding or holes): the model is called "
            "without it (attention is causal, or within documents with position_ids), so the padding would be "
            "attended to. Pad on the right (tokenizer padding_side='right') with labels -100 on the padding, or pack "
            "the rows with position_ids (DataCollatorWithFlattening).")


def split_batch(batch: Any, ignore_index: int = -100) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch, targets shifted (see the module doc for the conventions).

    Raises:
        ValueError: a dict without an input key or without a target key, with both ``labels`` and ``targets``
            (which convention?), ``labels`` or ``position_ids`` shaped unlike the inputs, an ``attention_mask``
            other than right padding (it is not passed to the model), or another batch type.

    Example:
        >>> split_batch((torch.ones(1, 2), torch.zeros(1, 2)))[1].tolist()
        [[0.0, 0.0]]
        >>> split_batch({"input_ids": torch.ones(1, 3), "labels": torch.ones(1, 2)})
        Traceback (most recent call last):
        ...
        ValueError: labels of shape (1, 2) but inputs of shape (1, 3): ...
    """
    if isinstance(batch, dict):
        inputs = next((batch[k] for k in INPUT_KEYS if k in batch), None)
        shifted = [k for k in SHIFTED_KEYS if k in batch]
        if shifted and LABELS_KEY in batch:
            raise ValueError(
                f"a dict batch with both {shifted[0]!r} and 'labels' (keys {sorted(batch)}): '{shifted[0]}' are "
                f"targets already shifted (targets[:, t] follows inputs[:, t]), 'labels' are aligned with the inputs "
                f"and shifted here (Hugging Face), so the batch is ambiguous. Keep one of the two keys.")
        if inputs is None or not (shifted or LABELS_KEY in batch):
            raise ValueError(
                f"A dict batch needs an input key ({'/'.join(INPUT_KEYS)}) and a target key (labels: aligned with "
                f"the inputs, Hugging Face; or {'/'.join(SHIFTED_KEYS)}: already shifted); got keys {sorted(batch)}. "
                f"Override `split_batch`.")
        if LABELS_KEY in batch:
            labels = batch[LABELS_KEY]
            _check_same_shape("labels", labels, inputs, "Hugging Face labels are aligned with the inputs (the "
                              "loss shifts them); already shifted targets go under 'targets'")
            targets = shift_labels(labels, ignore_index) if isinstance(labels, Tensor) else labels
        else:
            targets = batch[shifted[0]]
        _check_attention_mask(batch.get(MASK_KEY), inputs)
        return _with_positions(inputs, batch.get(POSITIONS_KEY)), targets
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, (tuple, list)) and len(batch) == 3:  # a packed sample: (inputs, targets, position_ids)
        return _with_positions(batch[0], batch[2]), batch[1]
    raise ValueError(
        f"A batch must be (inputs, targets), (inputs, targets, position_ids) or a dict, got {type(batch).__name__}"
        f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}. Override `split_batch`.")


def batch_tokens(inputs: Any) -> Any:
    """The token ids of ``inputs`` (the first field of :class:`PackedInputs`, else the inputs themselves).

    Example:
        >>> batch_tokens(PackedInputs(torch.ones(2, 3), torch.zeros(2, 3))).shape
        torch.Size([2, 3])
    """
    return inputs.tokens if isinstance(inputs, PackedInputs) else inputs


def call_model(module: Any, inputs: Any) -> Any:
    """``module(tokens, position_ids)`` for :class:`PackedInputs`, else ``module(inputs)``.

    Example:
        >>> call_model(lambda t, p=None: p, PackedInputs(torch.ones(1), torch.zeros(1))).tolist()
        [0.0]
    """
    if not isinstance(inputs, PackedInputs):
        return module(inputs)
    check_takes_positions(module)
    return module(*inputs)


def check_takes_positions(module: Any) -> None:
    """Refuse packed inputs for a forward that cannot take ``(tokens, position_ids)``: its attention would cross
    document boundaries, or the call would fail deep inside.

    Example:
        >>> check_takes_positions(lambda tokens: tokens)
        Traceback (most recent call last):
        ...
        ValueError: a packed batch (with position_ids) but <lambda> ...
    """
    forward = getattr(module, "forward", module)
    try:
        inspect.signature(forward).bind(None, None)
    except TypeError:
        name = getattr(forward, "__qualname__", type(module).__name__)
        raise ValueError(
            f"a packed batch (with position_ids) but {name} takes no second argument: it would be called "
            f"forward(tokens, position_ids). Add `position_ids=None` to the forward and pass it to the model "
            f"(CausalLM does), or use batches without position_ids (pack=False).") from None
    except ValueError:  # no signature (a builtin): let the call itself tell
        pass
