"""``HFWeightSource`` and ``HFLogits.from_pretrained`` on the meta device, in one process: the weights streamed from
a directory's safetensors files equal ``AutoModelForCausalLM.from_pretrained``'s exactly (single-file and sharded
layouts, tied heads, transformers' fused MoE experts, dtypes), files that do not fit the model fail before anything
is read (naming keys and shapes), missing or unused keys warn, nothing stays mapped after a read, and the recipe
builds ``model=hf`` on meta under ``FourDStrategy``. The sharded (multi-rank) load is in
``tests/distributed/test_hf_streamed_load.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_4d.models import HFLogits
from lightning_4d.models.hf_source import HFWeightSource, WeightMappingError, materialize_pretrained
from tests.distributed.test_hf_streamed_load import VOCAB, save_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
load_file, save_file = safetensors_torch.load_file, safetensors_torch.save_file

KINDS = ["llama", "qwen3-tied", "qwen3moe", "mixtral"]


def _reference(directory: Path, dtype: Any = torch.float32) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")


def _streamed(directory: Path, **options: Any) -> HFLogits:
    with torch.device("meta"):
        net = HFLogits.from_pretrained(directory, **options)
    assert all(p.is_meta for p in net.parameters())
    return materialize_pretrained(net)


def _assert_same(net: HFLogits, ref: Any) -> None:
    got, want = net.model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"differ from from_pretrained: {bad[:6]}"


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_equals_from_pretrained(kind: str, tmp_path: Path) -> None:
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    for shard in (None, "30KB"):
        directory = save_model(kind, tmp_path / f"{kind}-{shard}", shard)
        assert (directory / "model.safetensors.index.json").is_file() == (shard is not None)
        ref, net = _reference(directory), _streamed(directory)
        _assert_same(net, ref)  # buffers too: rotary inv_freq recomputed by the model's own initialisers
        with torch.no_grad():
            assert torch.equal(net(tokens), ref(tokens).logits)
        source = net.model.fourd_weight_source
        assert source.missing == [] and source.unexpected == []
        if kind == "qwen3-tied":  # the file omits the tied head; it is the embedding, loaded once
            assert net.model.lm_head.weight is net.model.model.embed_tokens.weight
            assert "lm_head.weight" not in source.names()
        if kind in ("qwen3moe", "mixtral"):  # per-expert file tensors fused into transformers 5's 3-D experts
            fused = "model.layers.0.mlp.experts.gate_up_proj"
            assert fused in source.names() and source.get(fused).shape == ref.get_parameter(fused).shape
            assert len(source._groups[fused].sources) == 2 * 4  # gate and up of each of the 4 experts


def test_dtypes(tmp_path: Path) -> None:
    directory = save_model("llama", tmp_path / "fp32")
    net = _streamed(directory, dtype="bfloat16")  # cast as read
    _assert_same(net, _reference(directory, torch.bfloat16))
    half = tmp_path / "bf16"
    _reference(directory, torch.bfloat16).save_pretrained(half)
    auto = _streamed(half, dtype="auto")  # the saved dtype (config.json)
    assert {p.dtype for p in auto.parameters()} == {torch.bfloat16}
    _assert_same(auto, _reference(half, "auto"))


def test_reads_one_tensor_at_a_time_and_leaves_nothing_mapped(tmp_path: Path) -> None:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    directory = save_model("qwen3moe", tmp_path / "moe", "30KB")
    with torch.device("meta"):
        net = HFLogits.from_pretrained(directory)
    source = net.model.fourd_weight_source
    assert source.reads == 0  # building and checking read headers only
    for name in source.names():
        source.get(name)
        assert str(directory) not in maps.read_text(), f"a safetensors file of {directory} stayed mapped"
    assert source.reads == len(source._files)  # every checkpoint tensor read exactly once


def test_files_of_another_shape_fail_before_reading(tmp_path: Path) -> None:
    directory = save_model("llama", tmp_path / "llama")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB + 8}))
    with pytest.raises(WeightMappingError, match=r"checkpoint key lm_head\.weight hold shape \(96, 32\) for "
                                                 r"lm_head\.weight, the model expects \(104, 32\)\. Is the directory "
                                                 r"another model's"), torch.device("meta"):
        HFLogits.from_pretrained(directory)


def test_unmappable_keys_fail_naming_them(tmp_path: Path) -> None:
    directory = save_model("qwen3moe", tmp_path / "moe")
    file = directory / "model.safetensors"
    original = load_file(file)
    renamed = {k.replace(".gate_proj.", ".w_gate.").replace(".up_proj.", ".w_up.") if ".experts." in k else k: v
               for k, v in original.items()}
    save_file(renamed, file, metadata={"format": "pt"})
    with pytest.raises(WeightMappingError, match=r"checkpoint keys model\.layers\.0\.mlp\.experts\.0\.w_gate\.weight.*"
                                                 r"match no tensor of Qwen3MoeForCausalLM, and its parameters "
                                                 r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*have no checkpoint key"), \
            torch.device("meta"):
        HFLogits.from_pretrained(directory)
    # An expert absent from the files: transformers' converter cannot fuse the layer; the keys are named.
    save_file({k: v for k, v in original.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}, file,
              metadata={"format": "pt"})
    with pytest.raises(WeightMappingError, match=r"conversion of checkpoint keys model\.layers\.1\.mlp\.experts\.0\."
                                                 r".* into model\.layers\.1\.mlp\.experts\.gate_up_proj failed"), \
            torch.device("meta"):
        HFLogits.from_pretrained(directory)


def test_missing_or_unused_keys_warn(tmp_path: Path) -> None:
    directory = save_model("llama", tmp_path / "llama")
    file = directory / "model.safetensors"
    original = load_file(file)
    save_file({k: v for k, v in original.items() if k != "model.norm.weight"}, file, metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"missing \(kept as initialised\): model\.norm\.weight"):
        net = _streamed(directory)
    assert torch.equal(net.model.model.norm.weight, torch.ones(32))  # the model's own initialisation
    save_file({**original, "model.extra.weight": torch.zeros(2)}, file, metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"all model parameters present; unused checkpoint keys: model\.extra\.weight"):
        net = _streamed(directory)
    _assert_same(net, _reference(directory))


def test_experts_stacked_where_transformers_has_no_rule(tmp_path: Path) -> None:
    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(3, 4, 2))

    model = torch.nn.Module()
    model.experts = Experts()
    parts = {f"experts.{i}.w.weight": torch.full((4, 2), float(i)) for i in range(3)}
    save_file(parts, tmp_path / "model.safetensors")
    source = HFWeightSource(tmp_path, model)
    assert source.names() == ["experts.w"] and source.missing == []
    assert torch.equal(source.get("experts.w"), torch.stack(list(parts.values())))
    save_file({k: v for k, v in parts.items() if not k.startswith("experts.2.")}, tmp_path / "model.safetensors")
    with pytest.raises(WeightMappingError, match=r"keys experts\.0\.w\.weight, experts\.1\.w\.weight match no tensor "
                                                 r".* parameters experts\.w have no checkpoint key"):
        HFWeightSource(tmp_path, model)


@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral", "llama"])
def test_rows_read_only_their_experts(kind: str, tmp_path: Path) -> None:
    """``get_rows`` equals the rows of the whole tensor, for every tensor, and reads only the checkpoint keys of
    its experts (2 keys per expert for the fused gate/up, 1 for down) or one slice of a tensor stored whole."""
    directory = save_model(kind, tmp_path / kind, "30KB")
    with torch.device("meta"):
        net = HFLogits.from_pretrained(directory)
    source = net.model.fourd_weight_source
    checked = 0
    for name in source.names():
        full = source.get(name)
        rows = full.shape[0]
        for start, stop in {(0, rows), (rows - 1, rows), (rows // 2, rows)}:
            before = source.reads
            piece = source.get_rows(name, start, stop)
            assert piece.dtype == full.dtype and torch.equal(piece, full[start:stop]), (name, start, stop)
            group = source._groups[source._owner[name]]
            per_row = len(group.sources) // rows if group.converter is not None else 0
            assert source.reads - before == (per_row * (stop - start) if per_row else 1), name
            checked += 1
    assert checked and source.whole_reads == set()
    if kind != "llama":
        assert source._row_sources(source._groups["model.layers.0.mlp.experts.down_proj"]) is not None


def test_rows_of_a_stack_without_transformers_rule(tmp_path: Path) -> None:
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.w = torch.nn.Parameter(torch.empty(3, 4, 2))
    parts = {f"experts.{i}.w.weight": torch.full((4, 2), float(i)) for i in range(3)}
    save_file(parts, tmp_path / "model.safetensors")
    source = HFWeightSource(tmp_path, model)
    before = source.reads
    assert torch.equal(source.get_rows("experts.w", 1, 3), torch.stack([parts["experts.1.w.weight"],
                                                                         parts["experts.2.w.weight"]]))
    assert source.reads - before == 2


def test_from_pretrained_meta_switch(tmp_path: Path) -> None:
    directory = save_model("llama", tmp_path / "llama")
    eager = HFLogits.from_pretrained(directory)
    assert not hasattr(eager.model, "fourd_weight_source") and not any(p.is_meta for p in eager.parameters())
    forced = HFLogits.from_pretrained(directory, meta=True)
    assert isinstance(forced.model.fourd_weight_source, HFWeightSource)
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    (bin_only / "config.json").write_text((directory / "config.json").read_text())
    torch.save({}, bin_only / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"holds no \*\.safetensors weights: .*meta=False"):
        HFLogits.from_pretrained(bin_only, meta=True)


def test_recipe_builds_on_meta_under_the_strategy(tmp_path: Path) -> None:
    import lightning as L

    from lightning_4d import FourDStrategy
    from lightning_4d.recipes import build_model, to_train_config
    from tests.recipes.test_recipes import _compose

    directory = save_model("qwen3moe", tmp_path / "moe")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FourDStrategy(), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    base = ["model=hf", f"model.path={directory}", "data=synthetic", f"data.vocab_size={VOCAB}", "data.seq_len=16",
            "parallel=none", "trainer.devices=1"]
    lm = build_model(to_train_config(_compose(base)), trainer)
    assert all(p.is_meta for p in lm.parameters()), "model=hf under FourDStrategy is built on the meta device"
    assert isinstance(lm.model.model.fourd_weight_source, HFWeightSource)
    whole = build_model(to_train_config(_compose([*base, "meta_init=false"])), trainer)
    assert not any(p.is_meta for p in whole.parameters()), "meta_init=false loads the whole model"


def test_rows_of_a_conversion_without_rows_read_the_tensor_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group whose rows are not per-index keys is read whole once for all its pieces, and released after."""
    directory = save_model("qwen3moe", tmp_path / "m")
    with torch.device("meta"):
        net = HFLogits.from_pretrained(directory)
    source = net.model.fourd_weight_source
    name = "model.layers.0.mlp.experts.gate_up_proj"
    monkeypatch.setattr(source, "_row_sources", lambda group: None)  # as for a conversion that needs every row
    full, calls = source.get(name), []
    real_get = source.get
    monkeypatch.setattr(source, "get", lambda n: calls.append(n) or real_get(n))
    assert torch.equal(torch.cat([source.get_rows(name, i, i + 1) for i in range(full.shape[0])]), full)
    assert calls == [name] and source.whole_reads == {name}
    source.release()
    assert source._whole is None
