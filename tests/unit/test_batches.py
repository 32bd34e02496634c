"""Hugging Face batch conventions: dict batches with ``labels`` aligned with ``input_ids`` give transformers' own
loss (``model(input_ids, labels=labels).loss``); ambiguous batches are refused."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_4d.core.batches import PackedInputs, shift_labels, split_batch

os.environ.setdefault("OMP_NUM_THREADS", "1")

VOCAB, B, T = 64, 3, 12


def hf_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of different lengths, right-padded: ``labels`` = ``input_ids`` with -100 on the padding (what
    ``DataCollatorForLanguageModeling(mlm=False)`` gives), plus one masked prompt token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=gen)
    labels = ids.clone()
    for row, length in enumerate((T, T - 4, T - 7)):
        ids[row, length:] = 0
        labels[row, length:] = -100
    labels[0, 2] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -100).long() | (ids != 0).long()}


def tiny_hf_lm():
    pytest.importorskip("transformers")
    from lightning_4d.models import CausalLM, HFLogits
    from tests.hf_tiny import tiny_config

    torch.manual_seed(0)
    return CausalLM(HFLogits.from_config(tiny_config("llama", VOCAB), attn_implementation="eager"))


def test_hf_labels_loss_equals_transformers_loss() -> None:
    lm = tiny_hf_lm()
    batch = hf_batch()
    with torch.no_grad():
        ours = lm.fourd_loss(batch, "train")
        theirs = lm.model.model(**batch, use_cache=False).loss  # with the attention mask
        # the bug this fixes: the labels taken as already-shifted targets
        unshifted = lm.loss_fn(lm(batch["input_ids"]), batch["labels"])
    assert abs(ours.item() - theirs.item()) <= 1e-6 * abs(theirs.item()), (ours.item(), theirs.item())
    assert abs(unshifted.item() - theirs.item()) > 1e-3, "the check cannot fail: unshifted labels give the same loss"


def test_shifted_conventions_unchanged() -> None:
    ids = torch.arange(8).view(2, 4)
    targets = ids + 1
    for batch in ((ids, targets), [ids, targets], {"input_ids": ids, "targets": targets}, {"x": ids, "y": targets}):
        inputs, got = split_batch(batch)
        assert inputs is ids and got is targets
    inputs, got = split_batch({"input_ids": ids, "labels": ids})
    assert got.tolist() == [[1, 2, 3, -100], [5, 6, 7, -100]]
    assert shift_labels(ids, ignore_index=-1)[:, -1].tolist() == [-1, -1]


def test_position_ids_make_packed_inputs() -> None:
    ids = torch.arange(8).view(2, 4)
    pos = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])
    inputs, _ = split_batch({"input_ids": ids, "labels": ids, "position_ids": pos})
    assert isinstance(inputs, PackedInputs) and inputs.position_ids is pos
    inputs, _ = split_batch((ids, ids, pos))
    assert isinstance(inputs, PackedInputs) and inputs.tokens is ids


@pytest.mark.parametrize("batch, match", [
    ({"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 3)},
     r"labels of shape \(2, 3\) but inputs of shape \(2, 4\): Hugging Face labels are aligned"),
    ({"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 4), "targets": torch.zeros(2, 4)},
     r"both 'targets' and 'labels'.*Keep one of the two keys"),
    ({"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 4), "position_ids": torch.zeros(2, 3)},
     r"position_ids of shape \(2, 3\) but inputs of shape \(2, 4\)"),
    ({"input_ids": torch.zeros(2, 4)}, r"needs an input key .* and a target key"),
    ((torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2)), r"got tuple of 4"),
    ({"input_ids": torch.zeros(1, 3), "labels": torch.zeros(1, 3), "attention_mask": torch.tensor([[0, 1, 1]])},
     r"attention_mask with a padded position before a kept one \(left padding.*padding_side='right'"),
])
def test_ambiguous_batches_are_refused(batch, match) -> None:
    with pytest.raises(ValueError, match=match):
        split_batch(batch)
