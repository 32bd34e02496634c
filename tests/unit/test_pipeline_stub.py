"""The shape-only stand-ins later pipeline stages use for the modules before the blocks: what forward code reads
off them besides calling them (Llama 4 reads ``self.embed_tokens.weight.device``) and the stage-by-stage check on
a real family that reads it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_4d.pipeline.checks import check_staged
from lightning_4d.pipeline.staged import ShapeStub, prepare_staged


def test_stub_answers_attributes_with_shapes_not_memory() -> None:
    emb = nn.Embedding(1000, 64, padding_idx=3)
    stub = ShapeStub(emb)
    assert list(stub.parameters()) == []  # nothing of the module is held on this stage
    w = stub.weight
    assert w.shape == (1000, 64) and w.dtype == emb.weight.dtype and w.device == emb.weight.device
    assert w.stride() == (0, 0) and float(w.abs().sum()) == 0.0  # one element, expanded
    assert stub.padding_idx == 3 and stub.num_embeddings == 1000
    assert stub(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 64)
    object.__setattr__(stub, "device", torch.device("meta"))  # what a stage sets from its micro-batch
    assert stub.weight.device.type == "meta"
    with pytest.raises(AttributeError, match=r"Embedding\.reset_parameters: a pipeline stage that does not own"):
        stub.reset_parameters()  # methods would compute with weights this stage does not hold
    with pytest.raises(AttributeError):
        stub.no_such_attribute  # noqa: B018


def test_llama4_runs_stage_by_stage_reading_its_embedding_weight() -> None:
    # Llama 4's text model calls self.embed_tokens(input_ids.to(self.embed_tokens.weight.device)): later stages
    # used to fail with "'ShapeStub' object has no attribute 'weight'" in the set-up check.
    pytest.importorskip("transformers")
    from lightning_4d.analysis.discovery import find_blocks
    from lightning_4d.analysis.trace import example_tokens, trace_model
    from tests.distributed.byom_zoo import build_zoo

    torch.manual_seed(0)
    model = build_zoo("hf-llama4", layers=4)
    path, _ = find_blocks(model)
    example = example_tokens(model, 2)
    trace = trace_model(model, path, example)
    staged = prepare_staged(model, trace, num_stages=2)
    assert list(staged.stubs) == ["model.model.embed_tokens"]
    check_staged(staged, example, trace.output)  # raises on a failure or a difference
