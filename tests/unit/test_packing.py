"""Exact packing: a packed batch (documents side by side in a row, ``position_ids`` restarting at 0 where one
starts, the last token of a document without a target) has the token-weighted loss of its documents run one by
one, for the package's Llama, GPT-2 and ``HFStyleLM`` and a transformers Llama (``HFLogits``, eager and sdpa); without
the positions the loss differs (so the check can fail). Packed text windows (EOS-ended documents) are exact too."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_4d.models import CausalLM, Llama, LlamaConfig

os.environ.setdefault("OMP_NUM_THREADS", "1")

VOCAB, T = 64, 12
ROWS = ((5, 4, 3), (7, 5))  # document lengths of each packed row
# fp32 logits of the same documents computed inside a packed row or alone differ by rounding only (a few ulps of
# O(1) values, the masked keys add exact zeros): 1e-5 relative is ~100 fp32 eps. Attention across documents moves
# the loss of these tiny random models (weights ~0.02) by 6e-4 relative or more (measured), so the check without
# positions asks for 10 × RTOL.
RTOL = 1e-5


def packed_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """``(inputs, targets, position_ids)`` ``(2, T)`` and the documents of every row."""
    gen = torch.Generator().manual_seed(seed)
    inputs, targets, positions, docs = [], [], [], []
    for lengths in ROWS:
        row_docs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
        inputs.append(torch.cat(row_docs))
        targets.append(torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in row_docs]))
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
        docs.append(row_docs)
    targets[0][1] = -100  # an ignored target inside a document (a prompt token)
    return torch.stack(inputs), torch.stack(targets), torch.stack(positions), docs


def one_by_one(lm: CausalLM, targets: torch.Tensor, docs: list[list[torch.Tensor]]) -> float:
    """Σ over documents of the summed cross-entropy of each document run alone, over the number of targets."""
    total, count, offset_rows = 0.0, 0, targets
    for row, row_docs in enumerate(docs):
        start = 0
        for doc in row_docs:
            want = offset_rows[row, start:start + len(doc)]  # the doc's own targets, last one ignored
            logits = lm(doc[None])[0]  # (L, V)
            total += float(F.cross_entropy(logits.double(), want, ignore_index=-100, reduction="sum"))
            count += int((want != -100).sum())
            start += len(doc)
    return total / count


def gpt2_lm() -> CausalLM:
    from lightning_4d.models import GPT2, GPT2Config

    torch.manual_seed(0)
    return CausalLM(GPT2(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, block_size=T)))


def llama_lm() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(Llama(LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                      max_seq_len=T)))


def hf_style_lm() -> CausalLM:
    from lightning_4d.models import HFStyleConfig, HFStyleLM

    torch.manual_seed(0)
    return CausalLM(HFStyleLM(HFStyleConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)))


def hf_lm(attn: str) -> CausalLM:
    pytest.importorskip("transformers")
    from lightning_4d.models import HFLogits
    from tests.hf_tiny import tiny_config

    torch.manual_seed(0)
    return CausalLM(HFLogits.from_config(tiny_config("llama", VOCAB), attn_implementation=attn))


@pytest.mark.parametrize("kind", ["llama", "gpt2", "hf_style", "hf-eager", "hf-sdpa"])
def test_packed_loss_equals_documents_one_by_one(kind: str) -> None:
    builders = {"llama": llama_lm, "gpt2": gpt2_lm, "hf_style": hf_style_lm}
    lm = builders[kind]() if "-" not in kind else hf_lm(kind.split("-")[1])
    x, y, pos, docs = packed_batch()
    with torch.no_grad():
        packed = lm.fourd_loss((x, y, pos)).item()
        reference = one_by_one(lm, y, docs)
        crossing = lm.fourd_loss((x, y)).item()  # no document boundaries: attention crosses them
    assert abs(packed - reference) <= RTOL * abs(reference), (packed, reference)
    assert abs(crossing - reference) > 10 * RTOL * abs(reference), (crossing, reference)


def test_llama_positions_of_one_document_change_nothing() -> None:
    lm = llama_lm()
    x = packed_batch()[0]
    with torch.no_grad():
        plain = lm(x)
        with_positions = lm(x, torch.arange(T).expand(2, T))
    assert torch.equal(plain, with_positions)


def test_hf_flattening_collator_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    lm = hf_lm("sdpa")
    _, _, _, docs = packed_batch()
    features = [{"input_ids": d.tolist()} for row in docs for d in row]
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(features)
    assert batch["position_ids"][0, :6].tolist() == [0, 1, 2, 3, 4, 0]
    with torch.no_grad():
        ours = lm.fourd_loss(dict(batch)).item()
        theirs = lm.model.model(**batch, use_cache=False).loss.item()
        reference = one_by_one(lm, lm.split_batch(dict(batch))[1].view(1, -1), [[d for row in docs for d in row]])
    assert abs(ours - theirs) <= 1e-6 * abs(theirs), (ours, theirs)
    assert abs(ours - reference) <= RTOL * abs(reference), (ours, reference)


def test_packed_dataset_is_exact() -> None:
    from lightning_4d.data import MaskedTokenDataset

    lengths = [5, 9, 4, 6, 8]
    tokens = np.random.default_rng(0).integers(0, VOCAB, sum(lengths))
    docs = np.concatenate([[0], np.cumsum(lengths)])
    ds = MaskedTokenDataset(tokens, np.ones(len(tokens), dtype=np.int64), docs, seq_len=T, pack=True)
    x, y, pos = ds[0]  # tokens 0..12: document 0 (5), document 1 (7 of 9)
    assert pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    assert y[4] == -100 and y[11] == tokens[12] and (y[:4] == torch.from_numpy(tokens[1:5])).all()
    x, y, pos = ds[1]  # starts inside document 1: positions from 0 there
    assert pos.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5] and y[1] == -100  # token 13 ends document 1


def test_packed_text_windows_are_exact() -> None:
    """EOS-ended documents in one stream (``data=hf_text data.pack=true``): a window's loss is its documents' losses
    run one by one (the EOS predicts nothing; a document the window cuts counts from the window's start)."""
    from lightning_4d.data import TokenWindowDataset

    eos, lengths = VOCAB - 1, [4, 6, 5, 7]
    gen = np.random.default_rng(1)
    docs = [np.append(gen.integers(0, eos, n - 1), eos) for n in lengths]  # each document ends with its EOS
    x, y, pos = TokenWindowDataset(np.concatenate(docs), seq_len=T, doc_end=eos)[0]  # docs 0, 1 and 2 of doc 2
    assert pos.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1] and y[3] == y[9] == -100
    lm = hf_style_lm()
    pieces = [torch.from_numpy(docs[0]), torch.from_numpy(docs[1]), torch.from_numpy(docs[2][:2])]
    with torch.no_grad():
        packed = lm.fourd_loss((x[None], y[None], pos[None])).item()
        reference = one_by_one(lm, y[None], [pieces])
    assert abs(packed - reference) <= RTOL * abs(reference), (packed, reference)


def test_packed_batch_for_a_model_without_positions_is_refused() -> None:
    from lightning_4d.core.batches import call_model, split_batch

    x, y, pos, _ = packed_batch()
    lm = CausalLM(torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)))
    with pytest.raises(ValueError, match=r"packed batch \(with position_ids\) but Sequential.forward takes no "
                                         r"position_ids"):
        lm.fourd_loss((x, y, pos))
    with pytest.raises(ValueError, match=r"takes no second argument.*Add `position_ids=None`"):
        call_model(torch.nn.Identity(), split_batch((x, y, pos))[0])


def test_packed_batch_through_pipeline_hooks_is_refused() -> None:
    from types import SimpleNamespace

    from lightning_4d.core.batches import split_batch
    from lightning_4d.layout.pipeline_glue import check_packed

    x, y, pos, _ = packed_batch()
    packed, plain = split_batch((x, y, pos))[0], split_batch((x, y))[0]
    hooks = SimpleNamespace(inputs_to_every_stage=False, pp=2)  # stages chain pre -> blocks -> post
    with pytest.raises(ValueError, match=r"packed batch \(with position_ids\) under pp=2 with the pipeline hooks of "
                                         r"CausalLM.*Remove the hooks"):
        check_packed(hooks, llama_lm(), packed)
    check_packed(hooks, llama_lm(), plain)  # plain inputs: nothing to carry
    check_packed(SimpleNamespace(inputs_to_every_stage=True, pp=2), llama_lm(), packed)  # the model's own forward


def test_text_datamodule_packs_files_exactly(tmp_path) -> None:
    """``TextDataModule(pack=True)``: positions restart after each file's end-of-text id; a tokenizer without one
    (``byte``) is refused by name."""
    from lightning_4d.data import TextDataModule
    from lightning_4d.data.tokenizer import EOT, ByteTokenizer

    for name, text in (("a.txt", "first file"), ("b.txt", "second one, longer"), ("c.txt", "third")):
        (tmp_path / name).write_text(text)
    tok = ByteTokenizer(special_tokens=[EOT])
    dm = TextDataModule(tmp_path / "tok", text=[str(tmp_path)], seq_len=24, batch_size=1, tokenizer=tok,
                        val_fraction=0.1, pack=True)
    dm.prepare_data()
    dm.setup("fit")
    x, y, pos = dm.train_dataset[0]
    ends = (x == tok.eot_id).nonzero().flatten().tolist()
    assert ends == [10] and pos[10].item() == 10 and pos[11].item() == 0 and y[10].item() == -100
    plain = TextDataModule(tmp_path / "byte", text=[str(tmp_path)], seq_len=8, batch_size=1, pack=True)
    plain.prepare_data()
    with pytest.raises(ValueError, match=r"pack=True needs documents ended by an end-of-text id.*'byte'"):
        plain.setup("fit")
