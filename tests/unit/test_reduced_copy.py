"""The value check's stand-ins answer what a user's code reads of a block it replaced: a hook that walks the blocks
(``fourd_tp_plan`` changing head counts, an initialiser calling ``layer.reset_parameters()``) runs on the reduced
copy, touching only the meta-device block the stand-in replaced."""

from __future__ import annotations

import torch
from torch import nn

from lightning_4d.analysis.trace import HiddenArg
from lightning_4d.layout.reduced_copy import StandIn, stand_in_blocks


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads = 4
        self.wq = nn.Linear(8, 8)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()

    def reset_parameters(self) -> None:
        self.attention.wq.reset_parameters()


def _net() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.ModuleList([Block() for _ in range(3)]))


def test_a_hook_that_walks_the_blocks_runs_on_stand_ins() -> None:
    net = _net()
    stand_in_blocks(net, "0", {"0"}, HiddenArg(), {})
    blocks = list(net[0])
    assert [type(b) for b in blocks] == [Block, StandIn, StandIn]
    for block in blocks:  # what a fourd_tp_plan hook does to every block
        block.attention.n_heads //= 2
        block.reset_parameters()
    assert [b.attention.n_heads for b in blocks] == [2, 2, 2]
    assert sum(p.numel() for p in net.parameters()) == 8 * 8 + 8  # the stand-ins hold no parameters
    assert all("attention" not in dict(b.named_children()) for b in blocks[1:])


def test_an_unknown_attribute_still_raises() -> None:
    net = _net()
    stand_in_blocks(net, "0", {"0"}, HiddenArg(), {})
    try:
        net[0][1].no_such_thing
    except AttributeError:
        pass
    else:
        raise AssertionError("a stand-in invented an attribute")


def test_a_block_built_for_real_is_not_kept_as_a_shadow() -> None:
    net = nn.Sequential(nn.ModuleList([Block() for _ in range(2)]))  # on the host: no meta shadow (memory)
    stand_in_blocks(net, "0", {"0"}, HiddenArg(), {})
    assert net[0][1].__dict__["_fourd_shadow"] is None
