"""The layout plan, computed without weights: :func:`parallelize_module` on a meta-built model in a fake world of
8 ranks, described per parameter by :func:`describe_layout`, against the rules written out here by role (as
TorchTitan writes its per-model plans literally): Megatron's column-parallel projections shard their output
rows over ``tp``, row-parallel ones their input columns, norms stay whole on ``tp``; FSDP2 shards dim 0 over
``dp`` (strided when ``tp`` shards dim 0 too); experts shard over ``ep`` then FSDP2 over ``edp``; a pipeline
rank holds only its stage."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from lightning_4d.config import FourDConfig
from lightning_4d.mesh import build_mesh
from lightning_4d.models import CausalLM
from lightning_4d.layout.parallelize import LayoutRow, describe_layout, parallelize_module
from lightning_4d.planner.fake_world import fake_world
from tests.distributed.common import build_model

COLUMN = r"(wq|wk|wv|w1|w3|q_proj|k_proj|v_proj|gate_proj|up_proj|c_attn|c_fc|tok_embeddings|embed_tokens|wte|output|lm_head)"
ROW = r"(wo|w2|o_proj|down_proj|c_proj)"


def _expected(name: str, shape: tuple[int, ...], tp: int, dp: int, ep: int, edp: int) -> tuple[tuple[str, ...],
                                                                                               tuple[str, ...],
                                                                                               tuple[int, ...]]:
    """(mesh dims, placements, local shape) of one parameter by its role."""
    local = list(shape)

    def chunk(size: int, parts: int, index: int = 0) -> int:  # torch.chunk's size of chunk ``index``
        step = math.ceil(size / parts)
        return max(0, min(step, size - index * step))

    if re.search(r"\.experts\.w[123]$", name):
        local[0] = chunk(chunk(shape[0], ep), edp)
        return ("edp", "ep"), ("StridedShard(0)", "S(0)"), tuple(local)
    if ".router." in name or ".shared_experts." in name:  # see sequence shards under SP: whole on tp
        local[0] = chunk(shape[0], dp)
        return ("dp",), ("S(0)",), tuple(local)
    leaf = name.rsplit(".", 2)[-2]
    in_block = re.search(r"\.(layers|h)\.\d+\.", name) is not None
    if re.fullmatch(COLUMN, leaf):
        local[0] = chunk(chunk(shape[0], tp), dp)
        return ("dp", "tp"), ("StridedShard(0)", "S(0)"), tuple(local)
    if re.fullmatch(ROW, leaf) and name.endswith(".weight") and in_block:
        local[0], local[1] = chunk(shape[0], dp), chunk(shape[1], tp)
        return ("dp", "tp"), ("S(0)", "S(1)"), tuple(local)
    local[0] = chunk(shape[0], dp)
    if in_block:  # norms, row-parallel biases
        return ("dp", "tp"), ("S(0)", "R"), tuple(local)
    return ("dp",), ("S(0)",), tuple(local)  # outside the TP regions (final norm, positions)


def _layout(kind: str, config: FourDConfig, rank: int) -> list[LayoutRow]:
    dims = config.resolve(8)
    with fake_world(8, rank=rank):
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            lm = CausalLM(build_model(kind))
        parallelize_module(lm, mesh, config, "32-true")
        local = [p.to_local() if hasattr(p, "to_local") else p for p in lm.parameters()]
        assert local and all(t.is_meta for t in local), "the plan allocated memory"
        return describe_layout(lm)


CASES: list[tuple[str, dict[str, Any], set[str], set[str]]] = [
    # (model, layout, parameters rank 0 must hold (regex), parameters the last rank must hold)
    ("llama", dict(tp=2, pp=2), {r"tok_embeddings", r"layers\.0\."}, {r"layers\.1\.", r"model\.norm", r"output"}),
    ("gpt2", dict(tp=2), {r"wte", r"h\.0\.", r"h\.1\."}, {r"wte", r"ln_f"}),
    ("hf-llama", dict(tp=2), {r"embed_tokens", r"layers\.1\."}, {r"lm_head"}),
    ("moe", dict(tp=2, ep=2), {r"experts\.w1", r"router"}, {r"experts\.w2"}),
]


@pytest.mark.parametrize(("kind", "layout", "first", "last"), CASES, ids=[c[0] for c in CASES])
def test_layout_follows_the_rules(kind: str, layout: dict[str, Any], first: set[str], last: set[str]) -> None:
    config = FourDConfig(**layout)
    dims = config.resolve(8)
    for rank, wanted in ((0, first), (7, last)):
        rows = _layout(kind, config, rank)
        names = [r.name for r in rows]
        for pattern in wanted:
            assert any(re.search(pattern, n) for n in names), (kind, rank, pattern, names)
        if dims.pp > 1:  # a pipeline rank holds its stage only
            other = {0: r"layers\.1\.", 7: r"layers\.0\."}[rank]
            assert not any(re.search(other, n) for n in names), (kind, rank, names)
        for row in rows:
            want = _expected(row.name, row.shape, dims.tp, dims.dp, dims.ep, dims.edp)
            got = (row.mesh, row.placements, row.local)
            if rank == 7 and row.mesh == ("edp", "ep"):
                want = (want[0], want[1], row.local)  # the last edp rank's expert shard may be empty (uneven)
            assert got == want, f"{kind} rank {rank}: {row}"


def test_layout_is_computed_on_meta_without_memory() -> None:
    rows = _layout("llama", FourDConfig(tp=2, pp=2), rank=0)  # asserts every local tensor is still on meta
    assert rows and all(r.local != r.shape for r in rows if r.mesh)  # every DTensor row is a real shard
    assert str(rows[0]).startswith(rows[0].name + " [")
