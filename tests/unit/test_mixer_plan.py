"""Pure tests of the tensor-parallel plan for state-space and short-convolution mixers (no process group): the trace
follows a fused projection's features through ``transpose`` and a depthwise ``conv1d`` and records the cuts made
after it; the plan cuts the convolution's channels with the features, divides the group counts and convolved
widths, runs the gated norm per group or distributed, and refuses a norm whose groups would straddle ranks. Also: a
list of blocks of different structures (a hybrid's Mamba and attention layers) is described per kind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.tensor_parallel import block_plan
from lightning_4d.tensor_parallel.mixers import conv_rows, linear_rows
from lightning_4d.analysis.trace import trace_model

HIDDEN, HEADS, HEAD_DIM, STATE, KERNEL = 16, 4, 8, 6, 3
INNER = HEADS * HEAD_DIM


class GatedNorm(nn.Module):
    """Mamba-2's gated RMSNorm: ``norm(x * silu(gate))`` over groups of ``group_size`` features."""

    def __init__(self, width: int, group_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.group_size = group_size

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = x * F.silu(gate)
        *prefix, last = x.shape
        g = x.view(*prefix, last // self.group_size, self.group_size)  # (B, T, groups, group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * g.view(*prefix, last)


class ToyMixer(nn.Module):
    """A Mamba-2-shaped mixer (``z | x | B | C | dt`` in one projection, a depthwise convolution over ``x | B | C``,
    per-head ``A_log`` / ``dt_bias``), with a stand-in for the scan (per head, like the real one)."""

    def __init__(self, n_groups: int, multipliers: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size = HEADS, HEAD_DIM, n_groups, STATE
        self.multipliers = multipliers  # Falcon-H1: the input scaled, the projection scaled feature by feature
        self.intermediate_size = INNER
        self.conv_dim = INNER + 2 * n_groups * STATE
        self.in_proj = nn.Linear(HIDDEN, INNER + self.conv_dim + HEADS, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, KERNEL, groups=self.conv_dim, padding=KERNEL - 1)
        self.A_log = nn.Parameter(torch.randn(HEADS))
        self.dt_bias = nn.Parameter(torch.randn(HEADS))
        self.norm = GatedNorm(INNER, INNER // n_groups)
        self.out_proj = nn.Linear(INNER, HIDDEN, bias=False)
        self.register_buffer("mup_vector", 0.5 + torch.rand(1, 1, self.in_proj.out_features))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        projected = self.in_proj(h * 0.5) * self.mup_vector if self.multipliers else self.in_proj(h)
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        xbc = F.conv1d(xbc.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=KERNEL - 1,
                       groups=xbc.shape[-1])[:, :, :t]  # (B, C, T)
        xbc = F.silu(xbc).transpose(1, 2)  # (B, T, C)
        x, bb, cc = torch.split(xbc, [self.intermediate_size, self.n_groups * self.ssm_state_size,
                                      self.n_groups * self.ssm_state_size], dim=-1)
        x = x.view(b, t, self.num_heads, self.head_dim)
        bb = bb.view(b, t, self.n_groups, self.ssm_state_size)
        cc = cc.view(b, t, self.n_groups, self.ssm_state_size)
        rep = self.num_heads // self.n_groups
        score = (bb.repeat_interleave(rep, 2) * cc.repeat_interleave(rep, 2)).sum(-1, keepdim=True)  # (B, T, H, 1)
        decay = torch.exp(-torch.exp(self.A_log)) * F.softplus(dt + self.dt_bias)  # (B, T, H)
        y = (x * score * decay[..., None]).cumsum(1).reshape(b, t, -1)  # (B, T, I)
        return self.out_proj(self.norm(y, gate))


class ShortConv(nn.Module):
    """LFM2's gated short convolution: ``B, C, x`` cut channels-first from one projection, ``C * conv(B * x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, KERNEL, groups=HIDDEN, padding=KERNEL - 1, bias=False)
        self.out_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        bb, cc, x = self.in_proj(h).transpose(-1, -2).chunk(3, dim=-2)  # 3 x (B, H, T)
        y = cc * self.conv(bb * x)[..., :h.shape[1]]
        return self.out_proj(y.transpose(-1, -2).contiguous())


class ToyBlock(nn.Module):
    def __init__(self, n_groups: int, multipliers: bool = False, short: bool = False) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.mixer = ShortConv() if short else ToyMixer(n_groups, multipliers)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mixer(self.norm(h))


class ToyAttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.attn = nn.Module()
        self.attn.q_proj, self.attn.o_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.attn.o_proj(self.attn.q_proj(self.norm(h)))


class Toy(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, HIDDEN)
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(HIDDEN, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _plan(n_groups: int, tp: int = 2, **kinds: bool):
    torch.manual_seed(0)
    model = Toy([ToyBlock(n_groups, **kinds), ToyBlock(n_groups, **kinds)])
    trace = trace_model(model, "layers", torch.randint(0, 32, (2, 8)))
    return block_plan(model.layers[0], "layers.0", tp, trace, sequence_parallel=True), trace


def test_trace_follows_features_through_a_depthwise_convolution() -> None:
    _, trace = _plan(n_groups=1)
    layout = trace.columns["mixer.in_proj"]
    conv = (INNER, 2 * INNER + 2 * STATE)  # x | B | C
    assert layout.depthwise == {conv}
    # the split after the convolution, and the per-head / per-group views, are recorded in in_proj's features
    assert {(INNER, 2 * INNER), (2 * INNER, 2 * INNER + STATE)} <= layout.cuts
    assert layout.units[(INNER, 2 * INNER)] == HEAD_DIM and layout.units[(2 * INNER, 2 * INNER + STATE)] == STATE


def test_one_group_is_computed_by_every_rank_and_the_gated_norm_runs_distributed() -> None:
    plan, _ = _plan(n_groups=1)
    assert plan.local_attrs["mixer"] == {"num_heads": 2, "intermediate_size": INNER // 2, "conv_dim": INNER // 2
                                         + 2 * STATE, "n_groups": 1}
    rows = plan.gathered["mixer.in_proj"]  # z_r | x_r | B | C | dt_r: the one group on both ranks
    b_rows = list(range(2 * INNER, 2 * INNER + 2 * STATE))
    assert rows[1] == (list(range(INNER // 2, INNER)) + list(range(INNER + INNER // 2, 2 * INNER)) + b_rows
                       + list(range(2 * INNER + 2 * STATE + HEADS // 2, 2 * INNER + 2 * STATE + HEADS)))
    conv = plan.channel_rows["mixer"]["conv1d.weight"]
    assert conv[0] == list(range(INNER // 2)) + list(range(INNER, INNER + 2 * STATE))
    assert conv == plan.channel_rows["mixer"]["conv1d.bias"]
    assert plan.head_params["mixer.A_log"] == [(0, 2), (2, 4)]
    assert plan.dist_norms == {"mixer.norm": "mixer.in_proj"}
    assert {"mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.A_log", "mixer.in_proj.weight"} <= set(
        plan.partial_params)


def test_groups_that_divide_by_tp_are_sharded_and_the_norm_stays_local() -> None:
    plan, _ = _plan(n_groups=2)
    assert "mixer.in_proj" in plan.permutations and not plan.gathered
    assert plan.local_attrs["mixer"]["n_groups"] == 1
    assert plan.local_attrs["mixer"]["conv_dim"] == INNER // 2 + 2 * STATE
    assert plan.head_params["mixer.norm.weight"] == [(0, INNER // 2), (INNER // 2, INNER)]
    assert not plan.dist_norms


def test_a_norm_whose_groups_would_straddle_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"mixer\.norm normalises the mixer's inner width .* in 2 groups .* "
                                         r"use a tp that divides the number of groups"):
        _plan(n_groups=2, tp=4)


def test_row_helpers() -> None:
    assert linear_rows(6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert linear_rows(4, 2, gathered=[[0, 3], [1, 3]]) == [[0, 3], [1, 3]]
    assert conv_rows([[0, 1, 6], [2, 3, 6]], 1, 7) == [[0, 5], [1, 2, 5]]


def test_blocks_of_another_structure_are_described_by_their_own_kind() -> None:
    torch.manual_seed(0)
    model = Toy([ToyAttentionBlock(), ToyBlock(1), ToyBlock(1), ToyAttentionBlock()])
    trace = trace_model(model, "layers", torch.randint(0, 32, (2, 8)))
    assert "mixer.in_proj" not in trace.columns and sorted(trace.kinds) == ["1", "2"]
    assert trace.for_block("3") is trace
    mamba = trace.for_block("2")
    assert mamba.columns["mixer.in_proj"].depthwise and "mixer.in_proj" in mamba.takes_block_input
    assert mamba.block_order == trace.block_order  # the model-wide facts are shared
    plan = block_plan(model.layers[2], "layers.2", 2, mamba, sequence_parallel=True)
    assert plan.linears == {"mixer.in_proj": "colwise", "mixer.out_proj": "rowwise"}


def test_scaled_input_and_per_feature_scale_follow_the_features() -> None:
    # Falcon-H1: in_proj(x * multiplier) still reads the mixer's input (column-parallel); in_proj(x) * mup_vector
    # multiplies feature by feature, so each rank uses the buffer's entries of its own features
    plan, trace = _plan(n_groups=1, multipliers=True)
    width = 2 * INNER + 2 * STATE + HEADS
    assert "mixer.in_proj" in trace.takes_block_input
    assert trace.columns["mixer.in_proj"].scales == {"mixer.mup_vector": (0, width)}
    assert trace.columns["mixer.in_proj"].depthwise == {(INNER, 2 * INNER + 2 * STATE)}
    assert plan.channel_rows["mixer"]["mup_vector"] == plan.gathered["mixer.in_proj"]


def test_short_convolution_channels_follow_a_channels_first_chunk() -> None:
    # LFM2: the projection is transposed before it is cut, B * x is convolved: the conv's channels are B's
    plan, trace = _plan(n_groups=1, short=True)
    layout = trace.columns["mixer.in_proj"]
    assert layout.depthwise == {(0, HIDDEN)} and {(0, HIDDEN), (HIDDEN, 2 * HIDDEN)} <= layout.cuts
    half = HIDDEN // 2
    assert plan.channel_rows["mixer"]["conv.weight"] == [list(range(half)), list(range(half, HIDDEN))]
    assert plan.permutations["mixer.in_proj"][:3 * half] == (list(range(half)) + list(range(HIDDEN, HIDDEN + half))
                                                            + list(range(2 * HIDDEN, 2 * HIDDEN + half)))
