"""Resume by re-running: the same recipe command in the same run directory continues exactly from the newest
checkpoint there; ``resume=false`` starts over, ``resume=PATH`` names the checkpoint; under SLURM the run directory
is the job's; incomplete or damaged checkpoints are skipped."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_4d.checkpoint import find_checkpoints, latest_checkpoint
from lightning_4d.checkpoint.state import _manifest_bytes
from lightning_4d.recipes import conf_dir, register_configs
from lightning_4d.recipes.resume import resume_checkpoint
from lightning_4d.recipes.schema import RecipeConfigError

REPO = Path(__file__).resolve().parents[2]
CONF = conf_dir()
# A tiny dense model on synthetic data, one process, a checkpoint at the last step (ModelCheckpoint's default here).
TINY = [
    "model=tiny_dense", "model.dim=32", "model.n_layers=2", "model.ffn_hidden=64", "model.max_seq_len=32",
    "trainer.log_every_n_steps=1", "trainer.val_check_interval=null", "trainer.limit_val_batches=0",
    "callbacks.progress_bar=false", "optim.schedule=constant", "optim.warmup_steps=0", "optim.lr=2e-2",
    "data=synthetic", "data.kind=increment", "data.seq_len=16", "data.batch_size=4", "data.num_train_samples=64",
    "parallel=none", "trainer.devices=1", "check_resources=false",
]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    for key in ("LOCAL_RANK", "SLURM_JOB_ID"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "train.py"), *TINY, *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _logged(run_dir: Path, version: int) -> dict[int, float]:
    """``train_loss`` by logged step (0-based) of ``csv/version_<version>``."""
    with open(run_dir / "csv" / f"version_{version}" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}


def _same(got: dict[int, float], want: dict[int, float]) -> float:
    assert list(got) == list(want)
    return max(abs(got[k] - want[k]) / abs(want[k]) for k in want)


def _runs_in_world(rank: int, conf: str, runs: list[list[str]]) -> None:
    from lightning_4d.recipes import run

    for overrides in runs:
        register_configs()
        with initialize_config_dir(conf, version_base=None):
            run(compose("train", [*TINY, *overrides]))


def test_rerunning_the_command_continues_exactly(tmp_path: Path) -> None:
    from lightning_4d.testing import run_world

    ref, run, other = (tmp_path / name for name in ("ref", "run", "other"))
    # the same command twice in one run directory: stopped at step 4, then asked for 8 steps
    first = _cli("trainer.max_steps=4", f"hydra.run.dir={run}")
    assert f"resume=auto: no checkpoint in {run / 'checkpoints'}: training from step 0" in first.stdout
    second = _cli("trainer.max_steps=8", f"hydra.run.dir={run}")
    step4 = run / "checkpoints" / "epoch=0-step=4.ckpt"
    assert f"resume=auto: resuming from {step4} (global step 4" in second.stdout, second.stdout[-2000:]
    # the uninterrupted run; resume=PATH in another directory; resume=false in the first one (starts over)
    run_world(_runs_in_world, 1, str(CONF), [
        ["trainer.max_steps=8", f"output_dir={ref}"],
        ["trainer.max_steps=8", f"output_dir={other}", f"resume='{step4}'"],  # quoted: the name holds '='
        ["trainer.max_steps=2", f"output_dir={run}", "resume=false"],
    ], timeout_s=300, pg_timeout_s=60)
    want = _logged(ref, 0)
    assert list(want) == list(range(8))
    assert _same(_logged(run, 0), {k: want[k] for k in range(4)}) <= 1e-5
    # steps 5-8 (0-based 4-7) and only those: nothing re-trained, the same losses
    assert _same(_logged(run, 1), {k: want[k] for k in range(4, 8)}) <= 1e-5
    assert _same(_logged(other, 0), {k: want[k] for k in range(4, 8)}) <= 1e-5
    assert _same(_logged(run, 2), {0: want[0], 1: want[1]}) <= 1e-5  # resume=false: from scratch again


def _preempted_then_rerun(rank: int, conf: str, ref: str, run_dir: str) -> int:
    """The uninterrupted run, then a run preempted (SIGTERM during step 3: saved and stopped after step 4, the
    next optimizer step), then the same run again."""
    import signal

    import lightning as L

    from lightning_4d.recipes import run

    class _Preempt(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    register_configs()
    with initialize_config_dir(conf, version_base=None):
        run(compose("train", [*TINY, "trainer.max_steps=8", f"output_dir={ref}"]))
        cfg = compose("train", [*TINY, "trainer.max_steps=8", f"output_dir={run_dir}"])
    try:
        run(cfg, callbacks=[_Preempt()])
    except SystemExit as stop:
        code = int(stop.code)
    run(cfg)
    return code


def test_a_preempted_run_continues_when_rerun(tmp_path: Path) -> None:
    from lightning_4d.testing import run_world

    ref, run = tmp_path / "ref", tmp_path / "run"
    code = run_world(_preempted_then_rerun, 1, str(CONF), str(ref), str(run), timeout_s=300, pg_timeout_s=60)[0]
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert code == 143 and saved == ["epoch=0-step=8.ckpt", "preempted-step=4.ckpt"]  # the re-run's own at 8
    want = _logged(ref, 0)
    # the preempted step's own loss is not logged (the stop comes in on_train_batch_end, before Lightning logs)
    assert _same(_logged(run, 0), {k: want[k] for k in range(3)}) <= 1e-5
    assert _same(_logged(run, 1), {k: want[k] for k in range(4, 8)}) <= 1e-5  # steps 5-8 only, the same losses


def test_resume_path_must_be_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(RecipeConfigError, match=r"resume='nowhere': .*no such directory\. Pass a checkpoint directory"):
        resume_checkpoint("nowhere", tmp_path)


def _fake_checkpoint(path: Path, step: int, complete: bool = True, metadata: bool = True) -> Path:
    path.mkdir(parents=True)
    torch.save({"global_step": step}, path / "meta.pt")
    if metadata:
        (path / ".metadata").write_bytes(b"x")
    if complete:
        (path / ".complete").touch()
    return path


def test_the_newest_complete_checkpoint_is_chosen(tmp_path: Path) -> None:
    d = tmp_path / "checkpoints"
    assert latest_checkpoint(d) is None
    _fake_checkpoint(d / "epoch=0-step=8.ckpt", 8)
    time.sleep(0.02)
    _fake_checkpoint(d / "preempted-step=5.ckpt", 5)  # newer, but an earlier step
    assert latest_checkpoint(d) == d / "epoch=0-step=8.ckpt"
    time.sleep(0.02)
    _fake_checkpoint(d / "preempted-step=8.ckpt", 8)  # the same step, completed later: wins the tie
    assert latest_checkpoint(d) == d / "preempted-step=8.ckpt"
    # incomplete saves are skipped, with the reason
    _fake_checkpoint(d / "epoch=0-step=12.ckpt.partial", 12, complete=False)
    _fake_checkpoint(d / "epoch=0-step=11.ckpt", 11, metadata=False)
    found, skipped = find_checkpoints(d)
    assert [f.step for f in found] == [5, 8, 8] and len(skipped) == 2
    assert any(".metadata is missing" in line for line in skipped)
    # a complete .partial left between the two renames of a save counts as its checkpoint (loading moves it back)
    _fake_checkpoint(d / "epoch=0-step=10.ckpt.partial", 10)
    assert latest_checkpoint(d) == d / "epoch=0-step=10.ckpt"
    # a truncated copy (a file smaller than its manifest says) is skipped
    damaged = _fake_checkpoint(d / "epoch=0-step=20.ckpt", 20)
    files = {".metadata": {"bytes": 2, "sha256": None}}
    (damaged / "manifest.json").write_bytes(_manifest_bytes(files, checksums=False))
    found, skipped = find_checkpoints(d)
    assert latest_checkpoint(d) == d / "epoch=0-step=10.ckpt"
    assert any("epoch=0-step=20.ckpt" in line and "truncated" in line for line in skipped), skipped


def test_slurm_run_directory_is_the_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    register_configs()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("train", [], return_hydra_config=True)
    assert cfg.hydra.run.dir == "outputs/slurm-4242" and cfg.resume == "auto"
    monkeypatch.delenv("SLURM_JOB_ID")
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("train", [], return_hydra_config=True)
    assert cfg.hydra.run.dir.startswith("outputs/20")  # outside SLURM: the date and time
