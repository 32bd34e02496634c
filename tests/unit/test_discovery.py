"""Block discovery: what is found, and what a model whose blocks are not found is told."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_4d.analysis.discovery import find_blocks


def test_a_list_of_mixed_blocks_is_named_in_the_error() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class StateSpace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_proj = nn.Linear(4, 8)

    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([StateSpace(), Attention(), StateSpace()])
    with pytest.raises(ValueError, match=r"No repeated blocks.* layers holds 3 blocks of 2 classes \(Attention, "
                                         r"StateSpace\): a model mixing block kinds .* not found automatically\. "
                                         r"Implement `fourd_blocks_path"):
        find_blocks(hybrid)


def test_identical_modules_inside_a_block_of_a_mixed_list_are_not_the_blocks() -> None:
    # Zamba2: hybrid layers (each with a list of per-use adapters) beside Mamba layers; the adapter lists are lists
    # of identical modules, but they lie inside one block of the mixed list, which holds the blocks
    class Hybrid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.adapters = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])
            self.mixer = nn.Linear(4, 8)

    class StateSpace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_proj = nn.Linear(4, 8)

    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([Hybrid(), StateSpace(), Hybrid(), StateSpace()])
    assert find_blocks(hybrid)[0] == "layers"
