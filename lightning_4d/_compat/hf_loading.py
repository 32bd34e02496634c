"""transformers' checkpoint-key conversions (``transformers.conversion_mapping`` / ``core_model_loading``), used by
:mod:`lightning_4d.models.hf_source` to map the keys of a model directory's safetensors files to the model's own
parameter names exactly as ``from_pretrained`` does (e.g. per-expert ``experts.{i}.gate_proj.weight`` tensors
fused into transformers 5's 3-D ``experts.gate_up_proj``).

Private transformers names used (pinned by ``tests/unit/test_compat.py``):
``conversion_mapping.get_model_conversion_mapping``, ``core_model_loading.rename_source_key``,
``core_model_loading.WeightConverter`` (``add_tensor``, ``convert``), ``core_model_loading.WeightRenaming`` and
``core_model_loading.dot_natural_key``; ``PreTrainedModel._supports_sdpa`` (:func:`sdpa_support`). A transformers without them (4.x: its modules hold the checkpoint's own
names) gets no transforms and a local natural sort.

Example:
    >>> natural_key("layers.10.w") > natural_key("layers.9.w")
    True
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from torch import Tensor, nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.core_model_loading import WeightConverter, WeightRenaming

__all__ = ["convert_group", "model_transforms", "natural_key", "rename_key", "sdpa_support"]


def model_transforms(model: nn.Module) -> tuple[list[WeightRenaming], list[WeightConverter]]:
    """``(renamings, converters)``: the key transforms ``from_pretrained`` applies to ``model``'s checkpoints
    (``get_model_conversion_mapping``); two empty lists where transformers has none.

    Example:
        >>> model_transforms(nn.Linear(1, 1))
        ([], [])
    """
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    mapping = get_model_conversion_mapping(model)
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def rename_key(key: str, renamings: list[WeightRenaming], converters: list[WeightConverter],
               base_model_prefix: Optional[str], model_keys: dict[str, Tensor]) -> tuple[str, Optional[str]]:
    """``(model name, converter source pattern or None)`` of checkpoint key ``key``, as ``from_pretrained``
    renames it (every renaming, then at most one converter; the base-model prefix added or stripped to match
    ``model_keys``).

    Example:
        >>> rename_key("w", [], [], None, {"w": None})
        ('w', None)
    """
    try:
        from transformers.core_model_loading import rename_source_key
    except ImportError:
        return key, None
    renamed, pattern = rename_source_key(key, renamings, converters, base_model_prefix, model_keys)
    if renamed not in model_keys and key in model_keys:  # as from_pretrained: the key needed only a prefix
        renamed, pattern = rename_source_key(key, [], [], base_model_prefix, model_keys)
    return renamed, pattern


def convert_group(template: WeightConverter, target: str, sources: list[tuple[str, str, Callable[[], Tensor]]],
                  model: Any, config: Optional[PreTrainedConfig]) -> dict[str, Tensor]:
    """Run converter ``template`` (a ``WeightConverter`` of :func:`model_transforms`; copied, never changed) on
    the checkpoint tensors of one model tensor: ``sources`` are ``(source pattern, checkpoint key, loader)`` in
    checkpoint-key natural order (experts stack in that order); returns ``{model name: tensor}`` (several for a
    one-to-many converter). ``model`` needs ``get_parameter(name)`` only (for shape-dependent splits).

    Example:
        >>> # not run: needs files (a checkpoint's tensors, a transformers converter)
        >>> convert_group(converter, "model.layers.0.mlp.experts.down_proj", sources, shim, cfg)  # doctest: +SKIP
    """
    converter = copy.deepcopy(template)
    for pattern, key, loader in sources:
        converter.add_tensor(target, key, pattern, loader)
    out = converter.convert(target, model=model, config=config)
    return {name: (value[0] if isinstance(value, list) else value) for name, value in out.items()}


def natural_key(key: str) -> list[tuple[Union[int, str], ...]]:
    """Sort key of a tensor name with numbers compared as numbers (transformers' ``dot_natural_key``).

    Example:
        >>> sorted(["e.10.w", "e.2.w"], key=natural_key)
        ['e.2.w', 'e.10.w']
    """
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:
        return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]
    return dot_natural_key(key)


def sdpa_support(module: nn.Module) -> Optional[bool]:
    """Whether transformers offers SDPA attention for ``module``'s class (``PreTrainedModel._supports_sdpa``):
    ``False`` for an eager-only family, ``None`` for a module that does not say (not a transformers model).

    Example:
        >>> sdpa_support(nn.Linear(1, 1)) is None
        True
    """
    return getattr(type(module), "_supports_sdpa", None)
