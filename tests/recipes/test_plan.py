"""``recipes/plan.py``: the dry-run planner composed from the training recipe's config groups — plan.json for a
tiny model and for the reference 1T MoE (with a dry run of the real rewriting), impossible requests, the layout
search, and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from lightning_4d.recipes import conf_dir, count_params, register_configs, to_train_config
from lightning_4d.recipes.planning import EXIT_DOES_NOT_FIT, PlanError, plan_setup, run_plan
from lightning_4d.recipes.schema import PlanRecipeConfig

REPO = Path(__file__).resolve().parents[2]
KEYS = ("model", "total_params", "active_params_per_token", "components", "layout", "memory", "communication",
        "bubble", "step", "step_time_s", "mfu", "tokens_per_s", "assumptions", "inputs")
# A toy cluster: 4 devices of a made-up accelerator (numbers in GB, TFLOP/s, GB/s).
TOY = ["plan.device=custom", "plan.memory_gb=80", "plan.peak_tflops=10", "plan.nvlink_gb_s=100",
       "plan.infiniband_gb_s=10", "plan.compute_efficiency=0.8", "plan.nodes=1", "plan.gpus_per_node=4"]


def _compose(overrides: list[str]) -> Any:
    register_configs()
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("plan", overrides)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    return env


# ---------------------------------------------------------------------------------------------- compose
def test_plan_config_has_the_train_groups_and_a_typed_plan_section() -> None:
    typed = to_train_config(_compose([]))
    assert isinstance(typed, PlanRecipeConfig)
    assert (typed.model.name, typed.parallel.name, typed.trainer.accelerator) == ("tiny_moe", "cpu_4d", "gpu")
    assert typed.plan.device == "H100" and typed.plan.trace and not typed.plan.search
    with pytest.raises(ConfigCompositionException, match="devcie"):
        _compose(["plan.devcie=H200"])
    with pytest.raises(ValueError, match="plan.device=custom needs plan.memory_gb"):
        to_train_config(_compose(["plan.device=custom"]))


# ---------------------------------------------------------------------------------------------- plans
def test_tiny_plan_writes_plan_json_with_a_matching_dry_run(tmp_path: Path) -> None:
    cfg = _compose(["model=tiny_moe", "parallel=cpu_4d", f"output_dir={tmp_path}"])
    outcome = run_plan(cfg)
    assert outcome.exit_code == 0, outcome.text
    plan = json.loads((tmp_path / "plan.json").read_text())
    for key in KEYS + ("dry_run",):
        assert key in plan, key
    assert plan["total_params"] == count_params(to_train_config(cfg).model).total
    assert len(plan["memory"]["per_role"]) == 2 and {"tp", "pp", "ep", "dp", "edp"} <= set(
        plan["communication"]["busiest_rank"])
    assert plan["dry_run"]["ok"] and len(plan["dry_run"]["ranks"]) == 2
    assert plan["layout"]["world_size"] == 8 and plan["layout"]["cluster"]["nodes"] == 1
    assert any("uniform routing" in a for a in plan["assumptions"])
    assert "bytes sent per step" in outcome.text and "dry run of tiny_moe" in outcome.text


def test_seed_moe_1t_plan(tmp_path: Path) -> None:
    cfg = _compose(["model=moe_1t", "parallel=moe_1t", "plan.trace_blocks=4", f"output_dir={tmp_path}"])
    setup = plan_setup(cfg)
    assert (setup.dims.tp, setup.dims.pp, setup.dims.ep, setup.dims.dp, setup.dims.world_size) == (8, 4, 8, 16, 512)
    assert (setup.cluster.nodes, setup.cluster.gpus_per_node) == (64, 8)
    outcome = run_plan(cfg)
    plan = json.loads(Path(outcome.path).read_text())
    for key in KEYS + ("dry_run",):
        assert key in plan, key
    assert plan["total_params"] == count_params(to_train_config(cfg).model).total == 1_038_954_930_176
    assert round(plan["active_params_per_token"] / 1e9, 1) == 40.4
    assert plan["bubble"]["theory"] == pytest.approx(3 / 35)
    assert len(plan["memory"]["per_role"]) == 4 and set(plan["communication"]["busiest_rank"]) == {
        "tp", "pp", "ep", "dp", "edp"}
    # One block per pipeline stage traced on a fake 512-rank group: the bytes equal the formulas.
    assert plan["dry_run"]["ok"] and plan["dry_run"]["layers"] == 4 and plan["dry_run"]["world_size"] == 512
    # data.batch_size=8 per dp rank is fewer than the 32 micro-batches: planned with 32 (noted).
    assert plan["layout"]["global_batch_size"] == 512 and any("32 micro-batches" in n for n in plan["inputs"]["notes"])
    # FSDP's gathered expert shares do not fit 80 GB: the plan says so and ends with its own exit status.
    assert not plan["memory"]["fits"] and outcome.exit_code == EXIT_DOES_NOT_FIT == 3
    assert "DOES NOT FIT: the training step's peak" in outcome.text
    # Without the trace the plan is the same: its formulas assume what the traced rewriting does.
    untraced = json.loads(Path(run_plan(_compose(["model=moe_1t", "parallel=moe_1t", "plan.trace=false",
                                                  f"output_dir={tmp_path / 'untraced'}"])).path).read_text())
    assert untraced["step_time_s"] == pytest.approx(plan["step_time_s"], rel=0.25)
    for axis, kinds in plan["communication"]["busiest_rank"].items():
        for kind, sent in kinds.items():
            assert untraced["communication"]["busiest_rank"][axis][kind] == pytest.approx(sent, rel=0.25), (axis, kind)


@pytest.mark.parametrize("parallel,device,fits", [
    ("moe_1t_512", "H100-SXM", True),  # conf/parallel/moe_1t_512.yaml: "512 × 80 GB GPUs"
    ("moe_1t", "H100-SXM", False),  # conf/parallel/moe_1t.yaml: "does not fit 80 GB"
    ("moe_1t", "H200", False),  # ... "nor 141 GB as configured (pp = 4)"
])
def test_the_moe_1t_layouts_fit_as_their_files_say(tmp_path: Path, parallel: str, device: str, fits: bool) -> None:
    data = ["data=moe_1t"] + (["data.batch_size=64"] if parallel == "moe_1t" else [])  # 4.2 M tokens per step
    outcome = run_plan(_compose(["model=moe_1t", f"parallel={parallel}", *data, f"plan.device={device}",
                                 "plan.trace=false", f"output_dir={tmp_path}"]))
    assert outcome.plan["layout"]["global_batch_size"] * 4096 == 1024 * 4096
    assert outcome.plan["memory"]["fits"] is fits and outcome.exit_code == (0 if fits else EXIT_DOES_NOT_FIT)


def test_a_layout_that_does_not_fit_ends_with_exit_status_3(tmp_path: Path) -> None:
    base = ["model=tiny_dense", "parallel=none", *TOY, "plan.trace=false"]
    fits = run_plan(_compose([*base, f"output_dir={tmp_path / 'fits'}"]))
    assert fits.exit_code == 0 and "DOES NOT FIT" not in fits.text
    small = run_plan(_compose([*base, "plan.memory_gb=0.01", f"output_dir={tmp_path / 'small'}"]))
    assert small.exit_code == EXIT_DOES_NOT_FIT and not small.plan["memory"]["fits"]
    assert "DOES NOT FIT: the training step's peak" in small.text and "exceeds the usable 0.0095 GB" in small.text
    assert Path(small.path).exists()  # the plan is still written


def test_dp_auto_fills_the_requested_nodes() -> None:
    setup = plan_setup(_compose(["model=tiny_dense", "parallel=tp", "plan.nodes=2", "plan.trace=false"]))
    assert (setup.dims.tp, setup.dims.dp, setup.cluster.world_size) == (2, 8, 16)
    assert setup.train.global_batch_size == 8 * 8 and setup.train.precision == "bf16-mixed"


def test_gradient_accumulation_is_more_micro_batches_not_bigger_ones() -> None:
    """The runtime runs ``trainer.accumulate_grad_batches`` micro-steps of ``data.batch_size`` sequences (each split
    into the pipeline's micro-batches): the plan's micro-batch stays ``data.batch_size / microbatches``."""
    one = plan_setup(_compose(["model=tiny_dense", "parallel=tp", "plan.nodes=1", "plan.trace=false"]))
    acc = plan_setup(_compose(["model=tiny_dense", "parallel=tp", "plan.nodes=1", "plan.trace=false",
                               "trainer.accumulate_grad_batches=4"]))
    assert (one.train.microbatches, acc.train.microbatches) == (1, 4)
    assert acc.train.global_batch_size == 4 * one.train.global_batch_size
    from lightning_4d.planner.memory import micro_batch_size

    assert micro_batch_size(acc.dims, acc.train) == micro_batch_size(one.dims, one.train) == 8
    assert any("accumulate_grad_batches=4" in n for n in acc.notes)
    pipe = plan_setup(_compose(["model=tiny_moe", "parallel=cpu_4d", "plan.trace=false",
                                "trainer.accumulate_grad_batches=2"]))
    assert pipe.train.microbatches == 4 * 2 and micro_batch_size(pipe.dims, pipe.train) == 8 // 4


@pytest.mark.parametrize("overrides,message", [
    (["model=tiny_dense", "parallel=tp", "parallel.tp=3", "parallel.dp=1"], "n_heads=8 is not divisible by tp=3|tp"),
    (["model=moe_1t", "parallel=moe_1t", "plan.nodes=32"], "needs 512 ranks .* plan.nodes=64"),
    (["model=tiny_moe", "parallel=cpu_4d", "plan.global_batch_size=6"], "global_batch_size=6 does not split"),
    (["model=tiny_moe", "parallel=cpu_4d", "parallel.ep=3"], "ep=3"),
    (["model=moe_1t", "parallel=none", "plan.nodes=1", "plan.search=true", "plan.trace=false"],
     "No layout of moe_1t fits 1 node"),
])
def test_impossible_requests_fail_with_a_clear_message(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        run_plan(_compose([*overrides, f"output_dir={tmp_path}"]))


def test_search_on_a_toy_cluster_ranks_the_known_best_first(tmp_path: Path) -> None:
    """A 0.7M-parameter model on 4 slow devices, compute-bound: pure data parallelism (no tp / pp / ep traffic on
    the critical path, its dp traffic hidden behind compute, no bubble) is the fastest layout."""
    cfg = _compose(["model=tiny_dense", "parallel=none", *TOY, "plan.search=true", "plan.trace=false",
                    "plan.global_batch_size=64", "data.seq_len=256", f"output_dir={tmp_path}"])
    outcome = run_plan(cfg)
    found = json.loads(Path(outcome.path).read_text())["search"]
    assert 2 <= len(found) <= 5
    assert (found[0]["tp"], found[0]["pp"], found[0]["dp"]) == (1, 1, 4) and found[0]["reason"].startswith("fastest")
    assert all("slower than #1" in c["reason"] or "as fast as #1" in c["reason"] for c in found[1:])
    assert [c["step_s"] for c in found] == sorted(c["step_s"] for c in found)
    assert "#1 tp=1 pp=1 ep=1 dp=4" in outcome.text


# ---------------------------------------------------------------------------------------------- command line
def test_command_line_plan_and_impossible_request(tmp_path: Path) -> None:
    script = str(REPO / "recipes" / "plan.py")
    ok = subprocess.run([sys.executable, script, "model=tiny_dense", "parallel=tp", "plan.nodes=1",
                         f"hydra.run.dir={tmp_path / 'ok'}"], capture_output=True, text=True, env=_env(),
                        cwd=tmp_path, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "dry run of tiny_dense" in ok.stdout and (tmp_path / "ok" / "plan.json").exists()
    bad = subprocess.run([sys.executable, script, "model=moe_1t", "parallel=none", "plan.nodes=1", "plan.search=true",
                          "plan.trace=false", f"hydra.run.dir={tmp_path / 'bad'}"], capture_output=True, text=True,
                         env=_env(), cwd=tmp_path, timeout=300)
    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert "error: No layout of moe_1t fits 1 node(s) × 8 H100" in bad.stderr and "Traceback" not in bad.stderr
    big = subprocess.run([sys.executable, script, "model=moe_1t", "parallel=moe_1t", "plan.trace=false",
                          f"hydra.run.dir={tmp_path / 'big'}"], capture_output=True, text=True, env=_env(),
                         cwd=tmp_path, timeout=300)
    assert big.returncode == 3, big.stdout[-2000:] + big.stderr[-2000:]
    assert "error: DOES NOT FIT: the training step's peak" in big.stderr and "Traceback" not in big.stderr
    assert (tmp_path / "big" / "plan.json").exists()


def test_materialize_rank_sets_up_one_rank_for_real(tmp_path: Path) -> None:
    """``plan.materialize_rank=R``: rank R's shards are allocated and initialised in this process (fake process
    group) and its measured memory is stored beside the planner's set-up estimate for its pipeline role."""
    from lightning_4d.mesh import rank_coordinates

    cfg = _compose(["model=tiny_moe", "parallel=cpu_4d", "plan.trace=false", "plan.materialize_rank=5",
                    f"output_dir={tmp_path}"])
    outcome = run_plan(cfg)
    sim = outcome.plan["setup_simulation"]
    setup = plan_setup(cfg)
    role = next(r for r in outcome.plan["memory"]["per_role"]
                if r["pp_rank"] == rank_coordinates(setup.dims, 5)["pp"])
    assert sim["rank"] == 5 and sim["world_size"] == 8 and sim["whole_calls"] == []
    assert sim["estimate_bytes"] == role["setup"]
    # The rank holds its share, a fraction of the model (tp=pp=ep=dp=2), not the whole of it.
    params = count_params(setup.config.model).total
    assert 0 < sim["share_bytes"] < 4 * params / 2
    assert sim["peak_bytes"] >= sim["share_bytes"]
    assert "planner's set-up estimate" in outcome.text
    with pytest.raises(PlanError, match=r"plan.materialize_rank=8 is outside the world of 8 ranks"):
        plan_setup(_compose(["model=tiny_moe", "parallel=cpu_4d", "plan.materialize_rank=8"]))


def test_plan_with_context_parallelism(tmp_path: Path) -> None:
    # cp=2 on 2 devices, each algorithm: its traffic on the cp axis (Ulysses' all-to-alls, the default here: the
    # heads divide by cp; the K/V all-gathers; the ring's sends), FSDP over dp × cp; the dry run traces the cp step on
    # the fake cp group and agrees with the formulas.
    kinds = {"all_to_all": {"all_to_all"}, "all_gather": {"all_gather", "reduce_scatter"}, "send": {"send"}}
    for algorithm, kind in (("auto", "all_to_all"), ("allgather", "all_gather"), ("ring", "send")):
        outcome = run_plan(_compose(["model=tiny_dense", "parallel=none", "parallel.cp=2",
                                     f"parallel.cp_algorithm={algorithm}", *TOY, "plan.gpus_per_node=2",
                                     f"output_dir={tmp_path / algorithm}"]))
        assert outcome.exit_code == 0
        busiest = outcome.plan["communication"]["busiest_rank"]
        assert busiest["cp"][kind] > 0 and busiest["dp_cp"]["reduce_scatter"] > 0, busiest
        assert set(busiest["cp"]) == kinds[kind]
        assert outcome.plan["layout"]["cp"] == 2 and "cp=2" in outcome.text
        dry = outcome.plan["dry_run"]
        assert dry["ok"], outcome.text[-3000:]
        # (with dp = 1 the cp, dp × cp and edp groups are one group: the dry run names it by one of them)
        assert dry["layout"]["cp"] == 2 and all(any(kinds.get(kind, 0) > 0 for kinds in r["traced"].values())
                                                for r in dry["ranks"])
