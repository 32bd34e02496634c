"""The Hydra recipes: every config composes and validates, mistakes fail clearly, the big layouts fail
fast, and tiny trainings run through the compose API (2 ranks, no launcher) and the command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from lightning_4d.recipes import conf_dir, count_params, register_configs, to_train_config, validate
from lightning_4d.recipes.resources import (
    GiB,
    DeviceInventory,
    ResourceError,
    check_resources,
    model_spec,
    states_bytes_per_rank,
)
from lightning_4d.recipes.schema import (
    GPT2ModelConfig,
    LlamaModelConfig,
    MoEModelConfig,
    RecipeConfigError,
    TextDataConfig,
    owned,
)

REPO = Path(__file__).resolve().parents[2]
CONF = conf_dir()
GROUPS = ("model", "parallel", "trainer", "data", "optim", "logger")
# Options whose YAML leaves a mandatory value (???) to the command line.
REQUIRED = {
    ("data", "text_file"): ["data.text=[README.md]"],
    ("data", "token_dir"): ["data.data_dir=data/books"],
    ("data", "moe_1t"): ["data.data_dir=data/books", "model=moe_1t"],
    ("model", "hf"): [f"model.config={Path(__file__).parent / 'data' / 'tiny_llama_config.json'}"],
    ("data", "chat"): [f"data.files=[{Path(__file__).parent / 'data' / 'chat.jsonl'}]",
                       f"data.tokenizer={Path(__file__).parent / 'data' / 'tiny_tokenizer'}"],
    ("data", "hf_text"): [f"data.files=[{Path(__file__).parent / 'data' / 'chat.jsonl'}]",
                          f"data.tokenizer={Path(__file__).parent / 'data' / 'tiny_tokenizer'}"],
}
# Tiny, fast settings shared by the training tests.
TINY = [
    "model=tiny_dense", "model.dim=32", "model.n_layers=2", "model.ffn_hidden=64", "model.max_seq_len=32",
    "trainer.log_every_n_steps=1", "trainer.val_check_interval=null", "trainer.limit_val_batches=0",
    "callbacks.progress_bar=false", "callbacks.checkpoint=false",
    "optim.warmup_steps=0", "optim.lr=2e-2", "optim.schedule=constant",
]
SYNTHETIC = ["data=synthetic", "data.kind=increment", "data.seq_len=16", "data.batch_size=4",
             "data.num_train_samples=64"]

def _compose(overrides: list[str], config_dir: Path = CONF) -> Any:
    register_configs()
    with initialize_config_dir(str(config_dir), version_base=None):
        return compose("train", overrides)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# ---------------------------------------------------------------------------------------------- compose
@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_config_composes_and_validates(group: str, option: str) -> None:
    cfg = _compose([f"{group}={option}", *REQUIRED.get((group, option), [])])
    typed = validate(cfg)
    node = getattr(typed, group)
    assert getattr(node, "name", option) == option, f"{group}/{option}.yaml should set name: {option}"


def test_groups_have_the_required_options() -> None:
    want = {
        "model": {"tiny_dense", "tiny_moe", "gpt2_125m", "llama3_8b", "mixtral_8x7b", "deepseek_v3", "moe_1t", "hf"},
        "parallel": {"none", "dp", "tp", "cpu_4d", "moe_1t", "moe_1t_512"},
        "trainer": {"cpu", "gpu"},
        "data": {"stdlib", "text_file", "synthetic", "token_dir", "moe_1t", "chat", "hf_text"},
        "optim": {"adamw", "finetune"},
        "logger": {"csv", "tensorboard", "wandb", "mlflow"},
    }
    for group, options in want.items():
        assert options <= set(_options(group)), group


def test_default_is_the_cpu_4d_run() -> None:
    c = to_train_config(_compose([]))
    p = c.parallel
    assert (p.tp, p.pp, p.ep) == (2, 2, 2) and c.trainer.devices == 8
    assert isinstance(c.model, MoEModelConfig) and c.model.num_experts % p.ep == 0
    assert isinstance(c.data, TextDataConfig) and c.data.text is None and c.data.tokenizer == "byte"
    assert c.data.batch_size % p.microbatches == 0
    assert check_resources(c, DeviceInventory("cpu", 2, 16 * GiB)).dims.dp == 2


def test_schemas_are_the_packages_dataclasses() -> None:
    """A field of FourDConfig or a model config reaches the recipes as it is; the owners' rules run."""
    import dataclasses

    from lightning_4d.config import FourDConfig
    from lightning_4d.models import LlamaConfig

    assert [f.name for f in dataclasses.fields(FourDConfig)] == [f.name for f in dataclasses.fields(
        owned("parallel", to_train_config(_compose([])).parallel))]
    c = to_train_config(_compose(["model=tiny_dense", "parallel=tp"]))
    assert isinstance(owned("model", c.model), LlamaConfig)
    assert (c.model._target_, c.parallel._target_) == ("lightning_4d.models.Llama", "lightning_4d.FourDStrategy")
    with pytest.raises(RecipeConfigError, match=r"model\.n_kv_heads=3 is invalid: n_heads=8 must be divisible"):
        to_train_config(_compose(["model=tiny_dense", "model.n_kv_heads=3"]))


# ---------------------------------------------------------------------------------------------- mistakes
def test_typo_key_on_the_command_line_fails_clearly() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        _compose(["parallel.tpp=2"])
    assert "tpp" in str(err.value) and "parallel" in str(err.value)
    # '+' makes Hydra add the key despite the schema; validation names it instead of dropping it.
    with pytest.raises(RecipeConfigError, match=r"model\.n_layer is not a key of MoEModelConfig\. Did you mean "
                                                r"model\.n_layers\?"):
        to_train_config(_compose(["+model.n_layer=3"]))
    with pytest.raises(RecipeConfigError, match="parallel.tpp is not a key"):
        to_train_config(_compose(["+parallel.tpp=2"]))


def test_typo_key_in_a_yaml_file_fails_clearly(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    with open(conf / "model" / "tiny_dense.yaml", "a") as fh:
        fh.write("n_layer: 3\n")
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as err:
        _compose(["model=tiny_dense"], conf)
    text = str(err.value) + str(err.value.__cause__)
    assert "n_layer" in text and "LlamaModelConfig" in text


def test_wrong_type_fails_clearly() -> None:
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        _compose(["parallel.tp=two"])
    text = str(err.value) + str(err.value.__cause__)
    assert "parallel.tp" in text and "two" in text


def test_value_rules_name_the_key() -> None:
    with pytest.raises(RecipeConfigError, match=r"parallel\.schedule='2f2b'"):
        to_train_config(_compose(["parallel.schedule=2f2b"]))
    with pytest.raises(RecipeConfigError, match=r"parallel\.tp=0 is below 1"):
        to_train_config(_compose(["parallel.tp=0"]))
    with pytest.raises(RecipeConfigError, match="model.vocab_size=64"):
        validate(_compose(["model=tiny_dense", "model.vocab_size=64"]))
    with pytest.raises(RecipeConfigError, match="data.seq_len=512"):
        validate(_compose(["model=tiny_dense", "data.seq_len=512"]))


# ---------------------------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("schema", [
    LlamaModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48),
    LlamaModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, tie_embeddings=True),
    GPT2ModelConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, block_size=16),
    GPT2ModelConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, block_size=16, bias=False, tie_embeddings=False),
    MoEModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=48, num_experts=4,
                   top_k=2, expert_hidden=16, moe_every=2, first_dense_layers=1, shared_experts=1),
])
def test_param_count_matches_the_real_model(schema: Any) -> None:
    from lightning_4d.recipes import build_network
    from lightning_4d.recipes.schema import TrainConfig

    net = build_network(TrainConfig(model=schema))
    assert count_params(schema).total == sum(p.numel() for p in net.parameters())
    if isinstance(schema, MoEModelConfig):
        assert count_params(schema).active == net.num_active_params()


def test_big_models_have_their_documented_sizes() -> None:
    sizes = {name: count_params(to_train_config(_compose([f"model={name}", *REQUIRED.get(("model", name), [])])).model)
             for name in _options("model")}
    assert 1.0e12 < sizes["moe_1t"].total < 1.1e12 and sizes["moe_1t"].total == 1_038_954_930_176
    assert abs(sizes["llama3_8b"].total / 8.03e9 - 1) < 0.01
    assert abs(sizes["mixtral_8x7b"].total / 46.7e9 - 1) < 0.01
    assert abs(sizes["gpt2_125m"].total / 124.5e6 - 1) < 0.01
    assert 6.5e11 < sizes["deepseek_v3"].total < 7.0e11


def test_memory_is_the_planners_and_follows_the_documented_formula() -> None:
    c = to_train_config(_compose(["model=moe_1t", "parallel=moe_1t", "trainer=gpu", "trainer.num_nodes=64",
                                  "data.batch_size=32"]))
    params = count_params(c.model)
    dims = owned("parallel", c.parallel).resolve(512)
    assert (dims.world_size, dims.edp) == (512, 16)
    states = states_bytes_per_rank(model_spec(c.model), dims)
    # conf/model/moe_1t.yaml: 16 B × (dense / (tp·pp·dp) + experts / (ep·pp·edp)); the planner also counts the
    # norms and routers every tp rank holds whole, and the busiest stage (embedding or head): within 1 %.
    assert states == pytest.approx(16 * (params.dense / (8 * 4 * 16) + params.expert / (8 * 4 * 16)), rel=0.01)
    assert 25 * GiB < states < 35 * GiB
    report = check_resources(c, DeviceInventory("cuda", 8, 80 * GiB, 8))
    assert report.states_bytes == states and f"{states / GiB:.3g} GiB per rank" in report.describe()


# ---------------------------------------------------------------------------------------------- fail fast
def test_moe_1t_fails_fast_without_its_devices() -> None:
    cpu = to_train_config(_compose(["model=moe_1t", "parallel=moe_1t"]))
    with pytest.raises(ResourceError) as err:
        check_resources(cpu, DeviceInventory("cpu", 2, 16 * GiB))
    msg = str(err.value)
    assert "512" in msg and "tp=8" in msg and "pp=4" in msg and "ep=8" in msg and "GiB per rank" in msg
    assert "trainer.num_nodes=64" in msg and "recipes/plan.py" in msg
    # The right world, but a node with one small GPU.
    gpu = to_train_config(_compose(["model=moe_1t", "parallel=moe_1t", "trainer=gpu", "trainer.devices=8",
                                    "trainer.num_nodes=64"]))
    with pytest.raises(ResourceError, match="8 CUDA devices per node are needed"):
        check_resources(gpu, DeviceInventory("cuda", 1, 80 * GiB, 1))
    # Eight 16 GiB GPUs: enough devices, not enough memory.
    with pytest.raises(ResourceError, match="GiB per rank is needed but a GPU here has 16"):
        check_resources(gpu, DeviceInventory("cuda", 8, 16 * GiB, 8))
    # Eight 80 GiB GPUs per node, 64 nodes: only the 32 pipeline micro-batches do not divide a dp rank's 8 sequences.
    with pytest.raises(ResourceError, match=r"microbatches=32 does not divide the local batch size 8"):
        check_resources(gpu, DeviceInventory("cuda", 8, 80 * GiB, 8))
    gpu = to_train_config(_compose(["model=moe_1t", "parallel=moe_1t", "trainer=gpu", "trainer.num_nodes=64",
                                    "data.batch_size=32"]))  # devices: auto, the node's 8 GPUs
    assert check_resources(gpu, DeviceInventory("cuda", 8, 80 * GiB, 8)).dims.world_size == 512


def test_layout_must_fit_the_model() -> None:
    cpu = DeviceInventory("cpu", 2, 16 * GiB)
    c = to_train_config(_compose(["model=tiny_dense", "parallel=cpu_4d"]))
    with pytest.raises(ResourceError, match="ep=2 needs an MoE model"):
        check_resources(c, cpu)
    c = to_train_config(_compose(["model=tiny_moe", "parallel=tp", "parallel.tp=8"]))
    with pytest.raises(ResourceError, match=r"tp=8 does not divide heads=8 and kv_heads=4"):
        check_resources(c, cpu)
    c = to_train_config(_compose(["parallel.tp=4", "trainer.max_steps=20"]))  # the override example of recipes/README.md
    assert check_resources(c, cpu).dims.dp == 1


def test_the_strategys_rules_fail_before_any_rank_starts() -> None:
    # Rules FourDStrategy enforces at setup, checked by the same code before the ranks are launched.
    cpu = DeviceInventory("cpu", 2, 16 * GiB)
    c = to_train_config(_compose(["model=tiny_dense", "parallel=none", "parallel.pp=2", "parallel.microbatches=3",
                                  "data.batch_size=8", "trainer.devices=2"]))
    with pytest.raises(ResourceError, match=r"parallel.microbatches / data.batch_size \(per dp rank\): "
                                             r"microbatches=3 does not divide the local batch size 8"):
        check_resources(c, cpu)
    c = to_train_config(_compose(["model=tiny_dense", "parallel=none", "parallel.tp=2", "model.vocab_size=257",
                                  "trainer.devices=2"]))
    with pytest.raises(ResourceError, match=r"the vocabulary \(257\) is not divisible by parallel.tp=2.*Pad the "
                                             r"vocabulary to 258"):
        check_resources(c, cpu)
    # ep=3 with dp·tp=8: the report never shows an edp of 0.
    c = to_train_config(_compose(["model=tiny_moe", "parallel=none", "parallel.ep=3", "trainer.devices=8"]))
    with pytest.raises(ResourceError) as err:
        check_resources(c, cpu)
    assert "edp=0" not in str(err.value) and "ep=3 does not divide dp·tp" in str(err.value)


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    env.pop("LOCAL_RANK", None)
    return subprocess.run([sys.executable, str(REPO / "recipes" / "train.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def test_moe_1t_command_line_fails_fast(tmp_path: Path) -> None:
    proc = _run_cli("model=moe_1t", "parallel=moe_1t", f"hydra.run.dir={tmp_path}", timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "This recipe cannot run here" in proc.stderr and "512" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "csv").exists()  # nothing was built


# ---------------------------------------------------------------------------------------------- training
def _train_in_world(rank: int, conf: str, runs: list[list[str]]) -> list[list[float]]:
    from lightning_4d.recipes import run

    out = []
    for overrides in runs:
        register_configs()
        with initialize_config_dir(conf, version_base=None):
            cfg = compose("train", overrides)
        out.append(run(cfg).losses)
    return out


def test_tiny_training_through_compose_on_two_ranks(tmp_path: Path) -> None:
    from lightning_4d.testing import run_world

    common = [*TINY, "trainer.devices=2", "trainer.max_steps=5"]
    runs = [
        [*common, *SYNTHETIC, "parallel=tp", f"output_dir={tmp_path / 'tp'}"],
        # data parallel on the stdlib text corpus (a small slice), byte tokenizer
        [*common, "parallel=dp", "data=stdlib", f"data.data_dir={tmp_path / 'stdlib'}", "data.max_bytes=40000",
         "data.seq_len=16", "data.batch_size=4", f"output_dir={tmp_path / 'dp'}"],
    ]
    results = run_world(_train_in_world, 2, str(CONF), runs, timeout_s=300, pg_timeout_s=60)
    for losses in results[0]:
        assert len(losses) == 5 and all(x == x for x in losses)
        assert losses[-1] < losses[0]
    assert results[0] == results[1]  # the logged loss is global: every rank reports the same
    assert (tmp_path / "tp" / "csv").is_dir() and (tmp_path / "stdlib" / "train.bin").exists()


def test_command_line_overrides_and_multirun(tmp_path: Path) -> None:
    proc = _run_cli(
        "-m", *TINY, *SYNTHETIC, "parallel=none", "trainer.devices=1", "trainer.max_steps=2", "optim.lr=1e-3,2e-3",
        f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${hydra.job.num}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in ("0", "1"):
        metrics = list((tmp_path / job / "csv").glob("version_*/metrics.csv"))
        assert metrics, f"job {job} wrote no metrics: {proc.stdout[-2000:]}"
        assert "train_loss" in metrics[0].read_text()
    assert "lr: 0.002" in (tmp_path / "1" / ".hydra" / "config.yaml").read_text()


def test_checkpoint_is_written(tmp_path: Path) -> None:
    from lightning_4d.testing import run_world

    tiny = [o for o in TINY if not o.startswith("callbacks.checkpoint")]
    overrides = [*tiny, *SYNTHETIC, "trainer.devices=1", "trainer.max_steps=2", "parallel=none",
                 "callbacks.checkpoint=true", f"output_dir={tmp_path}"]
    run_world(_train_in_world, 1, str(CONF), [overrides], timeout_s=120, pg_timeout_s=30)
    assert any((tmp_path / "checkpoints").iterdir())
