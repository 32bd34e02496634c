"""A per-rank memory cap below the whole model, above the rank's share: the meta-built run must train under it,
the same model built on the CPU (the whole model on every rank) cannot.

Each rank caps its own data segment with ``RLIMIT_DATA``: its ``VmData`` when the Trainer's mesh exists (a
Callback's ``setup``: after the process groups and their threads, before ``configure_model``) plus
:data:`CAP` × the whole model's fp32 bytes. Linux (≥ 4.7) counts every private writable mapping against that
limit, anonymous ``mmap`` included, so torch's CPU tensors hit it; ``RLIMIT_AS`` would not work (torch and
gloo reserve far more address space than they touch). An allocation past the cap fails with torch's "can't
allocate memory" on that rank: deterministic, no timing involved. glibc's mmap threshold is pinned at 128 KiB
in the ranks, so every tensor of that size is its own mapping, returned when freed: ``VmData`` then follows
the live tensors instead of the heap's reuse history.

The model is built in ``configure_model`` (on the meta device, or on the CPU: the old path), as Lightning
documents for large models. Before the capped runs each rank trains a tiny model under the same layout once,
so the one-off costs of a process's first training step (imports, kernel and sharding caches: tens of MB
whatever the model) are paid outside the cap; the capped runs' growth is then what the model costs.

Layout ``tp=2`` × dp 4 on 8 ranks with plain SGD and one short sequence per rank: a rank trains with its fp32
shard and gradient shard (2 × share = 1/4 of the model), one block gathered by FSDP2 at a time and a few MB
of activations, so :data:`CAP` × the model leaves room for the set-up's own overheads while no rank may ever
hold the whole model. (With ``pp=2`` FSDP2 keeps a stage's parameters and gradients gathered for the whole
step and AdamW adds two moments: a rank then needs about the whole model's size to *train*, so no cap below
the model could tell the two paths apart.) ``bench/bench_setup_memory.py`` measures resident memory for
larger models under ``tp2 × pp2 × dp2``.
"""

from __future__ import annotations

import gc
import math
import resource
from datetime import timedelta
from typing import Any

import pytest

from lightning_4d.testing import run_world

MODEL = dict(vocab_size=256, dim=256, n_layers=16, n_heads=4, ffn_hidden=768, max_seq_len=16)  # 13.8 M params, 53 MB
WARM_UP = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=16)
WORLD, TP, GLOBAL_BATCH, STEPS = 8, 2, 4, 2
CAP = 0.75  # of the whole model's fp32 bytes, per rank, above its VmData once the mesh exists

pytestmark = pytest.mark.skipif(not hasattr(resource, "RLIMIT_DATA"), reason="needs RLIMIT_DATA (Linux)")


def _vm_data() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _set_data_limit(soft: int) -> None:
    """Lower this process's soft ``RLIMIT_DATA`` to ``soft`` bytes (never above the hard limit)."""
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    resource.setrlimit(resource.RLIMIT_DATA, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _pin_mmap_threshold() -> bool:
    """glibc: serve every allocation of 128 KiB or more with its own ``mmap`` (unmapped when freed) instead of
    raising the threshold as freed blocks come back, so ``VmData`` follows the live tensors."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _out_of_memory(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, MemoryError) or "can't allocate memory" in text or "Cannot allocate memory" in text


def _fit(model_kwargs: dict[str, Any], build: str, cap_fraction: float) -> dict[str, Any]:
    """Train ``model_kwargs``' Llama, built in ``configure_model`` on ``build`` ("meta" or "cpu"), for
    :data:`STEPS` SGD steps with the data segment capped at ``cap_fraction`` × the model above its size at
    ``Callback.setup`` (no cap for 0). Any failure is returned, not raised: the test reports every rank's."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_4d import FourDStrategy
    from lightning_4d.models import CausalLM, Llama, LlamaConfig

    cfg = LlamaConfig(**model_kwargs)
    with torch.device("meta"):
        whole = sum(p.numel() * p.element_size() for p in Llama(cfg).parameters())

    class BuiltInConfigureModel(CausalLM):
        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(0)
                with torch.device(build):
                    self.model = Llama(cfg)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    limits = resource.getrlimit(resource.RLIMIT_DATA)
    out: dict[str, Any] = {"whole": whole, "losses": [], "stage": "set-up", "vm_data": {}}

    class Cap(L.Callback):
        def setup(self, trainer: Any, module: Any, stage: str) -> None:
            gc.collect()
            out["base"] = _vm_data()
            if cap_fraction:
                _set_data_limit(out["base"] + int(cap_fraction * whole))

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            out["stage"] = "training"
            out["vm_data"]["set-up"] = _vm_data() - out["base"]

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            out["losses"].append(float(trainer.callback_metrics["train_loss"]))  # the global-batch mean
            out["vm_data"][f"step {len(out['losses'])}"] = _vm_data() - out["base"]

    tokens = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH * STEPS, cfg.max_seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=GLOBAL_BATCH // (WORLD // TP))
    lm = BuiltInConfigureModel(None)  # type: ignore[arg-type]
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
            strategy=FourDStrategy(tp=TP, timeout=timedelta(seconds=120)),  # a rank stuck on a failed peer fails
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Cap()],
        )
        trainer.fit(lm, train_dataloaders=loader)
    except Exception as err:  # noqa: BLE001 - reported by the test, with every rank's
        out.update(trained=False, out_of_memory=_out_of_memory(err), error=f"{type(err).__name__}: "
                   f"{str(err).splitlines()[0][:300] if str(err) else ''}")
        return out
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, limits)
    out["trained"] = True
    out["share"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                       for p in lm.parameters())
    return out


def _cap_enforced() -> bool:
    """Whether this kernel refuses an anonymous mapping past ``RLIMIT_DATA`` (Linux ≥ 4.7 without
    ``ignore_rlimit_data``): 16 MB allowed, 32 MB asked."""
    import torch

    limits = resource.getrlimit(resource.RLIMIT_DATA)
    _set_data_limit(_vm_data() + (16 << 20))
    try:
        torch.empty(32 << 20, dtype=torch.uint8).fill_(1)
        return False
    except RuntimeError:
        return True
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, limits)


def _runs(rank: int) -> dict[str, Any]:
    pinned = _pin_mmap_threshold()
    if not _cap_enforced():
        return {"enforced": False}
    warm = _fit(WARM_UP, "meta", 0.0)  # a process's first training step costs tens of MB whatever the model
    if not warm["trained"]:
        raise RuntimeError(f"the warm-up run failed: {warm['error']}")
    # The CPU-built run first: it fails on every rank while building the model, before any collective.
    return {"enforced": True, "pinned": pinned, "cpu": _fit(MODEL, "cpu", CAP), "meta": _fit(MODEL, "meta", CAP)}


@pytest.fixture(scope="module")
def capped_runs() -> list[dict[str, Any]]:
    results = run_world(_runs, WORLD, pg_timeout_s=120, timeout_s=900, raise_on_error=False)
    failed = [f"rank {r}: {res['error']}\n{res['traceback']}" for r, res in enumerate(results) if not res["ok"]]
    assert not failed, "\n".join(failed)
    if not all(res["value"]["enforced"] for res in results):
        pytest.skip("this kernel does not enforce RLIMIT_DATA on anonymous mappings (ignore_rlimit_data?)")
    return [res["value"] for res in results]


def _report(runs: list[dict[str, Any]], path: str) -> str:
    return "\n".join(f"rank {r}: {x[path].get('error', 'trained')} (at {x[path]['stage']}; VmData growth MB "
                     f"{ {k: v >> 20 for k, v in x[path]['vm_data'].items()} })" for r, x in enumerate(runs))


def test_cpu_built_model_fails_under_the_cap(capped_runs: list[dict[str, Any]]) -> None:
    """The cap is real: the whole model does not fit under it (so the meta-built test below can fail)."""
    for rank, r in enumerate(capped_runs):
        cpu = r["cpu"]
        assert not cpu["trained"], f"rank {rank}: the CPU-built model trained under the cap:\n" + _report(capped_runs,
                                                                                                         "cpu")
        assert cpu["out_of_memory"] and cpu["stage"] == "set-up", _report(capped_runs, "cpu")


def test_meta_built_model_trains_under_a_cap_below_the_whole_model(capped_runs: list[dict[str, Any]]) -> None:
    whole = capped_runs[0]["meta"]["whole"]
    losses = capped_runs[0]["meta"]["losses"]
    for rank, r in enumerate(capped_runs):
        meta = r["meta"]
        assert meta["trained"], f"the meta-built run failed under the cap of {CAP} × the model:\n" + _report(
            capped_runs, "meta")
        assert len(meta["losses"]) == STEPS and all(math.isfinite(x) for x in meta["losses"]), meta
        assert meta["losses"] == losses, f"rank {rank} disagrees on the global loss: {meta['losses']} vs {losses}"
        assert meta["share"] < CAP * whole < whole, (meta["share"], whole)  # the cap lies between the two
