"""HSDP (``data_parallel="hsdp"``): FSDP2 over a 2-D ``(dp_replicate, dp_shard)`` mesh, against one process.

One 8-rank world runs every layout: dense parameters are sharded over ``dp_shard`` and replicated over
``dp_replicate`` (checked on the DTensor placements), with TP, PP and EP; losses and gradients match a
single-process run. Resharding to and from HSDP is in ``test_checkpoint.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_4d.testing import run_world
from tests.distributed.common import assert_parity, fit_spec, merge_ranks, world_fit

BASE: dict[str, Any] = dict(steps=3, accumulate=2, clip=0.05, placements=True)
HSDP = dict(data_parallel="hsdp", dp_shard=2)
LAYOUTS = [  # (model, strategy) in an 8-rank world
    ("llama", dict(HSDP)),  # dp 8 = 4 replicas × 2 shards
    ("llama", dict(HSDP, dp_shard=4)),  # 2 replicas × 4 shards
    ("llama", dict(HSDP, tp=2)),  # dp 4 = 2 × 2, TP inside
    ("llama-4", dict(HSDP, pp=2)),  # dp 4 = 2 × 2 per stage
    ("moe", dict(HSDP, tp=2, ep=2)),  # experts FSDP2 over edp, dense HSDP
]


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return {m: fit_spec(dict(BASE, model=m)) for m in sorted({m for m, _ in LAYOUTS})}


def test_hsdp_parity_and_placements(references: dict[str, Any]) -> None:
    specs = [dict(BASE, model=m, world=8, strategy=s) for m, s in LAYOUTS]
    for spec, got in zip(specs, merge_ranks(run_world(world_fit, 8, specs, timeout_s=900))):
        label = f"{spec['model']} {spec['strategy']}"
        assert_parity(got, references[spec["model"]], label=label)
        dense = {n: v for n, v in got["placements"].items() if "experts" not in n}
        assert dense, label
        for name, (dims, placements) in dense.items():
            # Sharded over dp_shard, replicated over dp_replicate (FSDP2's HSDP placements).
            assert dims[:2] == ("dp_replicate", "dp_shard"), (label, name, dims)
            assert placements[0] == "R" and placements[1] not in ("R", "P"), (label, name, placements)


def _bad(rank: int) -> None:
    fit_spec(dict(model="llama", steps=1, world=4, strategy=dict(data_parallel="hsdp", dp_shard=3)))


def test_hsdp_bad_shard_degree_fails_on_every_rank() -> None:
    for res in run_world(_bad, 4, raise_on_error=False, pg_timeout_s=20):
        assert "dp_shard=3 does not divide dp=4" in res["error"], res["error"]
