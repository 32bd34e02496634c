"""Find the structure of a user's model: the repeated blocks and the top-level modules (pure).

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
    >>> find_blocks(net)[0]
    '1'
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from lightning_4d.analysis.hooks import BLOCKS_PATH, hook_call

__all__ = ["find_blocks", "top_level_modules", "num_params"]


def num_params(module: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once).

    Example:
        >>> num_params(nn.Linear(2, 3))
        9
    """
    return sum(p.numel() for p in module.parameters())


def find_blocks(root: nn.Module, path: Optional[str] = None) -> tuple[str, nn.Module]:
    """The container of repeated blocks: the ``ModuleList``/``ModuleDict`` of identical modules holding the
    most parameters — one rule for data, tensor and pipeline parallelism (a nanoGPT ``transformer``
    ``ModuleDict`` of mixed modules is not it; its ``h`` list is). When those identical modules lie inside a
    ``ModuleList`` of blocks of several classes (a hybrid's attention and state-space layers), that list it is.

    Args:
        root: the model (or LightningModule).
        path: an explicit dotted path (``"model.layers"``) that overrides the search.

    Raises:
        ValueError: naming the model and the hook to implement when nothing is found.

    Example:
        >>> find_blocks(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])))[0]
        '0'
    """
    if path is not None:
        try:
            container = root.get_submodule(path)
        except AttributeError as err:
            raise ValueError(f"blocks path {path!r} does not exist in {type(root).__name__}: {err}") from err
        return path, container
    best: Optional[tuple[str, nn.Module]] = None
    best_size = 0
    mixed: Optional[tuple[str, nn.Module]] = None  # the largest list of blocks of several classes (a hybrid model)
    mixed_size = 0
    mixed_list_name, mixed_list, mixed_list_size = "", None, 0  # the same, a ModuleList only
    for name, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) == 0:
            continue
        size = num_params(module)
        if len({type(m) for m in module.children()}) != 1:
            if isinstance(module, nn.ModuleList) and size > mixed_list_size:
                mixed_list_name, mixed_list, mixed_list_size = name, module, size
            if size > mixed_size:
                mixed, mixed_size = (name, module), size
            continue
        if size > best_size:
            best, best_size = (name, module), size
    if best is not None and isinstance(mixed_list, nn.ModuleList) and best[0].startswith(mixed_list_name + "."):
        # the identical modules found lie inside one block of a list of blocks of several classes (Zamba2's adapter
        # lists inside its hybrid layers, beside Mamba layers): that list holds the blocks
        return mixed_list_name, mixed_list
    if best is None:
        advice = "Keep the transformer blocks in a ModuleList, or implement"
        if mixed is not None:
            classes = sorted({type(m).__name__ for m in mixed[1].children()})
            advice = (f"{mixed[0]} holds {len(mixed[1])} blocks of {len(classes)} classes ({', '.join(classes)}): a "
                      f"model mixing block kinds (attention and state-space layers) is not found automatically. "
                      f"Implement")
        raise ValueError(
            f"No repeated blocks (an nn.ModuleList or nn.ModuleDict of identical modules holding parameters) were "
            f"found in {type(root).__name__}. {advice} {hook_call(BLOCKS_PATH)} (returning the dotted path) on your "
            f"FourDModule to name them."
        )
    return best


def top_level_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Direct children of ``root`` that own parameters (the data-parallel roots).

    Example:
        >>> [n for n, _ in top_level_modules(nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))]
        ['1']
    """
    return [(name, child) for name, child in root.named_children() if num_params(child) > 0]
