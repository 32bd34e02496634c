"""transformers' save-time steps, used by :func:`lightning_4d.checkpoint.export_hf` to write, one tensor at a time,
what ``save_pretrained`` writes: which tied copies it drops, and the conversion of the model's own names and
layouts to the on-disk ones (e.g. transformers 5's fused ``experts.gate_up_proj`` written per expert).

Private transformers names used (pinned by ``tests/unit/test_compat.py``):
``modeling_utils.remove_tied_weights_from_state_dict`` and ``core_model_loading.revert_weight_conversion``. A
transformers without them (4.x, whose modules hold the checkpoint's own names) keeps the first name of each
group of tied weights and converts nothing.

Example:
    >>> import torch
    >>> sorted(saved_state(torch.nn.Linear(2, 1)))
    ['bias', 'weight']
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["revert_conversion", "saved_state"]


def saved_state(model: nn.Module) -> dict[str, Tensor]:
    """The tensors ``save_pretrained`` writes before its on-disk conversion (meta tensors for a meta model): the
    state dict less the tied copies it drops (keeping the name it keeps) and ``_keys_to_ignore_on_save``.

    Example:
        >>> tied = nn.Module()
        >>> tied.a, tied.b = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> tied.b.weight = tied.a.weight
        >>> sorted(saved_state(tied))
        ['a.bias', 'a.weight', 'b.bias']
    """
    state = dict(model.state_dict())
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        PreTrainedModel = None  # noqa: N806
    if PreTrainedModel is not None and isinstance(model, PreTrainedModel):
        state = remove_tied_weights_from_state_dict(state, model)
    else:
        seen: set[int] = set()
        for name, tensor in [*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)]:
            if id(tensor) in seen:
                state.pop(name, None)
            seen.add(id(tensor))
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        state.pop(key, None)
    return state


def revert_conversion(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (the model's own names and layouts) converted to what ``save_pretrained`` writes to disk
    (``revert_weight_conversion``); unchanged without transformers' conversions.

    Example:
        >>> revert_conversion(nn.Linear(1, 1), {"weight": 1})
        {'weight': 1}
    """
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return dict(state)
    if not isinstance(model, PreTrainedModel):
        return dict(state)
    return revert_weight_conversion(model, dict(state))
