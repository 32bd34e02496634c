"""``model=hf`` without a process group: config errors name the key, the rule and the fix; the fail-fast check
reads the Hugging Face config (heads, blocks, experts, exact parameter count); the network is the pretrained
model; ``export_hf`` strips prefixes, checks names, shapes and dtypes against the meta model, casts, streams
``save_pretrained``'s sharded layout one tensor at a time, and refuses what does not match."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_4d.recipes import build_network, check_resources, count_params, to_train_config, validate
from lightning_4d.recipes.resources import DeviceInventory, GiB, ResourceError
from lightning_4d.recipes.schema import RecipeConfigError
from tests.recipes.test_hf_finetune import DATA_VOCAB, MODEL_VOCAB, make_pretrained
from tests.recipes.test_recipes import _compose

transformers = pytest.importorskip("transformers")
CPU = DeviceInventory("cpu", 2, 16 * GiB)
DATA = ["data=synthetic", f"data.vocab_size={DATA_VOCAB}", "data.seq_len=16"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pretrained("llama", tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pretrained("qwen3moe", tmp_path_factory.mktemp("hf") / "qwen3moe")


def _cfg(*overrides: str) -> Any:
    return to_train_config(_compose(["model=hf", *DATA, "parallel=none", "trainer.devices=1", *overrides]))


# ----------------------------------------------------------------------------------------------- config errors
def test_missing_or_conflicting_source_fails_clearly(llama: Path) -> None:
    with pytest.raises(RecipeConfigError, match=r"model=hf needs model\.path=DIR .* or model\.config="):
        _cfg()
    with pytest.raises(RecipeConfigError, match=r"model\.path=.* and model\.config=.* are both set.*set one"):
        _cfg(f"model.path={llama}", f"model.config={llama}")
    with pytest.raises(RecipeConfigError, match=r"model\.dtype='fp8' is not one of 'float32', 'bfloat16'"):
        _cfg(f"model.path={llama}", "model.dtype=fp8")
    with pytest.raises(RecipeConfigError, match=r"model\.attn_implementation='flash' is not one of 'sdpa', 'eager'"):
        _cfg(f"model.path={llama}", "model.attn_implementation=flash")


def test_bad_paths_fail_clearly(llama: Path, tmp_path: Path) -> None:
    with pytest.raises(RecipeConfigError, match=r"model\.path='.*nowhere'.* does not exist: pass a local model dir"):
        validate(_cfg(f"model.path={tmp_path / 'nowhere'}"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeConfigError, match=r"holds no config\.json, so it is not a Hugging Face model directory"):
        validate(_cfg(f"model.path={tmp_path / 'empty'}"))
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    shutil.copy(llama / "config.json", only_config / "config.json")
    with pytest.raises(RecipeConfigError, match=r"holds config\.json but no weights .*model\.config="):
        validate(_cfg(f"model.path={only_config}"))
    validate(_cfg(f"model.config={only_config}"))  # a random model from the same config is fine
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(RecipeConfigError, match=r"model\.config=.*bad\.json.* has no 'model_type'"):
        validate(_cfg(f"model.config={tmp_path / 'bad.json'}"))


def test_data_must_fit_the_model(llama: Path) -> None:
    with pytest.raises(RecipeConfigError, match=rf"data vocabulary \(128 ids\) exceeds the vocab_size={MODEL_VOCAB} "
                                                r"of model\.path="):
        validate(_cfg(f"model.path={llama}", "data.vocab_size=128"))
    validate(_cfg(f"model.path={llama}", f"data.vocab_size={MODEL_VOCAB}"))  # equal is fine
    with pytest.raises(RecipeConfigError, match=r"data\.seq_len=128 exceeds max_position_embeddings=64"):
        validate(_cfg(f"model.path={llama}", "data.seq_len=128"))
    validate(_cfg(f"model.path={llama}", "meta_init=true"))  # safetensors: streamed into each rank's shards


def test_meta_init_needs_safetensors(llama: Path, tmp_path: Path) -> None:
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    shutil.copy(llama / "config.json", bin_only / "config.json")
    torch.save({}, bin_only / "pytorch_model.bin")
    validate(_cfg(f"model.path={bin_only}"))  # meta_init=null: loaded whole on every rank
    with pytest.raises(RecipeConfigError, match=r"meta_init=true with model\.path=.*holds none \(pytorch_model\*\.bin "
                                                r"only\)\. Convert it once .* or set meta_init=null"):
        validate(_cfg(f"model.path={bin_only}", "meta_init=true"))


# ----------------------------------------------------------------------------------------------- fail-fast check
def test_resources_read_the_hf_config(llama: Path, moe: Path) -> None:
    for directory in (llama, moe):
        net = transformers.AutoModelForCausalLM.from_pretrained(directory)
        assert count_params(_cfg(f"model.path={directory}").model).total == sum(p.numel() for p in net.parameters())
    counted = count_params(_cfg(f"model.path={moe}").model)
    experts = sum(p.numel() for n, p in transformers.AutoModelForCausalLM.from_pretrained(moe).named_parameters()
                  if ".experts." in n)
    assert counted.expert == experts > 0 and counted.active == counted.dense + experts // 2  # top-2 of 4
    with pytest.raises(ResourceError, match=r"tp=4 does not divide heads=\d+ and kv_heads=2"):
        check_resources(_cfg(f"model.path={llama}", "parallel.tp=4", "trainer.devices=4"), CPU)
    with pytest.raises(ResourceError, match=r"pp·v = 4 stages exceed the 2 layers"):
        check_resources(_cfg(f"model.path={llama}", "parallel.pp=4", "trainer.devices=4"), CPU)
    with pytest.raises(ResourceError, match=r"ep=2 needs an MoE model"):
        check_resources(_cfg(f"model.path={llama}", "parallel.ep=2", "trainer.devices=2"), CPU)
    with pytest.raises(ResourceError, match=r"ep=8 needs an MoE model whose num_experts=4 it divides"):
        check_resources(_cfg(f"model.path={moe}", "parallel.ep=8", "trainer.devices=8"), CPU)
    check_resources(_cfg(f"model.path={moe}", "parallel.tp=2", "parallel.ep=2", "trainer.devices=2"), CPU)


def test_planner_plans_hf_from_its_config(llama: Path) -> None:
    """``recipes/plan.py model=hf`` (issue 24; more in tests/recipes/test_plan_hf.py): the planner's count is the
    model's own."""
    from lightning_4d.recipes.planning import plan_setup

    setup = plan_setup(_cfg(f"model.path={llama}"))
    assert setup.spec.total_params() == count_params(_cfg(f"model.path={llama}").model).total


# ----------------------------------------------------------------------------------------------- the network
def test_network_is_the_pretrained_model(llama: Path) -> None:
    from lightning_4d.models import HFLogits

    net = build_network(_cfg(f"model.path={llama}"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama)
    assert isinstance(net, HFLogits) and net.model.config._attn_implementation == "sdpa"
    assert net.model.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in net.model.state_dict().items())
    tokens = torch.randint(0, DATA_VOCAB, (2, 8))
    assert torch.equal(net(tokens), ref(tokens).logits)
    assert build_network(_cfg(f"model.path={llama}", "model.dtype=bfloat16")).model.dtype == torch.bfloat16
    assert build_network(_cfg(f"model.path={llama}", "model.attn_implementation=eager")).model.config \
        ._attn_implementation == "eager"
    # Random init from a config: seeded, so every rank (and every run) builds the same model.
    torch.manual_seed(0)
    a = build_network(_cfg(f"model.config={llama / 'config.json'}"))
    torch.manual_seed(0)
    b = build_network(_cfg(f"model.config={llama / 'config.json'}"))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.lm_head.weight, ref.lm_head.weight)


# ----------------------------------------------------------------------------------------------- export
def _checkpoint(base: Path, path: Path, record: bool = True, scale: float = 1.5) -> dict[str, torch.Tensor]:
    """A one-process sharded checkpoint of CausalLM(HFLogits(base)) with changed weights; returns them."""
    from lightning_4d.checkpoint import save_sharded
    from lightning_4d.models import CausalLM, HFLogits
    from lightning_4d.models.hf import CHECKPOINT_KEY, checkpoint_record

    lm = CausalLM(HFLogits.from_pretrained(base))
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(scale)
    checkpoint: dict[str, Any] = {"state_dict": dict(lm.state_dict()), "optimizer_states": [], "epoch": 0}
    if record:
        checkpoint[CHECKPOINT_KEY] = checkpoint_record(lm)
    save_sharded(checkpoint, str(path), is_global_zero=True)
    return {k: v.clone() for k, v in lm.model.model.state_dict().items()}


def test_export_writes_the_trained_weights(llama: Path, tmp_path: Path) -> None:
    from lightning_4d.checkpoint import export_hf

    want = _checkpoint(llama, tmp_path / "ckpt")
    out = export_hf(tmp_path / "ckpt", tmp_path / "out")  # config and tokenizer from the checkpoint's record
    got = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (out / "tokenizer.json").is_file() and not (tmp_path / "out.partial").exists()
    half = export_hf(tmp_path / "ckpt", tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(half, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, want["lm_head.weight"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        export_hf(tmp_path / "ckpt", out)


def test_export_refuses_what_does_not_match(llama: Path, tmp_path: Path) -> None:
    from lightning_4d.checkpoint import export_hf

    _checkpoint(llama, tmp_path / "bare", record=False)
    with pytest.raises(ValueError, match=r"records no Hugging Face config .* --base DIR"):
        export_hf(tmp_path / "bare", tmp_path / "out")
    assert export_hf(tmp_path / "bare", tmp_path / "out", base=llama).is_dir()  # a base makes it work
    deeper = tmp_path / "deeper"
    config = json.loads((llama / "config.json").read_text())
    deeper.mkdir()
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"does not match LlamaForCausalLM: \d+ missing keys \(model\.layers\.2\."):
        export_hf(tmp_path / "bare", tmp_path / "out2", base=deeper)
    wider = tmp_path / "wider"
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": MODEL_VOCAB + 8}))
    with pytest.raises(ValueError, match=r"shape mismatches .*model\.embed_tokens\.weight"):
        export_hf(tmp_path / "bare", tmp_path / "out3", base=wider)
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
    with pytest.raises(FileNotFoundError, match=r"base=.*nowhere: .* does not exist"):
        export_hf(tmp_path / "bare", tmp_path / "out4", base=tmp_path / "nowhere")


@pytest.mark.parametrize("kind", ["qwen3moe", "qwen3-tied"])
def test_export_streams_save_pretrained_layout(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharded like save_pretrained, the same tensors under the same names (experts split per expert, the tied
    head stored once), one checkpoint tensor in memory at a time, and from_pretrained gives the same logits."""
    from lightning_4d.checkpoint import export_hf
    from tests.recipes.test_hf_finetune import make_pretrained
    from tests.unit.test_export_stream import LiveReads, _load_dir

    base = make_pretrained(kind, tmp_path / "base")
    want = _checkpoint(base, tmp_path / "ckpt")
    trained = transformers.AutoModelForCausalLM.from_pretrained(base)
    trained.load_state_dict(want)
    trained.save_pretrained(tmp_path / "ref", max_shard_size="40KB")
    live = LiveReads(monkeypatch)
    out = export_hf(tmp_path / "ckpt", tmp_path / "out", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_parameters"] == trained.num_parameters()
    written, reference = _load_dir(out), _load_dir(tmp_path / "ref")
    assert written.keys() == reference.keys() == index["weight_map"].keys()
    assert all(torch.equal(written[k], reference[k]) for k in reference)
    assert ("lm_head.weight" in written) == (kind != "qwen3-tied")
    # One tensor at a time, and a stacked expert tensor one expert at a time: never a layer's whole stack.
    stacks = {k for k, v in want.items() if ".experts." in k and v.dim() == 3}
    assert (len(stacks) > 0) == (kind == "qwen3moe")
    assert all(any(n.endswith(k) for n in live.rows) for k in stacks), (sorted(live.rows), sorted(stacks))
    assert not {n for n in live.whole if ".experts." in n}, live.whole
    pieces = [v.nbytes // (v.shape[0] if k in stacks else 1) for k, v in want.items()]
    sizes = {k: v.nbytes for k, v in want.items()}
    assert live.peak == max(pieces) < sum(sizes.values()) / 4
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokens = torch.randint(0, DATA_VOCAB, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, trained(tokens).logits)
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(trained).__name__]
    assert not (tmp_path / "out.partial").exists()


def test_export_refuses_other_dtypes(llama: Path, tmp_path: Path) -> None:
    from lightning_4d.checkpoint import export_hf, save_sharded
    from lightning_4d.models import CausalLM, HFLogits

    lm = CausalLM(HFLogits.from_pretrained(llama))
    state = dict(lm.state_dict())
    state["model.model.model.norm.weight"] = state["model.model.model.norm.weight"].long()
    save_sharded({"state_dict": state, "optimizer_states": [], "epoch": 0}, str(tmp_path / "ckpt"),
                 is_global_zero=True)
    with pytest.raises(ValueError, match=r"1 dtype mismatches \(checkpoint vs model: model\.norm\.weight torch\.int64 "
                                         r"vs torch\.float32\); only floating-point weights are cast"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", base=llama)
    with pytest.raises(ValueError, match=r"max_shard_size='big' is not a size"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", base=llama, max_shard_size="big")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_strip_prefix_and_tied_weights() -> None:
    from lightning_4d.checkpoint.hf_export import load_strict, strip_prefix

    prefix, state = strip_prefix({"model.model.a.w": 1, "model.model.b": 2, "extra": 3}, ["a.w", "b"])
    assert prefix == "model.model." and state == {"a.w": 1, "b": 2, "extra": 3}
    tied = torch.nn.Module()
    tied.emb, tied.head = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False)
    tied.head.weight = tied.emb.weight
    load_strict(tied, {"emb.weight": torch.ones(4, 2)})  # the tied name may be absent
    assert torch.equal(tied.head.weight, torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"1 unexpected keys \(extra\)"):
        load_strict(tied, {"emb.weight": torch.ones(4, 2), "extra": torch.ones(1)})
