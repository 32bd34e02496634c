"""Streamed export: the safetensors writer (bytes equal ``save_file``'s, in any write order), shard planning
(``save_pretrained``'s rule), one-tensor-at-a-time reading of a DCP checkpoint, ``export_consolidated`` to a
file or a sharded directory (at most one checkpoint tensor alive), atomic outputs, and the grouping of
transformers-style conversions that need several tensors at once."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_4d.checkpoint import stream
from lightning_4d.checkpoint.stream import SafetensorsWriter, TensorSpec, parse_size, plan_shards


class LiveReads:
    """Bytes of the tensors ``CheckpointReader.read`` / ``read_rows`` returned that are still alive: now and at
    most; ``whole`` / ``rows``: the names read whole / in rows."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.live = self.peak = self.reads = 0
        self.whole: set[str] = set()
        self.rows: set[str] = set()
        real, real_rows = stream.CheckpointReader.read, stream.CheckpointReader.read_rows

        def track(value: torch.Tensor) -> torch.Tensor:
            self.reads += 1
            self.live += value.nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(value, self._free, value.nbytes)
            return value

        def read(reader: Any, name: str) -> torch.Tensor:
            self.whole.add(name)
            return track(real(reader, name))

        def read_rows(reader: Any, name: str, start: int, stop: int) -> torch.Tensor:
            self.rows.add(name)
            return track(real_rows(reader, name, start, stop))

        monkeypatch.setattr(stream.CheckpointReader, "read", read)
        monkeypatch.setattr(stream.CheckpointReader, "read_rows", read_rows)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


class StackedMoE(nn.Module):
    """Embedding, a norm, and stacked experts (``experts.w1 [E, F, H]``) as lightning_4d's MoE keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.norm = nn.LayerNorm(16)
        self.layer = nn.Module()
        self.layer.experts = nn.Module()
        self.layer.experts.w1 = nn.Parameter(torch.randn(4, 24, 16))
        self.layer.experts.w2 = nn.Parameter(torch.randn(4, 16, 24))
        self.register_buffer("steps", torch.arange(3))


def _save(module: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    from lightning_4d.checkpoint import save_sharded

    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    save_sharded({"state_dict": dict(state), "optimizer_states": [], "epoch": 0}, str(path), is_global_zero=True)
    return state


def _load_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        part = load_file(str(file))
        assert not set(part) & set(out), file
        out.update(part)
    return out


# ----------------------------------------------------------------------------------------------- writer
def test_writer_bytes_equal_save_file_in_any_order(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {"b": torch.randn(3, 4).bfloat16(), "a": torch.randn(5), "c": torch.arange(7), "empty": torch.zeros(0),
               "h": torch.randn(3).half(), "scalar": torch.tensor(2.5), "mask": torch.ones(2, dtype=torch.bool),
               "i8": torch.arange(5, dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    layout = plan_shards({k: TensorSpec.of(v) for k, v in tensors.items()}, None)
    assert list(layout) == ["model.safetensors"]
    (tmp_path / "out").mkdir()
    with SafetensorsWriter(tmp_path / "out", layout) as writer:
        for name in reversed(list(tensors)):
            writer.write(name, tensors[name])
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_writer_refuses_what_was_not_planned(tmp_path: Path) -> None:
    layout = {"model.safetensors": {"w": TensorSpec((2, 3), torch.float32), "v": TensorSpec((2,), torch.float32)}}
    writer = SafetensorsWriter(tmp_path, layout)
    with pytest.raises(ValueError, match=r"w is \(3, 2\) float32, the plan says \(2, 3\) float32"):
        writer.write("w", torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"w is \(2, 3\) bfloat16, the plan says \(2, 3\) float32"):
        writer.write("w", torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x is not in the planned export"):
        writer.write("x", torch.zeros(1))
    writer.write("w", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="w was written twice"):
        writer.write("w", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"1 planned tensors were never written \(v\)"):
        writer.close()


def test_plan_shards_follows_save_pretrained_rule() -> None:
    specs = {"a": TensorSpec((10,), torch.float32), "big": TensorSpec((100,), torch.float32),
             "b": TensorSpec((10,), torch.float32), "c": TensorSpec((10,), torch.float32)}
    layout = plan_shards(specs, 80)
    # In order; a tensor larger than the limit gets a file of its own at once (huggingface_hub's rule); a
    # file never grows past the limit.
    assert {f: list(t) for f, t in layout.items()} == {
        "model-00001-of-00003.safetensors": ["big"], "model-00002-of-00003.safetensors": ["a", "b"],
        "model-00003-of-00003.safetensors": ["c"]}
    assert list(plan_shards(specs, "1KB")) == ["model.safetensors"]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1.5MB") == 1_500_000
    with pytest.raises(ValueError, match=r"max_shard_size='5 apples' is not a size: .* e\.g\. '5GB'"):
        parse_size("5 apples")
    with pytest.raises(ValueError, match="at least one byte"):
        parse_size(0)


# ----------------------------------------------------------------------------------------------- consolidated export
def test_export_consolidated_streams_one_tensor_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_4d.checkpoint import export_consolidated, import_consolidated, read_model_state
    from lightning_4d.checkpoint.consolidate import split_experts

    torch.manual_seed(0)
    state = _save(StackedMoE(), tmp_path / "ckpt")
    assert {k: torch.equal(v, state[k]) for k, v in read_model_state(tmp_path / "ckpt").items()} == \
        {k: True for k in state}
    want = split_experts(state)
    live = LiveReads(monkeypatch)
    single = export_consolidated(tmp_path / "ckpt", tmp_path / "one" / "m.safetensors")
    from safetensors.torch import load_file

    got = load_file(str(single))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    largest = max(v.nbytes for v in state.values())
    assert live.reads == len(state) and live.peak == largest < sum(v.nbytes for v in state.values())

    shards = export_consolidated(tmp_path / "ckpt", tmp_path / "dir", max_shard_size=2000)
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in shards.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    got = _load_dir(shards)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not (tmp_path / "dir.partial").exists()
    assert live.peak == largest  # still one tensor at a time

    fresh = StackedMoE()
    import_consolidated(fresh, shards)  # a directory of shards seeds a module, experts stacked back
    assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())
    one = export_consolidated(tmp_path / "ckpt", tmp_path / "small")  # fits one shard: one file, no index
    assert sorted(p.name for p in one.iterdir()) == ["model.safetensors"]

    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        export_consolidated(tmp_path / "ckpt", shards)
    with pytest.raises(ValueError, match=r"max_shard_size='1GB' applies to a directory export"):
        export_consolidated(tmp_path / "ckpt", tmp_path / "x.safetensors", max_shard_size="1GB")
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors.index.json nor model.safetensors"):
        import_consolidated(fresh, tmp_path / "one")


@pytest.mark.parametrize("out", ["file.safetensors", "directory"])
def test_failed_export_leaves_nothing(out: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_4d.checkpoint import export_consolidated

    _save(StackedMoE(), tmp_path / "ckpt")
    real = SafetensorsWriter.write
    calls = {"n": 0}

    def failing(writer: SafetensorsWriter, name: str, tensor: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        real(writer, name, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", failing)
    with pytest.raises(OSError, match="No space left"):
        export_consolidated(tmp_path / "ckpt", tmp_path / out, max_shard_size=None if out.endswith("s") else 500)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # neither the output nor a .partial


# ----------------------------------------------------------------------------------------------- conversion groups
def _fuse_qkv(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A save-time conversion writing each layer's q, k, v as one ``qkv`` and splitting experts per expert."""
    out: dict[str, torch.Tensor] = {}
    for layer in ("l0", "l1"):
        parts = [sd[f"{layer}.attn.{p}.weight"] for p in "qkv" if f"{layer}.attn.{p}.weight" in sd]
        if parts:
            out[f"{layer}.attn.qkv.weight"] = torch.cat(parts)
    for key, value in sd.items():
        if key.endswith("experts"):
            out.update({f"{key}.{i}.weight": value[i] for i in range(value.shape[0])})
        elif ".attn." not in key:
            out[key] = value
    return out


def test_conversion_groups_keep_many_to_one_together() -> None:
    from lightning_4d.checkpoint.hf_export import conversion_groups

    shapes = {"norm": (4,), "l0.attn.q.weight": (4, 4), "l0.attn.k.weight": (2, 4), "l0.attn.v.weight": (2, 4),
              "l0.experts": (3, 2, 4), "l1.attn.q.weight": (4, 4), "l1.attn.k.weight": (2, 4),
              "l1.attn.v.weight": (2, 4)}
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    qkv = [[f"{layer}.attn.{p}.weight" for p in "qkv"] for layer in ("l0", "l1")]
    groups = conversion_groups(_fuse_qkv, meta)
    assert groups is not None
    assert [keys for keys, _ in groups] == [["norm"], qkv[0], ["l0.experts"], qkv[1]]
    assert groups[1][1] == {"l0.attn.qkv.weight": TensorSpec((8, 4), torch.float32)}
    assert list(groups[2][1]) == ["l0.experts.0.weight", "l0.experts.1.weight", "l0.experts.2.weight"]

    def needs_all(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if any(k.endswith("q.weight") for k in sd) and not any(k.endswith("k.weight") for k in sd):
            raise KeyError("k")  # a conversion that fails without the rest of its group
        return _fuse_qkv(sd)

    assert [keys for keys, _ in conversion_groups(needs_all, meta)] == [["norm"], qkv[0], ["l0.experts"], qkv[1]]

    def inconsistent(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"all" if len(sd) > 1 else next(iter(sd)): next(iter(sd.values()))}

    assert conversion_groups(inconsistent, meta) is None  # no split reproduces the whole: the caller takes all


def test_reader_reads_one_key(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = _save(StackedMoE(), tmp_path / "ckpt")
    reader = stream.CheckpointReader(tmp_path / "ckpt")
    assert reader.specs == {k: TensorSpec.of(v) for k, v in state.items()}
    assert torch.equal(reader.read("layer.experts.w2"), state["layer.experts.w2"])
    (tmp_path / "ckpt" / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"Could not read checkpoint .*__0_0\.distcp is missing"):
        reader.read("norm.weight")


def test_reader_reads_rows_from_the_chunks_holding_them(tmp_path: Path) -> None:
    """``read_rows`` equals the rows of the whole tensor, from a checkpoint whose stack is saved in several chunks
    (as under ep > 1): rows of one chunk read only that chunk's file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    torch.manual_seed(0)
    state = _save(StackedMoE(), tmp_path / "ckpt")
    reader = stream.CheckpointReader(tmp_path / "ckpt")
    name = "layer.experts.w2"
    full = state[name]
    for start, stop in [(0, 1), (1, full.shape[0]), (0, full.shape[0])]:
        assert torch.equal(reader.read_rows(name, start, stop), full[start:stop])
    with pytest.raises(ValueError, match=r"rows \[0, 99\) are outside"):
        reader.read_rows(name, 0, 99)
    # The planner's read items: only chunks that intersect the rows, at the right offsets.
    planner = stream._rows_planner("model." + name, 1, 2)
    meta = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    two = ChunkStorageMetadata(offsets=torch.Size([0, 0, 0]), sizes=torch.Size([1, *full.shape[1:]]))
    rest = ChunkStorageMetadata(offsets=torch.Size([1, 0, 0]), sizes=torch.Size([full.shape[0] - 1, *full.shape[1:]]))
    meta.state_dict_metadata["model." + name].chunks = [two, rest]
    planner.set_up_planner({"model." + name: torch.empty(1, *full.shape[1:])}, meta, True)
    items = planner.create_local_plan().items
    assert [(list(i.storage_index.offset), list(i.storage_offsets), list(i.dest_offsets), list(i.lengths))
            for i in items] == [([1, 0, 0], [0, 0, 0], [0, 0, 0], [1, *full.shape[1:]])]


def test_experts_exported_one_at_a_time() -> None:
    """A transformers MoE's fused expert stacks convert per expert (``per_row_outputs``): the export never holds a
    layer's whole stack; a tensor whose rows do not map to outputs (a dense weight) is written whole."""
    transformers = pytest.importorskip("transformers")
    from lightning_4d._compat.hf_saving import revert_conversion, saved_state
    from lightning_4d.checkpoint.hf_export import conversion_groups, per_row_outputs
    from tests.hf_tiny import tiny_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3moe", 64))
    saved = saved_state(model)
    revert = lambda sd: revert_conversion(model, sd)  # noqa: E731
    groups = conversion_groups(revert, saved)
    assert groups is not None
    per_row = {keys[0]: per_row_outputs(revert, keys[0], saved[keys[0]], out) for keys, out in groups if len(keys) == 1}
    experts = [k for k in per_row if ".experts." in k]
    assert experts and all(per_row[k] is not None for k in experts), experts
    names = per_row["model.layers.0.mlp.experts.down_proj"](3)
    assert list(names.values()) == ["model.layers.0.mlp.experts.3.down_proj.weight"]
    assert per_row["model.layers.0.self_attn.q_proj.weight"] is None
