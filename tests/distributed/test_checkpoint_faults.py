"""Faults a run must not survive silently: damaged checkpoint files, checkpoints of another model, NaN steps.

Each world runs several checks (a check's error is raised identically on every rank, so the world stays
usable for the next one).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_4d.models import CausalLM
from lightning_4d.testing import run_world

POISON = -7  # a target value that makes the sample's loss NaN
# Lightning's distributed sampler shuffles with seed 0; global batch i is order[8i:8i+8], rank r of dp=2 gets
# its r-th of every two. order[19]: in rank 1's third batch only (dp=2); in the third batch (pp=2, dp=1).
POISONED_SAMPLE = int(torch.randperm(48, generator=torch.Generator().manual_seed(0))[19])


class PoisonLM(CausalLM):
    """CausalLM whose loss is NaN on a batch holding a ``POISON`` target (a bad sample in the data)."""

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        bad = (targets == POISON).any()
        loss = super().loss_fn(logits, targets.masked_fill(targets == POISON, -100))
        return loss * torch.where(bad, torch.tensor(float("nan"), device=loss.device), torch.ones((), device=loss.device))


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _error_of(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return ""


def _keys_and_integrity(rank: int, tmp: str) -> dict[str, str]:
    from tests.distributed.ckpt_common import train

    train(dict(), 2, 2, save_to=f"{tmp}/four.ckpt", model="llama-4")
    train(dict(), 2, 2, save_to=f"{tmp}/two.ckpt", model="llama-2")
    out = {
        # 4 blocks into 2: keys the model lacks; 2 blocks into 4: keys the checkpoint lacks.
        "extra": _error_of(lambda: train(dict(), 2, 3, ckpt_in=f"{tmp}/four.ckpt", model="llama-2")),
        "missing": _error_of(lambda: train(dict(), 2, 3, ckpt_in=f"{tmp}/two.ckpt", model="llama-4")),
    }
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        shutil.copytree(f"{tmp}/two.ckpt", f"{tmp}/damaged.ckpt")
        _flip(sorted(Path(f"{tmp}/damaged.ckpt").glob("__1_*.distcp"))[0])  # a shard rank 1 wrote
    dist.barrier()
    out["damaged"] = _error_of(lambda: train(dict(), 2, 3, ckpt_in=f"{tmp}/damaged.ckpt", model="llama-2"))
    # Same names, other sizes: the shapes are named (not DCP's traceback line); a file is not a checkpoint.
    out["shape"] = _error_of(lambda: train(dict(), 2, 3, ckpt_in=f"{tmp}/two.ckpt", model="llama-wide"))
    out["file"] = _error_of(lambda: train(dict(), 2, 3, ckpt_in=f"{tmp}/two.ckpt/meta.pt", model="llama-2"))
    return out


def test_strict_keys_and_damaged_shard_in_a_world(tmp_path: Path) -> None:
    results = run_world(_keys_and_integrity, 2, str(tmp_path), pg_timeout_s=60)
    for r in results:
        extra, missing = r["extra"].splitlines()[0], r["missing"].splitlines()[0]
        assert "ValueError" in extra and "four.ckpt: it does not match CausalLM" in extra, extra
        assert "18 unexpected keys the model lacks (model.layers.2." in extra and "missing" not in extra, extra
        assert "18 missing keys the model has (model.layers.2." in missing and "unexpected" not in missing, missing
        assert "CheckpointIntegrityError" in r["damaged"] and "__1_0.distcp is damaged" in r["damaged"], r["damaged"]
        shape = r["shape"].splitlines()[0]
        assert "two.ckpt: it does not match CausalLM" in shape and "have other shapes" in shape, shape
        assert "21 parameter(s)" in shape and "model.layers.0.attention.wq.weight: saved (32, 32), model (48, 48)" in shape, shape
        assert "meta.pt is a file, not a lightning_4d checkpoint" in r["file"], r["file"]


def _save_dense(rank: int, path: str) -> None:
    from tests.distributed.ckpt_common import train

    train(dict(tp=1), 2, 2, save_to=path)


def test_flipped_byte_in_every_file_fails_load_and_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_4d.checkpoint.__main__ import main
    from lightning_4d.checkpoint.state import load_sharded
    from tests.distributed.common import build_model

    path = tmp_path / "good.ckpt"
    run_world(_save_dense, 2, str(path))
    files = sorted(p.name for p in path.iterdir() if p.stat().st_size > 0)  # `.complete` is empty
    assert {"meta.pt", "manifest.json", ".metadata", "rng_rank1.pt"} <= set(files) and len(files) >= 6, files
    # The intact checkpoint exports (into a directory that does not exist yet) and loads in one process.
    assert main(["export", str(path), str(tmp_path / "new" / "dir" / "m.safetensors")]) == 0
    model = CausalLM(build_model("llama"))
    load_sharded(str(path), model, [])
    for name in files:
        bad = tmp_path / f"bad-{name.strip('.')}.ckpt"
        shutil.copytree(path, bad)
        _flip(bad / name)
        with pytest.raises(ValueError, match=rf"{bad.name}/{name} is damaged"):
            load_sharded(str(bad), CausalLM(build_model("llama")), [])
        capsys.readouterr()
        assert main(["export", str(bad), str(tmp_path / "x.safetensors")]) == 1
        err = capsys.readouterr().err
        assert f"{bad.name}/{name} is damaged" in err and "Traceback" not in err, err
        # --no-verify compares sizes only: a flipped byte in a shard is no longer caught by the manifest.
    assert not (tmp_path / "x.safetensors").exists()


def _nan_runs(rank: int, strategy: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_4d import FourDStrategy
    from tests.distributed.common import build_model, make_dataset

    data = make_dataset(48)
    data.tensors[1][POISONED_SAMPLE, 3] = POISON
    dp = 2 // strategy.get("pp", 1)
    out: dict[str, Any] = {}
    for mode in ("raise", "skip"):
        torch.manual_seed(0)
        lm = PoisonLM(build_model("llama"), lr=1e-3)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(nonfinite=mode, **strategy),
                            max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0)
        loader = DataLoader(data, batch_size=8 // dp, shuffle=False)
        out[mode] = _error_of(lambda: trainer.fit(lm, loader))
        out[f"{mode}_step"] = trainer.global_step
        out[f"{mode}_finite"] = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                                    for p in lm.parameters())
        out[f"{mode}_skipped"] = trainer.strategy.skipped_steps
        out[f"{mode}_logged"] = float(trainer.callback_metrics.get("skipped_steps", torch.tensor(-1.0)))
        out[f"{mode}_loss"] = float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan"))))
    return out


@pytest.mark.parametrize("strategy", [dict(), dict(pp=2)], ids=["dp2", "pp2"])
def test_nan_batch_stops_or_is_skipped(strategy: dict[str, Any]) -> None:
    results = run_world(_nan_runs, 2, strategy, pg_timeout_s=60)
    for r in results:
        # Default: every rank stops at the poisoned step, before the optimizer step, weights still finite.
        assert r["raise"].startswith("NonFiniteError: Non-finite loss"), r["raise"]
        assert "at step 2" in r["raise"] and "first non-finite gradient: model." in r["raise"], r["raise"]
        assert r["raise_step"] == 2 and r["raise_finite"]
        # Skip: the run goes on to max_steps with finite weights; one step skipped, counted and logged.
        assert r["skip"] == "" and r["skip_step"] == 5 and r["skip_finite"], r
        assert r["skip_skipped"] == 1 and r["skip_logged"] == 1.0 and math.isfinite(r["skip_loss"]), r
