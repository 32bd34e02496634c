"""The model's own tokenizer, offline, and datasets from the files users have (lightning_4d.data: tokenizer records,
chat templates, prepare_dataset, MaskedTokenDataset, HFDataModule).

Tokenizers are built here (a word-level one committed under tests/recipes/data/tiny_tokenizer: one token per word,
so counts can be done by hand; a byte-level BPE trained in the test); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_4d.data import (
    ChatTemplateError,
    HFDataModule,
    HFTokenizer,
    MaskedTokenDataset,
    TokenWindowDataset,
    check_same_tokenizer,
    encode_chat,
    get_tokenizer,
    open_split,
    prepare_dataset,
    to_messages,
    tokenizer_record,
    write_tokens,
)
from lightning_4d.data import prepared
from lightning_4d.data.example import CHATML_TEMPLATE, conversations, tiny_chat_tokenizer

pytest.importorskip("transformers")
pytest.importorskip("datasets")

FIXTURES = Path(__file__).resolve().parents[1] / "recipes" / "data"
WORDS = FIXTURES / "tiny_tokenizer"  # word level: every word, punctuation mark and special token is one id
CHAT = FIXTURES / "chat.jsonl"       # conversations(12): every third with a system turn
ROWS = [json.loads(line) for line in CHAT.read_text().splitlines()]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer with the ChatML template (merges across turn boundaries are possible)."""
    directory = tmp_path_factory.mktemp("bpe")
    texts = [m["content"] for r in conversations(64) for m in r["messages"]]
    tiny_chat_tokenizer(texts, vocab_size=320).save_pretrained(directory)
    return directory


def _hf(directory: Path) -> Any:
    return HFTokenizer(directory).hf


# ----------------------------------------------------------------------------------------------- tokenizer record
def test_hf_tokenizer_offline_record_and_mismatch(tmp_path: Path, bpe_dir: Path) -> None:
    tok = get_tokenizer(str(WORDS))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 38 and tok.eot_id == 3
    assert tok.decode(tok.encode("The door is blue .")) == "The door is blue ."
    record = tokenizer_record(tok)
    assert record["special_ids"] == {"bos": None, "eos": 3, "pad": 1, "unk": 0} and len(record["vocab_sha256"]) == 16
    moved = shutil.copytree(WORDS, tmp_path / "elsewhere")  # the same tokenizer saved anywhere is the same
    check_same_tokenizer(tokenizer_record(HFTokenizer(moved)), record, "x", "fix")
    with pytest.raises(ValueError, match=r"x was tokenized by 'hf:bpe\d*' \(\d+ ids, eos 2, pad 0, vocabulary \w+\) "
                                         r"but the expected tokenizer is 'hf:tiny_tokenizer' \(38 ids.*their "
                                         r"vocabularies differ, so its ids would mean other tokens\. fix"):
        check_same_tokenizer(tokenizer_record(HFTokenizer(bpe_dir)), record, "x", "fix")
    changed = json.loads((moved / "tokenizer_config.json").read_text())
    changed["eos_token"] = "<|endoftext|>"  # same vocabulary, another EOS id
    (moved / "tokenizer_config.json").write_text(json.dumps(changed))
    with pytest.raises(ValueError, match="their eos ids differ"):
        check_same_tokenizer(tokenizer_record(HFTokenizer(moved)), record, "x", "fix")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer files"):
        HFTokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="is a path but not a directory holding a Hugging Face tokenizer"):
        get_tokenizer(str(tmp_path / "nowhere" / "x"))
    # Token files record the tokenizer; a file written by another one is refused.
    tf = write_tokens(tmp_path / "t.bin", [1, 2], vocab_size=tok.vocab_size, tokenizer=tok)
    assert tf.tokenizer_record == record
    tf.check(tokenizer=tokenizer_record(HFTokenizer(moved.parent / "elsewhere")) | {"special_ids": {"eos": 3}})
    with pytest.raises(ValueError, match=r"token file '.*t\.bin' was tokenized by 'hf:tiny_tokenizer'.*differ.*redo"):
        tf.check(tokenizer=tokenizer_record(HFTokenizer(bpe_dir)), fix="redo")


# ----------------------------------------------------------------------------------------------- chat template
def _conversations() -> list[list[dict[str, str]]]:
    multi = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Colour of the kite?"},
             {"role": "assistant", "content": "The kite is red."}, {"role": "user", "content": "And the cup?"},
             {"role": "assistant", "content": "The cup is white.\nIt is new."}]
    return [r["messages"] for r in conversations(6)] + [multi]


def test_chat_encoding_is_apply_chat_template_with_answers_marked(bpe_dir: Path) -> None:
    hf = _hf(bpe_dir)
    generation = CHATML_TEMPLATE.replace(
        "{{ message['content'] }}<|im_end|>\n",
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}"
        "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}")
    for messages in _conversations():
        ids, mask = encode_chat(hf, messages)
        assert ids == hf.apply_chat_template(messages)["input_ids"]
        answers = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert hf.decode([i for i, k in zip(ids, mask) if k]) == answers
        # transformers' own assistant mask (a template with {% generation %} markers) agrees token for token.
        hf.chat_template = generation
        assert encode_chat(hf, messages) == (ids, mask)
        hf.chat_template = CHATML_TEMPLATE
        assert encode_chat(hf, messages, mask_prompt=False) == (ids, [1] * len(ids))
    assert to_messages({"prompt": "p", "response": "r"}, system_prompt="s")[0] == {"role": "system", "content": "s"}
    with pytest.raises(ChatTemplateError, match=r"neither 'messages'.*nor both 'prompt' and 'response'.*\['text'\]"):
        to_messages({"text": "x"})
    with pytest.raises(ChatTemplateError, match="no assistant turn"):
        encode_chat(hf, [{"role": "user", "content": "hi"}])
    # A template that rewrites earlier turns (here: drops past answers) cannot be masked by prefixes.
    hf.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>"
                        "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ChatTemplateError, match=r"renders the first 3 messages .*differently.*data\.mask_prompt=false"):
        encode_chat(hf, _conversations()[-1])
    hf.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        encode_chat(hf, _conversations()[0])


# ----------------------------------------------------------------------------------------------- packing and masking
def _by_hand(rows: list[dict[str, Any]]) -> tuple[list[list[int]], list[int]]:
    """Per conversation: its ids (apply_chat_template) and its answer tokens counted by hand (word level: every
    word and punctuation mark of an answer, plus its <|im_end|>)."""
    import re

    hf = _hf(WORDS)
    ids = [hf.apply_chat_template(r["messages"])["input_ids"] for r in rows]
    answers = [sum(len(re.findall(r"\w+|[^\w\s]", m["content"])) + 1 for m in r["messages"]
                   if m["role"] == "assistant") for r in rows]
    return ids, answers


def test_chat_packing_and_masking_exact_counts(tmp_path: Path) -> None:
    result = prepare_dataset(CHAT, tmp_path / "chat", WORDS, data_format="chat", val_fraction=0.25, seed=3)
    assert not result.cached and (result.documents, result.val_documents) == (9, 3)
    picked = sorted(np.random.default_rng(3).permutation(12)[:3].tolist())
    ids, answers = _by_hand(ROWS)
    assert answers[:3] == [5 + 1, 5 + 1, 5 + 1]  # "The kettle is green ." + <|im_end|>
    for split, rows in (("train", [i for i in range(12) if i not in picked]), ("val", picked)):
        tokens, mask, docs = open_split(tmp_path / "chat", split)
        assert tokens.tokens.tolist() == [t for i in rows for t in ids[i]]
        assert docs.tolist() == np.cumsum([0] + [len(ids[i]) for i in rows]).tolist()
        assert int(mask.sum()) == sum(answers[i] for i in rows) == tokens.meta["answer_tokens"]
        # One conversation per sample: every answer token is a target, nothing else is.
        longest = max(len(ids[i]) for i in rows)
        ds = MaskedTokenDataset(tokens, mask, docs, seq_len=longest - 1, pad_id=1)
        assert len(ds) == len(rows) and ds.truncated == 0 and ds.num_targets() == sum(answers[i] for i in rows)
        x, y = ds[0]
        row = ids[rows[0]]
        assert x.tolist() == (row + [1] * longest)[: longest - 1]  # padded with pad_id
        assert [t for t in y.tolist() if t != -100] == [t for t, k in zip(row[1:], mask[1:len(row)]) if k]
        # Cut short: conversations longer than seq_len + 1 lose their tail (its answer tokens).
        short = MaskedTokenDataset(tokens, mask, docs, seq_len=20, pad_id=1)
        assert short.truncated == sum(len(ids[i]) > 21 for i in rows)
        kept = sum(int(np.asarray(mask[docs[k]:docs[k] + 21])[1:].sum()) for k in range(len(rows)))
        assert short.num_targets() == kept
        # Packed: windows over the stream; the targets are the answer tokens inside the windows.
        packed = MaskedTokenDataset(tokens, mask, docs, seq_len=16, pack=True)
        covered = (len(packed) - 1) * 16 + 17
        assert len(packed) == (tokens.num_tokens - 17) // 16 + 1
        assert packed.num_targets() == sum(int(mask[i]) for w in range(len(packed))
                                           for i in range(w * 16 + 1, w * 16 + 17)) and covered <= tokens.num_tokens


def test_text_packing_with_eos_exact(tmp_path: Path, bpe_dir: Path) -> None:
    docs = ["The kite is red.", "What colour is the cup?\nThe cup is white.", "héllo wörld ✓"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    result = prepare_dataset(tmp_path / "a.jsonl", tmp_path / "out", bpe_dir, data_format="text", text_field="body",
                             val_fraction=0.2)
    hf = _hf(bpe_dir)
    stream = [t for d in docs for t in hf(d)["input_ids"] + [hf.eos_token_id]]
    n_val = round(len(stream) * 0.2)
    assert result.train.tokens.tolist() + result.val.tokens.tolist() == stream
    assert result.val.num_tokens == n_val and result.train.tokenizer_record == tokenizer_record(HFTokenizer(bpe_dir))
    assert len(TokenWindowDataset(result.train, seq_len=4)) == (len(stream) - n_val - 5) // 4 + 1
    # Other formats of the same documents give the same tokens: a text file per document, Parquet.
    for i, d in enumerate(docs):
        (tmp_path / "txt").mkdir(exist_ok=True)
        (tmp_path / "txt" / f"{i}.txt").write_text(d)
    import pandas as pd

    pd.DataFrame({"body": docs}).to_parquet(tmp_path / "a.parquet")
    for source, extra in ((tmp_path / "txt", {}), (tmp_path / "a.parquet", {"text_field": "body"})):
        again = prepare_dataset(source, tmp_path / f"out-{source.name}", bpe_dir, data_format="text",
                                val_fraction=0.2, **extra)
        assert again.train.tokens.tolist() + again.val.tokens.tolist() == stream, source
    with pytest.raises(ValueError, match=r"has no field 'text'.*\['body'\].*data\.text_field"):
        prepare_dataset(tmp_path / "a.jsonl", tmp_path / "bad", bpe_dir, data_format="text")
    with pytest.raises(ValueError, match=r"unknown suffix '\.xml'"):
        (tmp_path / "x.xml").write_text("<a/>")
        prepare_dataset(tmp_path / "x.xml", tmp_path / "bad", bpe_dir)


# ----------------------------------------------------------------------------------------------- cache and workers
def test_tokenized_once_cached_and_redone_on_change(tmp_path: Path, bpe_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(40)))
    out = tmp_path / "out"
    first = prepare_dataset(data, out, bpe_dir, data_format="chat", num_proc=1)
    assert not first.cached and first.workers == 1 and first.tokens_per_second > 0
    written = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    assert sorted(written) == ["train.bin", "train.bin.json", "train.docs", "train.mask", "val.bin", "val.bin.json",
                               "val.docs", "val.mask"]  # the datasets cache is gone

    def no_tokenizing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tokenized again")

    with monkeypatch.context() as m:
        m.setattr(prepared, "_tokenize", no_tokenizing)
        second = prepare_dataset(data, out, bpe_dir, data_format="chat", num_proc=1)
        assert second.cached and second.train.num_tokens == first.train.num_tokens
        assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == written
        assert "cached (nothing tokenized)" in second.describe()
    # Two worker processes write the same bytes (any change of the source re-tokenizes: here num_proc is not part
    # of it, so a new directory).
    two = prepare_dataset(data, tmp_path / "two", bpe_dir, data_format="chat", num_proc=2)
    assert two.workers == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "two").iterdir()} == {k: v[1] for k, v in written.items()}
    # What re-tokenizes: the data file changing, a field, the chat template.
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    assert not prepare_dataset(data, out, bpe_dir, data_format="chat", num_proc=1).cached
    assert not prepare_dataset(data, out, bpe_dir, data_format="chat", num_proc=1, system_prompt="Hi.").cached
    moved = shutil.copytree(bpe_dir, tmp_path / "tok")
    assert prepare_dataset(data, out, moved, data_format="chat", num_proc=1, system_prompt="Hi.").cached
    hf = _hf(moved)
    hf.chat_template = CHATML_TEMPLATE.replace("<|im_end|>\n", "<|im_end|>\n\n")
    hf.save_pretrained(moved)
    assert not prepare_dataset(data, out, moved, data_format="chat", num_proc=1, system_prompt="Hi.").cached


def test_datamodule_batches_and_tokenizer_refusal(tmp_path: Path, bpe_dir: Path) -> None:
    dm = HFDataModule([CHAT], tmp_path / "dm", WORDS, data_format="chat", seq_len=32, batch_size=3, val_fraction=0.25)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.vocab_size == 38 and len(dm.train_dataset) == 9
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == y.shape == (3, 32) and x.dtype == y.dtype == torch.long  # nothing cut: <= 27 tokens
    hf = _hf(WORDS)
    assert set(hf.convert_ids_to_tokens(y[y != -100].tolist())) <= {"The", "is", ".", "<|im_end|>", "kettle", "green",
                                                                   "lamp", "red", "door", "blue", "boat", "yellow",
                                                                   "kite", "white", "chair", "black", "shirt", "cup",
                                                                   "book", "bike", "tent", "ball"}
    assert int((y != -100).sum()) == sum(_by_hand([ROWS[i] for i in range(12)])[1][i] for i in
                                          sorted(np.random.default_rng(0).permutation(12)[:3].tolist()))
    # Files written by one tokenizer are refused by a DataModule configured with another.
    other = HFDataModule([CHAT], tmp_path / "dm", bpe_dir, data_format="chat", seq_len=24, batch_size=3)
    with pytest.raises(ValueError, match=r"train\.bin' was tokenized by 'hf:tiny_tokenizer'.*their vocabularies "
                                         r"differ.*delete .* so the data is tokenized again"):
        other.setup("fit")
