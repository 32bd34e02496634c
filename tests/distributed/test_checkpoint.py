"""Checkpoints: exact (bitwise) resume in every way Lightning saves, and resharding between layouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_4d.testing import run_world
from tests.distributed.common import fit_spec


def _resume_cases(rank: int, strategy: dict[str, Any], world: int, tmp: str) -> dict[str, Any]:
    from tests.distributed.ckpt_common import train

    full = train(strategy, world, 10)
    # (a) fit ended by max_steps mid-epoch, then trainer.save_checkpoint
    a = train(strategy, world, 2, save_to=f"{tmp}/a.ckpt") + train(strategy, world, 10, ckpt_in=f"{tmp}/a.ckpt")
    # (b) fit ended at an epoch end (4 batches per epoch)
    b = train(strategy, world, 4, save_to=f"{tmp}/b.ckpt") + train(strategy, world, 10, ckpt_in=f"{tmp}/b.ckpt")
    # (c) ModelCheckpoint mid-epoch (after step 3), resumed from it
    c_full = train(strategy, world, 10, every_n=3, ckpt_dir=f"{tmp}/c")
    c = c_full[:3] + train(strategy, world, 10, ckpt_in=f"{tmp}/c/step=3.ckpt")
    return dict(full=full, a=a, b=b, c=c, c_full=c_full)


@pytest.mark.parametrize("world, strategy", [(2, dict()), (4, dict(tp=2, pp=2))], ids=["dp2", "tp2-pp2"])
def test_exact_resume_is_bitwise(world: int, strategy: dict[str, Any], tmp_path: Path) -> None:
    result = run_world(_resume_cases, world, strategy, world, str(tmp_path))[0]
    assert result["c_full"] == result["full"]
    for case in ("a", "b", "c"):
        # (epoch, batch index, batch checksum, loss) of every step, identical to the uninterrupted run.
        assert result[case] == result["full"], case


def _train_and_save(rank: int, strategy: dict[str, Any], world: int, model: str, path: str) -> list[float]:
    from tests.distributed.ckpt_common import train

    return [s[3] for s in train(strategy, world, 2, save_to=path, model=model)]


def _resume(rank: int, strategy: dict[str, Any], world: int, model: str, path: str) -> list[float]:
    from tests.distributed.ckpt_common import train

    return [s[3] for s in train(strategy, world, 4, ckpt_in=path, model=model)]


RESHARD = [
    ("llama-4", (dict(tp=2, pp=2), 4), (dict(), 1)),
    ("llama-4", (dict(pp=2), 2), (dict(pp=4), 4)),
    ("llama-4", (dict(tp=2), 4), (dict(tp=4), 4)),
    ("moe", (dict(ep=2), 2), (dict(ep=4), 4)),
    ("moe", (dict(tp=2, pp=2, ep=2), 8), (dict(pp=2), 4)),
    ("llama-4", (dict(), 1), (dict(tp=2, pp=2), 4)),
    # Fused concatenated q|k|v (transformers' Conv1D, nanoGPT's c_attn) is permuted per tp degree while
    # training; checkpoints hold the user's layout, so any other degree (or none) resumes exactly.
    ("hf-gpt2", (dict(tp=2), 2), (dict(), 1)),
    ("nanogpt", (dict(tp=2, pp=2), 4), (dict(tp=4), 4)),
    # A model's own fused experts stay its parameters (DTensor Shard(0) over ep, user names): any layout resumes.
    ("hf-qwen3moe", (dict(tp=2, ep=2), 2), (dict(), 1)),
    ("titan-moe", (dict(ep=2), 2), (dict(ep=4), 4)),
    # HSDP (FSDP2 over dp_replicate × dp_shard) to and from other layouts.
    ("llama-4", (dict(data_parallel="hsdp", dp_shard=2), 4), (dict(), 1)),
    ("llama-4", (dict(pp=2), 2), (dict(data_parallel="hsdp", dp_shard=2), 4)),
    ("moe", (dict(ep=2, data_parallel="hsdp", dp_shard=2), 4), (dict(tp=2, ep=2), 2)),
    # Context parallelism: parameters replicated over cp (FSDP2 over dp × cp), so any layout resumes.
    ("llama-4", (dict(cp=2, tp=2), 4), (dict(), 1)),
    ("llama-4", (dict(tp=2), 2), (dict(cp=2, dp=2), 4)),
]


RESHARD_IDS = ["tp2pp2-to-1", "pp2-to-pp4", "tp2dp2-to-tp4", "ep2-to-ep4", "tp2pp2ep2-to-pp2dp2", "1-to-tp2pp2",
               "hf-gpt2-tp2-to-1", "nanogpt-tp2pp2-to-tp4", "hf-qwen3moe-tp2ep2-to-1", "titan-moe-ep2-to-ep4",
               "hsdp-to-1", "pp2-to-hsdp", "moe-hsdp-ep2-to-tp2ep2", "cp2tp2-to-1", "tp2-to-cp2dp2"]


def _each(rank: int, fn: Any, jobs: list[tuple]) -> list[list[float]]:
    return [fn(rank, *job) for job in jobs]


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[float], list[float]]]:
    """Every resharding case saved, then resumed in its new layout: one world per world size for the saves, then
    one per world size for the resumes (two worlds per case spent most of the time starting ranks)."""
    root = tmp_path_factory.mktemp("reshard")
    cases = {i: (model, saved, loaded, str(root / i / "ckpt"))
             for i, (model, saved, loaded) in zip(RESHARD_IDS, RESHARD)}
    first: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    for fn, side, out in ((_train_and_save, 1, first), (_resume, 2, after)):
        for world in sorted({c[side][1] for c in cases.values()}):
            ids = [i for i, c in cases.items() if c[side][1] == world]
            jobs = [(cases[i][side][0], world, cases[i][0], cases[i][3]) for i in ids]
            out.update(zip(ids, run_world(_each, world, fn, jobs, timeout_s=900)[0]))
    return {i: (first[i], after[i]) for i in cases}


@pytest.mark.parametrize("model, saved, loaded", RESHARD, ids=RESHARD_IDS)
def test_resharding(model: str, saved: tuple, loaded: tuple, request: pytest.FixtureRequest,
                    reshard_runs: dict[str, tuple[list[float], list[float]]]) -> None:
    ref = fit_spec(dict(model=model, steps=4, global_batch=8, clip=None, lr=1e-3))["losses"]
    first, after = reshard_runs[request.node.callspec.id]
    assert len(first) == 2 and len(after) == 2
    for i, (got, want) in enumerate(zip(first + after, ref)):
        # The first resumed loss is the loaded model's output on the next batch: 1e-6; later steps 1e-5.
        tol = 1e-6 if i == 2 else 1e-5
        assert abs(got - want) / abs(want) <= tol, (i, got, want)


def _save_moe(rank: int, path: str) -> dict[str, Any]:
    from tests.distributed.ckpt_common import train
    from tests.distributed.common import full_grads  # noqa: F401  (keeps the import cost shared)

    train(dict(tp=2, ep=2), 4, 2, save_to=path, model="moe")
    return {}


def test_export_import_round_trip_and_seeding(tmp_path: Path) -> None:
    import torch

    from lightning_4d.checkpoint import export_consolidated, import_consolidated, read_model_state
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model

    ckpt = str(tmp_path / "moe.ckpt")
    run_world(_save_moe, 4, ckpt)
    merged = read_model_state(ckpt)
    out = export_consolidated(ckpt, tmp_path / "moe.safetensors")
    from safetensors.torch import load_file

    exported = load_file(str(out))
    # Stacked experts are split per expert, Mixtral style.
    assert "model.layers.0.feed_forward.experts.3.w2.weight" in exported
    assert "model.layers.0.feed_forward.experts.w2" not in exported
    fresh = CausalLM(build_model("moe"))
    import_consolidated(fresh, out)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, merged[name]), name  # bit-exact round trip
    # A checkpoint of another model is refused, naming keys.
    other = CausalLM(build_model("llama"))
    with pytest.raises(ValueError, match="missing keys"):
        import_consolidated(other, out)


def _save_dense(rank: int, path: str) -> None:
    from tests.distributed.ckpt_common import train

    train(dict(), 2, 2, save_to=path)


def _save_then_die(rank: int, path: str) -> None:
    import os

    import torch.distributed.checkpoint as dcp

    from tests.distributed.ckpt_common import train

    real = dcp.save

    def dying_save(state: Any, checkpoint_id: str, **kw: Any) -> Any:
        real(state, checkpoint_id=checkpoint_id, **kw)
        os._exit(1)  # killed after the shards were written, before the checkpoint was completed

    dcp.save = dying_save
    train(dict(), 2, 3, save_to=path)


def _load_into_other_model(rank: int, path: str) -> None:
    from tests.distributed.ckpt_common import train

    train(dict(), 2, 4, ckpt_in=path, model="gpt2")


def test_killed_save_and_bad_input(tmp_path: Path) -> None:
    from lightning_4d.checkpoint import check_checkpoint, read_model_state

    path = str(tmp_path / "last.ckpt")
    run_world(_save_dense, 2, path)
    before = read_model_state(path)
    results = run_world(_save_then_die, 2, path, raise_on_error=False, pg_timeout_s=20)
    assert not any(r["ok"] for r in results)
    # The previous checkpoint is untouched and loads; the partial one is recognisable and refused.
    after = read_model_state(path)
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)
    with pytest.raises(ValueError, match="interrupted save"):
        check_checkpoint(path + ".partial")
    # Not a checkpoint / a missing shard / another model: clear errors naming the file or key.
    with pytest.raises(FileNotFoundError, match="no such directory"):
        check_checkpoint(tmp_path / "nothing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match=r"plain.*\.complete is missing"):
        check_checkpoint(tmp_path / "plain")
    res = run_world(_load_into_other_model, 2, path, raise_on_error=False, pg_timeout_s=20)
    assert all("Could not load" in r["error"] and "last.ckpt" in r["error"] for r in res), res[0]["error"]
    shard = next(Path(path).glob("*.distcp"))
    shard.unlink()
    with pytest.raises(ValueError, match=r"Could not read checkpoint .*last\.ckpt.*\.distcp is missing"):
        read_model_state(path)
