"""Models built on the meta device: planned and rewritten on meta, only each rank's shards materialised.

One 8-rank world. For each family and layout the meta-built run is compared with the same model built for
real on the CPU (same seed, materialised whole before the strategy sees it) under the same layout: losses and
gradients must be *identical* (the same computation from the same initial values), so every parity table of
the CPU-built path (dense, MoE, Mixtral-style experts stacked by the rewrite, HSDP, Hugging Face) carries over
to meta-built models. One layout is also compared with a single process directly, and one is run with every
rank seeded differently (``sync_module_states`` must give every rank rank 0's initial weights).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_4d.testing import run_world
from tests.distributed.common import assert_parity, fit_spec, merge_ranks, world_fit

# (model, strategy): fused c_attn permuted by TP and a tied embedding across pipeline stages (gpt2), experts
# under tp × pp × ep (moe), Mixtral experts stacked under new names (mixtral), HSDP, a transformers model.
LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("llama-4", dict(tp=2, pp=2)),
    ("gpt2", dict(tp=2, pp=2)),
    ("moe", dict(tp=2, pp=2, ep=2)),
    ("mixtral", dict(tp=2, ep=2)),
    ("llama", dict(tp=2, data_parallel="hsdp", dp_shard=2)),
    ("hf-llama", dict(tp=2, pp=2)),
]
SINGLE = dict(model="llama", steps=4, accumulate=2, clip=0.05, meta=True)


def _specs() -> list[dict[str, Any]]:
    specs = []
    for model, strategy in LAYOUTS:
        base = dict(model=model, steps=2, meta=True, world=8, strategy=dict(strategy, timeout_s=120))
        specs += [base, dict(base, premat=True)]
    specs.append(dict(SINGLE, world=8, strategy=dict(tp=2, pp=2, timeout_s=120)))
    specs.append(dict(specs[0], rank_seed=True))  # ranks seeded differently: rank 0's random state is used
    return specs


def test_meta_built_equals_cpu_built_under_every_layout() -> None:
    specs = _specs()
    results = merge_ranks(run_world(world_fit, 8, specs, pg_timeout_s=180))
    for i, (model, strategy) in enumerate(LAYOUTS):
        meta, cpu = results[2 * i], results[2 * i + 1]
        label = f"{model} {strategy}"
        assert meta["losses"] == cpu["losses"], (label, meta["losses"], cpu["losses"])
        assert set(meta["grads"]) == set(cpu["grads"]) and meta["grads"], label
        differ = [n for n in cpu["grads"] if not torch.equal(meta["grads"][n], cpu["grads"][n])]
        assert not differ, (label, differ[:5])
    assert_parity(results[-2], fit_spec(SINGLE), label="meta-built llama tp2 pp2 vs one process")
    seeded, same = results[-1], results[0]
    assert seeded["losses"] == same["losses"]
    assert all(torch.equal(seeded["grads"][n], g) for n, g in same["grads"].items())
