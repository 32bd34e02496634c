"""``recipes/plan.py model=hf``: a Hugging Face model planned from its ``config.json`` — the planner's parameter
count equals the model's own (meta build) for the families it describes exactly, what it approximates is said,
and the plan, its search and its dry run (traced from the config alone, no weights read) run as for the package's
own models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_4d.recipes.calibration import compose_plan
from lightning_4d.recipes.hf_model import hf_param_count, hf_spec_notes
from lightning_4d.recipes.planning import plan_setup, run_plan
from lightning_4d.recipes.schema import HFModelConfig

transformers = pytest.importorskip("transformers")
DENSE = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
COMMON = ["parallel=none", "trainer.devices=1", "data=synthetic", "data.vocab_size=64", "data.seq_len=16",
          "plan.trace=false"]


def _config(kind: str) -> Any:
    tf = transformers
    return {
        "llama": lambda: tf.LlamaConfig(**DENSE),
        "qwen2": lambda: tf.Qwen2Config(**DENSE),
        "qwen3-tied": lambda: tf.Qwen3Config(**DENSE, head_dim=16, tie_word_embeddings=True),
        "qwen3moe": lambda: tf.Qwen3MoeConfig(**DENSE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32),
        "mixtral": lambda: tf.MixtralConfig(**DENSE, num_local_experts=4, num_experts_per_tok=2),
        "gpt2": lambda: tf.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0),
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **{**DENSE, "num_key_value_heads": 4}, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1),
    }[kind]()


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_configs")
    out = {}
    for kind in ("llama", "qwen2", "qwen3-tied", "qwen3moe", "mixtral", "gpt2", "deepseek_v3"):
        _config(kind).save_pretrained(root / kind)
        out[kind] = root / kind
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3-tied", "qwen3moe", "mixtral", "gpt2"])
def test_the_planner_counts_what_the_model_holds(configs: dict[str, Path], kind: str) -> None:
    setup = plan_setup(compose_plan(["model=hf", f"model.config={configs[kind]}", *COMMON]))
    exact = hf_param_count(HFModelConfig(config=str(configs[kind]))).total
    assert setup.spec.total_params() == exact
    assert any("the planner's count equals the model's own" in n for n in setup.notes)
    assert setup.spec.is_moe == (kind in ("qwen3moe", "mixtral"))


def test_an_approximated_family_says_what_and_by_how_much(configs: dict[str, Path]) -> None:
    setup = plan_setup(compose_plan(["model=hf", f"model.config={configs['deepseek_v3']}", *COMMON]))
    assert hf_spec_notes(HFModelConfig(config=str(configs["deepseek_v3"])))[0].startswith("multi-head latent attention")
    assert any(n.startswith("hf: parameters") and "its memory and time are for that shape" in n for n in setup.notes)
    assert setup.spec.moe_layer_ids == [1]  # first_k_dense_replace=1


def test_plan_and_search_of_a_pretrained_directory(configs: dict[str, Path], tmp_path: Path) -> None:
    """``model.path`` (config + weights): the plan reads only the config; the search proposes layouts of 4 GPUs."""
    import torch

    model_dir = tmp_path / "pretrained"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config("qwen3moe")).save_pretrained(model_dir)
    cfg = compose_plan(["model=hf", f"model.path={model_dir}", "parallel=none", "parallel.ep=2", "trainer.devices=4",
                        "data=synthetic", "data.vocab_size=64", "data.seq_len=16", "plan.search=true",
                        "plan.trace=false", "plan.device=A100-40GB", f"output_dir={tmp_path / 'out'}"])
    outcome = run_plan(cfg)
    assert outcome.exit_code == 0 and outcome.plan["layout"]["ep"] == 2
    assert outcome.plan["total_params"] == hf_param_count(HFModelConfig(path=str(model_dir))).total
    assert outcome.plan["search"] and "layout search" in outcome.text and "A100-SXM-40GB" in outcome.text


def test_dry_run_traces_the_config_without_weights(configs: dict[str, Path], tmp_path: Path) -> None:
    """fp32 (``trainer=cpu``): the traced tp bytes equal the formulas. (Under ``bf16-mixed`` an fp32 Hugging Face
    model keeps its residual stream in fp32 — its RMSNorm returns the weight's dtype — while the formulas count
    16-bit activations: the dry run then reports the difference.)"""
    cfg = compose_plan(["model=hf", f"model.config={configs['llama']}", "trainer=cpu", "parallel=none", "parallel.tp=2",
                        "trainer.devices=2", "data=synthetic", "data.vocab_size=64", "data.seq_len=16",
                        "plan.trace=true", f"output_dir={tmp_path}"])
    outcome = run_plan(cfg)
    assert outcome.plan["dry_run"]["ok"], outcome.text[-3000:]
    assert outcome.exit_code == 0
