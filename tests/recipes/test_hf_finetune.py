"""Fine-tune a Hugging Face model end to end, offline: ``save_pretrained`` a tiny random model, train it with
``recipes/train.py``'s ``run`` (``model=hf model.path=DIR``) under a parallel layout, export the sharded
checkpoint with ``export-hf``, ``from_pretrained`` the export, and check that

(a) the exported model's ``state_dict`` keys (and shapes) equal the original model's, and the safetensors hold the
    same names as the original's (tied weights stored once, experts in transformers' on-disk format; Llama and
    Mixtral exported in shards with an index, the others in one file);
(b) its logits on a fixed batch equal the logits the trained, sharded model computed inside the training world
    (``trainer.strategy.predict`` at ``on_train_end``: full logits on every rank, through the pipeline schedule
    under pp, gathered from the vocab-sharded head under tp), within ``TOL`` relative (fp32);
(c) training changed the model: the exported logits differ from the original model's by far more than ``TOL``
    (so (b) cannot pass by exporting the untrained weights).

Layouts: dense Llama (untied head) under tp=2, dense Qwen3 (tied embeddings: first and last stage share a weight)
under pp=2; Qwen3-MoE under tp=2 × ep=2 and Mixtral under pp=2 × tp=2 × ep=2 (transformers' fused experts,
expert-parallel in place). Tiny shapes, 3 steps, gloo on CPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_4d.recipes import conf_dir, register_configs
from lightning_4d.testing import run_world

os.environ.setdefault("OMP_NUM_THREADS", "1")
transformers = pytest.importorskip("transformers")

from tests.hf_tiny import tiny_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONF = str(conf_dir())
MODEL_VOCAB = 96      # larger than the data's vocabulary: fine-tuning data need not use every id
DATA_VOCAB = 64
SEQ = 16
BATCH = 4             # per dp rank; 2 micro-batches under pp=2
STEPS = 3
# Logits of one fp32 model computed by two layouts differ by the rounding of reductions split or reordered across
# ranks: a few ulps (fp32 eps = 1.2e-7) of the O(1) logits, times the depth of the model. 1e-5 relative is ~100 eps:
# far above that noise, far below a wrong weight (a single swapped or stale tensor moves logits by O(1e-2..1)).
TOL = 1e-5
# Training must move the logits well beyond TOL, or check (b) proves nothing.
MIN_CHANGE = 100 * TOL
PG_TIMEOUT_S = 60

COMMON = [
    "model=hf", "trainer.max_steps=3", "trainer.log_every_n_steps=1", "trainer.val_check_interval=null",
    "trainer.limit_val_batches=0", "callbacks.progress_bar=false", "callbacks.checkpoint=true",
    "optim.lr=1e-3", "optim.warmup_steps=0", "optim.schedule=constant", "parallel=none",
    "data=synthetic", f"data.vocab_size={DATA_VOCAB}", f"data.seq_len={SEQ}", f"data.batch_size={BATCH}",
    "data.num_train_samples=64", "data.kind=random",
]
# name -> (model kind, world, parallel overrides)
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "llama-tp2": ("llama", 2, ["parallel.tp=2"]),
    "qwen3-tied-pp2": ("qwen3-tied", 2, ["parallel.pp=2"]),
    "qwen3moe-tp2-ep2": ("qwen3moe", 2, ["parallel.tp=2", "parallel.ep=2"]),
    "mixtral-pp2-tp2-ep2": ("mixtral", 4, ["parallel.pp=2", "parallel.tp=2", "parallel.ep=2"]),
}


# ----------------------------------------------------------------------------------------------- the "pretrained" model
def _config(kind: str) -> Any:
    return tiny_config(kind, MODEL_VOCAB)


def _tokenizer(directory: Path) -> None:
    """A word-level tokenizer written by save_pretrained (built in code, nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(MODEL_VOCAB - 1)} | {"<unk>": MODEL_VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(directory)


def make_pretrained(kind: str, directory: Path) -> Path:
    """``save_pretrained`` of a seeded tiny random model (and a tokenizer) into ``directory``."""
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    model.save_pretrained(directory)
    _tokenizer(directory)
    return directory


def fixed_tokens() -> torch.Tensor:
    return torch.randint(0, DATA_VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------------------------- inside the world
class FinalLogits(L.Callback):
    """At the end of training, the full logits of the trained (sharded) model on ``tokens``, saved by rank 0."""

    def __init__(self, tokens: torch.Tensor, path: str) -> None:
        self.tokens, self.path = tokens, path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.eval()
        with torch.no_grad():
            logits = trainer.strategy.predict(pl_module, self.tokens.to(pl_module.device))
        full = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        if trainer.is_global_zero:
            torch.save(full.detach().cpu().float(), self.path)


def _finetune(rank: int, overrides: list[str], tokens: torch.Tensor, logits_path: str) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir

    from lightning_4d.recipes import run

    register_configs()
    with initialize_config_dir(CONF, version_base=None):
        cfg = compose("train", overrides)
    result = run(cfg, callbacks=[FinalLogits(tokens, logits_path)])
    return {"checkpoint": result.checkpoint, "losses": result.losses}


def finetune(layout: str, base: Path, out: Path, world: int, parallel: list[str]) -> dict[str, Any]:
    overrides = [*COMMON, f"model.path={base}", f"trainer.devices={world}", *parallel, f"output_dir={out}"]
    logits = out / "final_logits.pt"
    results = run_world(_finetune, world, overrides, fixed_tokens(), str(logits), timeout_s=420,
                        pg_timeout_s=PG_TIMEOUT_S)
    got = results[0]
    assert all(r == got for r in results), f"{layout}: ranks disagree on checkpoint/losses: {results}"
    assert got["checkpoint"] and Path(got["checkpoint"]).is_dir(), f"{layout}: no checkpoint written: {got}"
    return {**got, "logits": torch.load(logits)}


# ----------------------------------------------------------------------------------------------- checks
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _load(directory: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")


def _file_keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            keys |= set(fh.keys())
    return keys


def check_export(layout: str, base: Path, exported: Path, trained_logits: torch.Tensor) -> dict[str, float]:
    original, model = _load(base), _load(exported)
    own, got = original.state_dict(), model.state_dict()
    assert list(got) == list(own), f"{layout}: exported keys differ: {sorted(set(got) ^ set(own))[:8]}"
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in own.items()}, layout
    assert _file_keys(exported) == _file_keys(base), f"{layout}: {sorted(_file_keys(exported) ^ _file_keys(base))}"
    assert type(model) is type(original)
    tokens = fixed_tokens()
    with torch.no_grad():
        logits = model(tokens).logits.float()
        before = original(tokens).logits.float()
    assert logits.shape == trained_logits.shape == (BATCH, SEQ, MODEL_VOCAB), (logits.shape, trained_logits.shape)
    err, change = _rel(logits, trained_logits), _rel(before, trained_logits)
    assert change > MIN_CHANGE, f"{layout}: training barely changed the logits ({change:.2e}); the check proves nothing"
    assert err <= TOL, f"{layout}: exported logits differ from the trained model's by {err:.2e} relative (> {TOL})"
    return {"rel_err": err, "change": change}


def _export_cli(checkpoint: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lightning_4d.checkpoint", "export-hf", checkpoint, str(out), *extra],
                          check=False, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)


# ----------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", ["llama-tp2", "qwen3-tied-pp2"])
def test_dense_finetune_export_roundtrip(layout: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    kind, world, parallel = LAYOUTS[layout]
    base = make_pretrained(kind, tmp_path / "pretrained")
    start = time.perf_counter()
    got = finetune(layout, base, tmp_path / "run", world, parallel)
    assert len(got["losses"]) == STEPS and all(math.isfinite(x) for x in got["losses"]), got["losses"]
    exported = tmp_path / "exported"
    if layout == "llama-tp2":  # the command line, config and base directory taken from the checkpoint's record
        proc = _export_cli(got["checkpoint"], exported, "--max-shard-size", "40KB")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (exported / "model.safetensors.index.json").is_file()  # sharded as save_pretrained shards
    else:  # the Python API with an explicit base
        from lightning_4d.checkpoint import export_hf

        assert export_hf(got["checkpoint"], exported, base=base) == exported
    numbers = check_export(layout, base, exported, got["logits"])
    # Tokenizer files travel with the weights.
    assert (exported / "tokenizer.json").is_file() and (exported / "tokenizer_config.json").is_file()
    assert transformers.AutoTokenizer.from_pretrained(exported)("w3 w5")["input_ids"] == [3, 5]
    with capsys.disabled():
        print(f"\n{layout}: max rel logits error {numbers['rel_err']:.2e}, change by training {numbers['change']:.2e}, "
              f"{time.perf_counter() - start:.1f}s")


@pytest.mark.parametrize("layout", ["qwen3moe-tp2-ep2", "mixtral-pp2-tp2-ep2"])
def test_moe_finetune_export_roundtrip(layout: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    kind, world, parallel = LAYOUTS[layout]
    base = make_pretrained(kind, tmp_path / "pretrained")
    start = time.perf_counter()
    got = finetune(layout, base, tmp_path / "run", world, parallel)
    from lightning_4d.checkpoint import export_hf

    # Mixtral: sharded (several model-0000k-of-0000n.safetensors + index); Qwen3-MoE: one file.
    exported = export_hf(got["checkpoint"], tmp_path / "exported", max_shard_size="40KB" if "mixtral" in layout
                         else "50GB")
    assert (exported / "model.safetensors.index.json").is_file() == ("mixtral" in layout)
    numbers = check_export(layout, base, exported, got["logits"])
    with capsys.disabled():
        print(f"\n{layout}: max rel logits error {numbers['rel_err']:.2e}, change by training {numbers['change']:.2e}, "
              f"{time.perf_counter() - start:.1f}s")


# ----------------------------------------------------------------------------------------------- chat fine-tuning
# A local model directory with its own tokenizer and a local chat JSONL (lightning_4d.data.example: a byte-level BPE
# tokenizer with a ChatML template, a tiny random Qwen3-MoE), fine-tuned by the recipe with data=chat.
CHAT_STEPS = 12
CHAT = ["model=hf", "data.seq_len=48", "data.batch_size=8", "data.val_fraction=0.125",
        f"trainer.max_steps={CHAT_STEPS}", f"trainer.val_check_interval={CHAT_STEPS}", "trainer.log_every_n_steps=1",
        "callbacks.progress_bar=false", "callbacks.checkpoint=true", "optim.lr=3e-3",
        "optim.warmup_steps=0", "optim.schedule=constant", "parallel=none"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_4d.data.example import write_chat_example

    return write_chat_example(tmp_path_factory.mktemp("chat") / "tiny-qwen3-moe", n=128)["model"]


def _chat_cfg(base: Path, *overrides: str, data: str = "chat") -> Any:
    from lightning_4d.recipes import to_train_config
    from tests.recipes.test_recipes import _compose

    files = [f"data.files=[{base / 'chat.jsonl'}]"] if data == "chat" else []
    return to_train_config(_compose([*CHAT, f"data={data}", f"model.path={base}", *files, *overrides]))


def test_tokenizer_mismatch_refused_before_training(chat_model: Path, tmp_path: Path) -> None:
    from lightning_4d.data import prepare
    from lightning_4d.recipes import validate
    from lightning_4d.recipes.schema import RecipeConfigError

    words = REPO / "tests" / "recipes" / "data" / "tiny_tokenizer"
    c = validate(_chat_cfg(chat_model, f"data.data_dir={tmp_path / 'd'}"))
    assert c.data.tokenizer == str(chat_model)  # auto: the model's own
    with pytest.raises(RecipeConfigError, match=r"data\.tokenizer='.*tiny_tokenizer' was tokenized by "
                                                r"'hf:tiny_tokenizer' \(38 ids.*but the expected tokenizer is "
                                                r"'hf:tiny-qwen3-moe' \(\d+ ids.*their vocabularies differ.*"
                                                r"data\.tokenizer=auto"):
        validate(_chat_cfg(chat_model, f"data.tokenizer={words}"))
    prepare(None, tmp_path / "bytes", max_bytes=2000)  # token files of the byte tokenizer
    with pytest.raises(RecipeConfigError, match=r"data\.data_dir=.* \(train\.bin\) was tokenized by 'byte' .*"
                                                r"the tokenizers differ.*data=chat"):
        validate(_chat_cfg(chat_model, f"data.data_dir={tmp_path / 'bytes'}", data="token_dir"))
    with pytest.raises(RecipeConfigError, match=r"data\.tokenizer='byte' was tokenized by 'byte'.*model\.path="):
        validate(_chat_cfg(chat_model, data="stdlib"))
    bare = make_pretrained("llama", tmp_path / "bare")  # a model directory whose tokenizer is missing
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(RecipeConfigError, match=r"data\.tokenizer=auto: model\.path=.* holds no tokenizer files"):
        validate(_chat_cfg(bare))


class DataReport(L.Callback):
    """Per rank: whether this rank tokenized (``prepare_data`` ran here) and the labels of the validation data."""

    def __init__(self) -> None:
        self.report: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        self.report = {"prepared": None if dm.prepare_result is None else dm.prepare_result.describe()}


def _chat_world(rank: int, overrides: list[str], out: str) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir

    from lightning_4d.recipes import run

    register_configs()
    with initialize_config_dir(CONF, version_base=None):
        cfg = compose("train", overrides)
    report = DataReport()
    result = run(cfg, callbacks=[report])
    return {"checkpoint": result.checkpoint, "losses": result.losses, **report.report,
            "metrics": {k: v for k, v in result.metrics.items() if k.startswith("val_")}}


def _one_process_metrics(model_dir: Path, base: Path, data_dir: Path) -> dict[str, float]:
    """val_loss / val_ppl / val_acc of the exported model in this process, with torchmetrics' own Perplexity and
    MulticlassAccuracy on the full logits, over the run's validation batches (the token files it prepared)."""
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.text import Perplexity

    from lightning_4d.data import HFDataModule

    model = _load(model_dir).eval()
    dm = HFDataModule([base / "chat.jsonl"], data_dir, base, data_format="chat", seq_len=48, batch_size=8,
                      val_fraction=0.125)
    dm.setup("validate")
    ppl, acc = Perplexity(ignore_index=-100), MulticlassAccuracy(model.config.vocab_size, average="micro",
                                                                 ignore_index=-100)
    with torch.no_grad():
        for x, y in dm.val_dataloader():
            logits = model(x).logits.float()
            ppl.update(logits, y)
            acc.update(logits.argmax(-1), y)
    return {"val_ppl": float(ppl.compute()), "val_acc": float(acc.compute())}


def test_chat_finetune_with_its_own_tokenizer_tp_pp_ep(chat_model: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """tp=2 × pp=2 × ep=2 (4 ranks): answer-token loss falls; val metrics equal one process's (torchmetrics on the
    exported model); tokenized once, on one rank; the export loads with from_pretrained, tokenizer files there."""
    start = time.perf_counter()
    data_dir, out = tmp_path / "data", tmp_path / "run"
    overrides = [*CHAT, "data=chat", f"model.path={chat_model}", f"data.files=[{chat_model / 'chat.jsonl'}]",
                 f"data.data_dir={data_dir}", "trainer.devices=4", "parallel.tp=2", "parallel.pp=2", "parallel.ep=2",
                 f"output_dir={out}"]
    ranks = run_world(_chat_world, 4, overrides, str(out), timeout_s=420, pg_timeout_s=PG_TIMEOUT_S)
    got = ranks[0]
    assert all(r["losses"] == got["losses"] and r["metrics"] == got["metrics"] for r in ranks)
    assert got["prepared"] is not None and "tokenized in" in got["prepared"]  # rank 0 of the node tokenized
    assert all(r["prepared"] is None for r in ranks[1:])                     # the others did not
    losses = got["losses"]
    assert len(losses) == CHAT_STEPS and sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    # Export: from_pretrained loads it; the tokenizer (and its chat template) travel with it.
    from lightning_4d.checkpoint import export_hf

    exported = export_hf(got["checkpoint"], tmp_path / "exported")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {p.name for p in exported.iterdir()}
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    messages = [{"role": "user", "content": "What colour is the kite?"}]
    assert tok.apply_chat_template(messages) == transformers.AutoTokenizer.from_pretrained(chat_model) \
        .apply_chat_template(messages)
    # The metrics the 4-rank run logged equal torchmetrics' in one process on the same weights.
    ref = _one_process_metrics(exported, chat_model, data_dir)
    assert got["metrics"]["val_acc"] == ref["val_acc"], (got["metrics"], ref)
    assert abs(got["metrics"]["val_ppl"] / ref["val_ppl"] - 1) < 1e-5, (got["metrics"], ref)
    assert abs(math.log(ref["val_ppl"]) / got["metrics"]["val_loss"] - 1) < 1e-2  # ppl is exp(token-mean loss)
    with capsys.disabled():
        print(f"\nchat tp2×pp2×ep2: loss {losses[0]:.3f} -> {losses[-1]:.3f}, val_ppl {got['metrics']['val_ppl']:.4f} "
              f"(one process {ref['val_ppl']:.4f}), val_acc {got['metrics']['val_acc']:.4f}; {got['prepared']}; "
              f"{time.perf_counter() - start:.1f}s")


def test_packed_chat_finetune_pp(chat_model: Path, tmp_path: Path) -> None:
    """``data.pack=true`` end to end under pp=2 (2 ranks): the packed samples' ``position_ids`` travel through the
    pipeline stages into the Hugging Face model (attention within each conversation) and the answer-token loss
    falls, equal on both ranks."""
    overrides = [*CHAT, "data=chat", f"model.path={chat_model}", f"data.files=[{chat_model / 'chat.jsonl'}]",
                 f"data.data_dir={tmp_path / 'data'}", "data.pack=true", "trainer.devices=2", "parallel.pp=2",
                 "callbacks.checkpoint=false", f"output_dir={tmp_path / 'run'}"]
    ranks = run_world(_chat_world, 2, overrides, str(tmp_path / "run"), timeout_s=300, pg_timeout_s=PG_TIMEOUT_S)
    losses = ranks[0]["losses"]
    assert ranks[1]["losses"] == losses and all(math.isfinite(v) for v in losses)
    assert len(losses) == CHAT_STEPS and sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
