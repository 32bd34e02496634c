"""Pretrained Hugging Face weights streamed into each rank's shards.

``HFLogits.from_pretrained`` under ``trainer.init_module(empty_init=True)`` (the meta device) builds the model from
its config and attaches an ``HFWeightSource``; ``FourDStrategy`` rewrites it on meta, allocates only this rank's
shards and reads their values from the safetensors files one tensor at a time. Checked in one 4-rank world, four
layouts one after another, against ``AutoModelForCausalLM.from_pretrained`` in one process:

- the sharded model's full logits (``strategy.predict``: through the pipeline schedule under pp, gathered from the
  vocabulary-sharded head under tp) equal the single-process logits within ``TOL`` (fp32); the same model built
  from its config without weights gives logits far from them (so the check cannot pass without the load);
- the weights came from the files (``materialize_report.loaded``), each in row pieces (``get_rows``: only the
  rows holding the rank's elements), the model was never whole on a rank (its local bytes below the model's),
  under pp a rank read only the tensors of its own stage (fewer file reads than checkpoint tensors), and under
  ep a rank read only its own experts' per-expert keys (at most 1/ep of them; every key on some rank).

Models (tiny, fp32): Llama with an untied head (sharded ``model.safetensors.index.json`` layout) under tp2 × pp2;
Qwen3 with tied embeddings (single file; the tie spans the first and last stage) under pp2 × dp2 (FSDP2);
Qwen3-MoE (sharded; per-expert file tensors fused by transformers' converters into 3-D expert tensors) under
tp2 × pp2 × ep2; Mixtral (single file) under tp2 × ep2 × dp2 (FSDP2 over tensor-parallel shards: strided
placements). Every DTensor parameter's ``local_slice`` (how a full tensor becomes this rank's part) is also
compared with ``distribute_tensor`` on its own placements.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_4d.testing import run_world

os.environ.setdefault("OMP_NUM_THREADS", "1")
transformers = pytest.importorskip("transformers")

from tests.hf_tiny import tiny_config  # noqa: E402

VOCAB, SEQ, BATCH = 96, 16, 4
# Logits of one fp32 model under two layouts differ by rounding of split / reordered reductions: a few fp32 ulps
# (1.2e-7) of O(1) values, times the depth. 1e-5 relative is ~100 ulps; a wrong or missing tensor moves them O(1e-2+).
TOL = 1e-5
WORLD = 4

# name -> (model kind, max_shard_size or None for one file, FourDStrategy options)
CASES: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "llama-sharded-tp2-pp2": ("llama", "30KB", {"tp": 2, "pp": 2}),
    "qwen3tied-single-pp2-dp2": ("qwen3-tied", None, {"pp": 2}),
    "qwen3moe-sharded-tp2-pp2-ep2": ("qwen3moe", "30KB", {"tp": 2, "pp": 2, "ep": 2}),
    "mixtral-single-tp2-ep2-dp2": ("mixtral", None, {"tp": 2, "ep": 2}),
}


def _config(kind: str) -> Any:
    return tiny_config(kind, VOCAB)


def save_model(kind: str, directory: Path, max_shard_size: Any = None) -> Path:
    """``save_pretrained`` of a seeded tiny random model (sharded with an index when ``max_shard_size`` is set)."""
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return directory


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


# ----------------------------------------------------------------------------------------------- inside the world
def _load_sharded(directory: str, options: dict[str, Any], batch: torch.Tensor) -> dict[str, Any]:
    """One layout: build on meta under the strategy, stream the weights, return rank-local facts and the logits."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_4d import FourDStrategy
    from lightning_4d.models import CausalLM, HFLogits

    class Logits(L.Callback):
        """Full logits of the freshly loaded (sharded) model, before any step; then stop."""

        value: Any = None

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            pl_module.eval()
            with torch.no_grad():
                out = trainer.strategy.predict(pl_module, batch)
            self.value = (out.full_tensor() if hasattr(out, "full_tensor") else out).detach().float()
            trainer.should_stop = True

    grab = Logits()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=FourDStrategy(**options), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[grab])
    with trainer.init_module(empty_init=True):
        net = HFLogits.from_pretrained(directory)
    source = net.model.fourd_weight_source
    meta = all(t.is_meta for t in net.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    lm = CausalLM(net, lr=0.0)
    data = TensorDataset(batch, batch)
    trainer.fit(lm, train_dataloaders=DataLoader(data, batch_size=BATCH))
    report = trainer.strategy.materialize_report
    placements = sorted({str(p.placements) for p in lm.parameters() if hasattr(p, "placements")})
    return {"logits": grab.value, "slice_mismatches": _slice_mismatches(lm), "placements": placements, "built_on_meta": meta, "model_bytes": model_bytes, "local_bytes": report.local_bytes,
            "loaded": report.loaded, "in_pieces": report.loaded_in_pieces, "reads": source.reads,
            "checkpoint_tensors": len(source._files),
            "expert_keys_read": sorted(k for k in source.keys_read if ".experts." in k),
            "expert_keys": sorted(k for k in source._files if ".experts." in k)}


def _slice_mismatches(module: Any) -> list[str]:
    """``shard_slices.local_slice`` (index selection per sharded dimension) against ``distribute_tensor`` on every
    DTensor parameter's own placements (TP shards, FSDP2's strided shards over them, experts over ep), on a
    random full tensor, with and without a row permutation."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from lightning_4d.materialize.shard_slices import local_slice

    bad = []
    for name, param in module.named_parameters():
        if not isinstance(param, DTensor):
            continue
        full = torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name)))
        rows = list(reversed(range(param.shape[0])))
        for perm in (None, (rows, 0)):
            source = full if perm is None else full[torch.tensor(rows)]
            want = distribute_tensor(source, param.device_mesh, list(param.placements), src_data_rank=None).to_local()
            if not torch.equal(local_slice(param, full, perm), want):
                bad.append(f"{name} {param.placements} perm={perm is not None}")
    return bad


def _all_cases(rank: int, cases: list[tuple[str, str, dict[str, Any]]], batch: torch.Tensor) -> dict[str, Any]:
    return {name: _load_sharded(directory, options, batch) for name, directory, options in cases}


# ----------------------------------------------------------------------------------------------- the test
def test_streamed_load_equals_from_pretrained(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    batch = tokens()
    cases, reference, untrained = [], {}, {}
    for name, (kind, shard, options) in CASES.items():
        directory = save_model(kind, tmp_path / name, shard)
        assert (directory / "model.safetensors.index.json").is_file() == (shard is not None), name
        cases.append((name, str(directory), options))
        with torch.no_grad():
            loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                       attn_implementation="sdpa")
            reference[name] = loaded(batch).logits.float()
            torch.manual_seed(99)
            fresh = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32,
                                                                  attn_implementation="sdpa")
            untrained[name] = fresh(batch).logits.float()
    results = run_world(_all_cases, WORLD, cases, batch, timeout_s=420, pg_timeout_s=60)
    for name, (kind, _, options) in CASES.items():
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            assert not got["slice_mismatches"], f"{name} rank {rank}: local_slice != distribute_tensor: " \
                                                f"{got['slice_mismatches'][:4]}"
            assert got["built_on_meta"], f"{name}: from_pretrained under init_module(empty_init=True) was not on meta"
            assert got["loaded"] > 0, f"{name} rank {rank}: nothing was read from the weight source"
            assert got["local_bytes"] < got["model_bytes"], \
                f"{name} rank {rank}: holds {got['local_bytes']} bytes, the whole model is {got['model_bytes']}"
            if options.get("pp", 1) > 1:
                assert got["reads"] < got["checkpoint_tensors"], \
                    f"{name} rank {rank}: read {got['reads']} of {got['checkpoint_tensors']} tensors under pp=2"
            assert got["in_pieces"] == got["loaded"], f"{name} rank {rank}: a tensor was read whole"
            if options.get("ep", 1) > 1:  # only this rank's experts' keys: at most 1/ep of them
                assert 0 < len(got["expert_keys_read"]) <= len(got["expert_keys"]) // options["ep"], \
                    f"{name} rank {rank}: read {len(got['expert_keys_read'])} of {len(got['expert_keys'])} expert keys"
            assert got["logits"].shape == (BATCH, SEQ, VOCAB), got["logits"].shape
            err = _rel(got["logits"], reference[name])
            assert err <= TOL, f"{name} rank {rank}: logits differ from from_pretrained's by {err:.2e} relative"
        if options.get("ep", 1) > 1:  # and every expert on some rank
            assert set().union(*(r[name]["expert_keys_read"] for r in results)) == set(results[0][name]["expert_keys"])
        assert _rel(untrained[name], reference[name]) > 100 * TOL, f"{name}: the check cannot tell loaded from random"
        with capsys.disabled():
            print(f"\n{name}: max rel logits error {max(_rel(r[name]['logits'], reference[name]) for r in results):.1e}, "
                  f"file reads per rank {[r[name]['reads'] for r in results]} of {results[0][name]['checkpoint_tensors']}")
    seen = {p for r in results for case in r.values() for p in case["placements"]}
    assert any("Strided" in p for p in seen), f"no strided (FSDP2 over TP) placement was checked: {sorted(seen)}"
