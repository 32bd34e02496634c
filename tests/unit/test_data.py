"""Tests of lightning_4d.data: tokenizers, token files, corpus preparation, datasets, DataModules, CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_4d.data import (
    DEFAULT_MAX_BYTES,
    ByteTokenizer,
    SyntheticDataModule,
    SyntheticTokenDataset,
    TextDataModule,
    TokenFile,
    Tokenizer,
    TokenWindowDataset,
    dtype_for_vocab,
    get_tokenizer,
    iter_texts,
    prepare,
    sidecar_path,
    stdlib_files,
    write_tokens,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HAS_TIKTOKEN = importlib.util.find_spec("tiktoken") is not None
TEXT = "Hello, wörld! ✓ 🚀\nline two\n" * 40


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text(TEXT, encoding="utf-8")
    return p


# ----------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tok = get_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 256 and tok.eot_id is None
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and max(ids) < 256
    arr = tok.encode_array(TEXT)
    assert arr.dtype == np.int64 and arr.tolist() == ids
    assert tok.decode(ids) == TEXT
    assert tok.decode(np.asarray(ids)) == TEXT and tok.decode(torch.tensor(ids)) == TEXT
    assert tok.encode("") == [] and tok.decode([]) == ""
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # a cut multi-byte char decodes without raising
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([256])


def test_byte_tokenizer_special_tokens() -> None:
    tok = ByteTokenizer(special_tokens=["<|endoftext|>", "<|pad|>"])
    assert tok.vocab_size == 258 and tok.eot_id == 256
    text = "a<|endoftext|>b<|pad|>"
    assert tok.encode(text) == list(text.encode())  # specials are plain text unless allowed
    ids = tok.encode(text, allow_special=True)
    assert ids == [97, 256, 98, 257]
    assert tok.decode(ids) == text
    assert tok.encode_array("<|pad|>", allow_special=True).tolist() == [257]
    with pytest.raises(ValueError, match="duplicate"):
        ByteTokenizer(["x", "x"])


def test_get_tokenizer_passthrough_and_errors() -> None:
    tok = ByteTokenizer()
    assert get_tokenizer(tok) is tok
    with pytest.raises(TypeError, match="tokenizer name"):
        get_tokenizer(3)  # type: ignore[arg-type]


@pytest.mark.skipif(HAS_TIKTOKEN, reason="tests the message shown when tiktoken is missing")
def test_get_tokenizer_without_tiktoken() -> None:
    with pytest.raises(ImportError, match=r"'gpt2' needs the optional package 'tiktoken'.*tokenizer='byte'"):
        get_tokenizer("gpt2")


# ----------------------------------------------------------------------------------- token files


@pytest.mark.parametrize(
    ("vocab_size", "dtype", "ids"),
    [(256, np.uint16, [0, 7, 255]), (65536, np.uint16, [0, 65535]), (100_277, np.uint32, [0, 65536, 100_276])],
)
def test_write_read_token_file(tmp_path: Path, vocab_size: int, dtype: type, ids: list[int]) -> None:
    path = tmp_path / "sub" / "t.bin"
    tf = write_tokens(path, np.asarray(ids), vocab_size=vocab_size, tokenizer="tok", extra={"note": 1})
    assert dtype_for_vocab(vocab_size) == np.dtype(dtype)
    assert path.stat().st_size == len(ids) * np.dtype(dtype).itemsize
    meta = json.loads(sidecar_path(path).read_text())
    assert meta["dtype"] == np.dtype(dtype).name and meta["num_tokens"] == len(ids)
    assert meta["vocab_size"] == vocab_size and meta["tokenizer"] == "tok" and meta["note"] == 1
    tf = TokenFile(path)
    assert tf.dtype == dtype and len(tf) == len(ids) and tf.vocab_size == vocab_size
    assert tf[:].tolist() == ids and np.asarray(tf).tolist() == ids
    assert isinstance(tf.tokens, np.memmap) and not tf.tokens.flags.writeable
    tf.check(vocab_size=vocab_size, tokenizer="tok")
    clone = pickle.loads(pickle.dumps(tf))  # what DataLoader workers receive
    assert clone._data is None and clone[:].tolist() == ids
    assert not list(path.parent.glob(".*.tmp"))  # no temporary files left behind


def test_empty_token_file(tmp_path: Path) -> None:
    tf = write_tokens(tmp_path / "e.bin", [], vocab_size=256)
    assert len(tf) == 0 and tf[:].size == 0


def test_write_tokens_validates(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"must lie in \[0, 256\)"):
        write_tokens(tmp_path / "a.bin", [1, 256], vocab_size=256)
    with pytest.raises(ValueError, match="1-D"):
        write_tokens(tmp_path / "a.bin", [[1, 2]], vocab_size=256)
    with pytest.raises(TypeError, match="integers"):
        write_tokens(tmp_path / "a.bin", [1.5], vocab_size=256)
    with pytest.raises(ValueError, match="override"):
        write_tokens(tmp_path / "a.bin", [1], vocab_size=256, extra={"dtype": "x"})
    assert not (tmp_path / "a.bin").exists()


def test_token_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="python -m lightning_4d.data prepare"):
        TokenFile(tmp_path / "missing.bin")
    path = tmp_path / "t.bin"
    write_tokens(path, np.arange(10), vocab_size=256)
    # size disagrees with the sidecar
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="sidecar mismatch.*10 uint16 tokens"):
        TokenFile(path)
    # tokenizer / vocab disagree with what the caller expects
    tf = write_tokens(path, np.arange(10), vocab_size=256, tokenizer="byte")
    with pytest.raises(ValueError, match="sidecar mismatch.*tokenizer 'byte', expected 'gpt2'"):
        tf.check(tokenizer="gpt2")
    with pytest.raises(ValueError, match="sidecar mismatch.*vocab_size 256"):
        tf.check(vocab_size=50257)
    # malformed sidecars
    side = sidecar_path(path)
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({**meta, "dtype": "float32"}))
    with pytest.raises(ValueError, match="dtype 'float32'"):
        TokenFile(path)
    side.write_text(json.dumps({k: v for k, v in meta.items() if k != "num_tokens"}))
    with pytest.raises(ValueError, match="lacks keys.*num_tokens"):
        TokenFile(path)
    side.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        TokenFile(path)
    side.unlink()
    with pytest.raises(FileNotFoundError, match="sidecar"):
        TokenFile(path)


# ----------------------------------------------------------------------------------- prepare


def test_prepare_from_text_file(tmp_path: Path, text_file: Path) -> None:
    r = prepare(text_file, tmp_path / "out", val_fraction=0.25)
    n = len(TEXT.encode())
    assert r.num_files == 1 and r.num_bytes == n
    assert len(r.train) + len(r.val) == n and len(r.val) == round(n * 0.25)
    tok = get_tokenizer("byte")
    assert tok.decode(np.concatenate([r.train[:], r.val[:]])) == TEXT
    assert r.train.meta["source"]["sources"] == [str(text_file.resolve())]
    assert (tmp_path / "out" / "train.bin.json").is_file() and (tmp_path / "out" / "val.bin.json").is_file()


def test_prepare_from_directory_and_eot(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "a.txt").write_text("AAA")
    (src / "b" / "c.md").write_text("CC")
    (src / "skip.bin").write_bytes(b"\x00\x01")
    r = prepare([src], tmp_path / "out", tokenizer=ByteTokenizer(["<|endoftext|>"]), val_fraction=0.0)
    assert r.num_files == 2 and len(r.val) == 0
    assert r.train[:].tolist() == [65, 65, 65, 256, 67, 67, 256]  # sorted files, EOT-separated
    assert r.train.vocab_size == 257


def test_prepare_stdlib_default(tmp_path: Path) -> None:
    files = stdlib_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert all("site-packages" not in f.parts for f in files)
    r1 = prepare(None, tmp_path / "a", max_bytes=30_000)
    r2 = prepare(None, tmp_path / "b", max_bytes=30_000)
    assert r1.num_bytes <= 30_000 and r1.num_files >= 2
    assert len(r1.train) + len(r1.val) == r1.num_bytes
    assert (tmp_path / "a" / "train.bin").read_bytes() == (tmp_path / "b" / "train.bin").read_bytes()
    assert r1.train.meta["source"] == {"sources": None, "max_bytes": 30_000, "val_fraction": 0.05}
    head = files[0].read_bytes()[:2000]
    assert r1.train[: len(head)].tolist() == list(head)  # corpus starts with the first sorted file
    docs = list(iter_texts(None, max_bytes=1000))
    assert docs[0][0] == files[0] and sum(len(t.encode()) for _, t in docs) <= 1000
    assert DEFAULT_MAX_BYTES == 4_000_000


def test_prepare_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare(tmp_path / "nope.txt", tmp_path / "out")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        prepare(tmp_path / "empty.txt", tmp_path / "out")
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        prepare(tmp_path / "d", tmp_path / "out")
    with pytest.raises(ValueError, match="val_fraction"):
        prepare(None, tmp_path / "out", val_fraction=1.0)
    with pytest.raises(ValueError, match="no text sources"):
        prepare([], tmp_path / "out")
    with pytest.raises(ValueError, match="max_bytes"):
        prepare(None, tmp_path / "out", max_bytes=0)
    assert not (tmp_path / "out" / "train.bin").exists()


# ----------------------------------------------------------------------------------- datasets


def test_token_window_dataset(tmp_path: Path) -> None:
    tf = write_tokens(tmp_path / "t.bin", np.arange(21), vocab_size=256)
    ds = TokenWindowDataset(tf, seq_len=4)
    assert len(ds) == 5  # windows need seq_len + 1 tokens: starts 0, 4, 8, 12, 16
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == torch.long and x.shape == y.shape == (4,)
        assert torch.equal(x, torch.arange(4 * i, 4 * i + 4)) and torch.equal(y, x + 1)
    assert torch.equal(ds[-1][0], ds[4][0])
    with pytest.raises(IndexError):
        ds[5]
    overlapping = TokenWindowDataset(np.arange(21), seq_len=4, stride=2)
    assert len(overlapping) == 9 and overlapping[8][1].tolist() == [17, 18, 19, 20]
    assert len(TokenWindowDataset(tf, seq_len=20)) == 1
    with pytest.raises(ValueError, match=r"not enough tokens in .*t\.bin.*: 21 tokens.*needs 22"):
        TokenWindowDataset(tf, seq_len=21)
    with pytest.raises(ValueError, match="stride"):
        TokenWindowDataset(tf, seq_len=4, stride=0)


def test_synthetic_dataset_kinds() -> None:
    for kind in ("random", "increment", "repeat"):
        ds = SyntheticTokenDataset(8, seq_len=12, vocab_size=10, kind=kind, period=3, seed=1)  # type: ignore[arg-type]
        x, y = ds[2]
        assert x.shape == y.shape == (12,) and x.dtype == torch.long
        assert torch.equal(x[1:], y[:-1]) and int(x.max()) < 10 and int(x.min()) >= 0
        assert torch.equal(ds[2][0], SyntheticTokenDataset(8, 12, 10, kind, 3, seed=1)[2][0])  # type: ignore[arg-type]
        if kind == "increment":
            assert torch.equal((x + 1) % 10, y)
        if kind == "repeat":
            assert torch.equal(x[3:], x[:-3])
    with pytest.raises(ValueError, match="kind"):
        SyntheticTokenDataset(1, 2, 3, kind="zigzag")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- DataModules


def test_text_datamodule_default_corpus(tmp_path: Path) -> None:
    dm = TextDataModule(tmp_path, seq_len=32, batch_size=4, max_bytes=20_000, seed=3)
    assert dm.vocab_size == 256
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    dm.prepare_data()
    stamp = dm.train_path.stat().st_mtime_ns
    dm.prepare_data()  # up to date: not rebuilt
    assert dm.train_path.stat().st_mtime_ns == stamp
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.drop_last and isinstance(loader.sampler, torch.utils.data.RandomSampler)
    x, y = next(iter(loader))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long and torch.equal(x[:, 1:], y[:, :-1])
    # the same seed gives the same shuffle
    dm2 = TextDataModule(tmp_path, seq_len=32, batch_size=4, max_bytes=20_000, seed=3)
    dm2.prepare_data()
    dm2.setup("fit")
    assert torch.equal(next(iter(dm2.train_dataloader()))[0], x)
    vx, vy = next(iter(dm.val_dataloader()))
    assert vx.shape == (4, 32) and torch.equal(vx[0], dm.val_dataset[0][0])  # type: ignore[index]
    # a different cap makes the files stale
    dm3 = TextDataModule(tmp_path, seq_len=32, batch_size=4, max_bytes=10_000)
    dm3.prepare_data()
    dm3.setup("fit")
    assert len(dm3.train_file) + len(dm3.val_file) <= 10_000  # type: ignore[arg-type]


def test_text_datamodule_user_text(tmp_path: Path, text_file: Path) -> None:
    out = tmp_path / "data"
    dm = TextDataModule(out, text=[str(text_file)], seq_len=16, batch_size=2, val_fraction=0.1)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_file) + len(dm.val_file) == len(TEXT.encode())  # type: ignore[arg-type]
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    # files prepared from user text are reused when no text is given
    stamp = dm.train_path.stat().st_mtime_ns
    reuse = TextDataModule(out, seq_len=16, batch_size=2)
    reuse.prepare_data()
    assert dm.train_path.stat().st_mtime_ns == stamp
    # ... but a tokenizer other than the one they were written with is refused
    other = TextDataModule(out, seq_len=16, batch_size=2, tokenizer="gpt2")
    other.prepare_data()  # reuses the files: prepared from user text
    with pytest.raises(ValueError, match="sidecar mismatch.*tokenizer 'byte', expected 'gpt2'"):
        other.setup("fit")
    # a validation split shorter than one window gives a clear error
    big = TextDataModule(out, seq_len=200, batch_size=1)
    big.setup("fit")
    with pytest.raises(ValueError, match="validation split .* fewer than seq_len \\+ 1 = 201"):
        big.val_dataloader()
    # a batch larger than the dataset would silently yield nothing
    huge = TextDataModule(out, seq_len=16, batch_size=10_000)
    huge.setup("fit")
    with pytest.raises(ValueError, match="fewer than batch_size=10000"):
        huge.train_dataloader()


def test_synthetic_datamodule() -> None:
    dm = SyntheticDataModule(vocab_size=16, seq_len=8, batch_size=4, num_train_samples=16, num_val_samples=8, seed=5)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    again = SyntheticDataModule(vocab_size=16, seq_len=8, batch_size=4, num_train_samples=16, num_val_samples=8, seed=5)
    assert torch.equal(next(iter(again.train_dataloader()))[0], x)
    assert len(dm.train_dataloader()) == 4 and len(dm.val_dataloader()) == 2
    assert not torch.equal(dm.train_dataset[0][0], dm.val_dataset[0][0])


def test_datamodule_with_trainer(tmp_path: Path) -> None:
    """Lightning accepts the DataModule: batches reach training_step as (inputs, targets)."""
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16)
            self.shapes: list[tuple[int, ...]] = []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            self.shapes.append(tuple(x.shape))
            logits = self.head(self.emb(x))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Tiny()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, SyntheticDataModule(vocab_size=16, seq_len=8, batch_size=2, kind="increment"))
    assert model.shapes == [(2, 8), (2, 8)]


# ----------------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "lightning_4d.data", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )


def test_cli_prepare_and_info(tmp_path: Path, text_file: Path) -> None:
    out = tmp_path / "tok"
    res = _cli("prepare", "--out", str(out), "--text", str(text_file), "--val-fraction", "0.5")
    assert res.returncode == 0, res.stderr
    n = len(TEXT.encode())
    assert f"{n} bytes" in res.stdout and f"train: {n - n // 2} tokens" in res.stdout
    assert f"val: {n // 2} tokens" in res.stdout
    assert len(TokenFile(out / "train.bin")) + len(TokenFile(out / "val.bin")) == n

    from lightning_4d.data.__main__ import main

    assert main(["info", str(out)]) == 0
    assert main(["prepare", "--out", str(tmp_path / "x"), "--text", str(tmp_path / "missing.txt")]) == 1


def test_cli_error_exit_code(tmp_path: Path) -> None:
    res = _cli("prepare", "--out", str(tmp_path / "o"), "--text", str(tmp_path / "nope"))
    assert res.returncode == 1 and "does not exist" in res.stderr


def test_pin_memory_follows_the_trainers_device() -> None:
    """``pin_memory=None`` (the default): pinned loaders when the attached Trainer trains on CUDA only; ``True`` /
    ``False`` as given."""
    from types import SimpleNamespace

    from lightning_4d.data import SyntheticDataModule

    dm = SyntheticDataModule(vocab_size=16, seq_len=4, batch_size=2, num_train_samples=4, num_val_samples=2)
    assert dm.pin_memory is None and not dm.train_dataloader().pin_memory  # no Trainer attached
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    assert not dm.train_dataloader().pin_memory
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    assert dm.train_dataloader().pin_memory and dm.val_dataloader().pin_memory
    dm.pin_memory = False
    assert not dm.train_dataloader().pin_memory
