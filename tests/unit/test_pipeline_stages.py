"""Splitting models into stage modules (single process): names, composition, checks, tied weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_4d.pipeline import build_pipeline_stages, check_sequential, find_pipeline_split, find_tied_parameters
from tests.distributed.pipeline_models import DIM, VOCAB, ScaledEmbedLM, TinyLM, batch, build


def _chain(model: nn.Module, pp: int, v: int, style: str, x: torch.Tensor, **kw) -> tuple[torch.Tensor, list]:
    """Run all stages of all ranks in stage order in this process (each rank from its own copy)."""
    by_stage, owned = {}, []
    for rank in range(pp):
        parts = build_pipeline_stages(model, rank, pp, v, style, copy=True, **kw)
        owned.append(dict(parts.model.named_parameters()))
        for mod in parts.modules:
            by_stage[mod.stage_index] = mod
    h = x
    for s in range(pp * v):
        h = by_stage[s](h)
    return h, owned


def test_find_split_of_a_plain_model() -> None:
    split = find_pipeline_split(TinyLM())
    assert (split.blocks_path, split.pre, split.post) == ("layers", ("tok",), ("norm", "head"))
    assert split.block_keys == tuple(str(i) for i in range(8))


def test_nested_containers_and_ancestor_levels() -> None:
    class Wrapper(nn.Module):  # like a LightningModule holding the model
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Linear(DIM, DIM)
            self.model = TinyLM(layers=2)
            self.extra = nn.Linear(VOCAB, VOCAB)
            self.criterion = nn.CrossEntropyLoss()  # not part of the chain
            self.metric = nn.Identity()  # parameter-free module above the blocks' parent: skipped

    split = find_pipeline_split(Wrapper())
    assert split.blocks_path == "model.layers"
    assert split.pre == ("scale", "model.tok") and split.post == ("model.norm", "model.head", "extra")
    parts = build_pipeline_stages(Wrapper(), 1, 2)
    names = [n for n, _ in parts.modules[0].named_parameters()]
    assert names == [n for n, _ in parts.model.named_parameters()]
    assert names[0] == "model.layers.1.norm.weight" and names[-1] == "extra.bias"
    assert parts.model.model.tok is None and parts.model.scale is None


@pytest.mark.parametrize("pp,v,style", [(2, 1, "loop"), (4, 1, "loop"), (2, 2, "loop"), (4, 2, "v"), (2, 4, "loop")])
def test_stage_chain_equals_model_and_names_are_kept(pp: int, v: int, style: str) -> None:
    model = build()
    x, _ = batch(0)
    out, owned = _chain(model, pp, v, style, x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    full = dict(model.named_parameters())
    union = {n: p for d in owned for n, p in d.items()}
    assert union.keys() == full.keys() and sum(len(d) for d in owned) == len(full)
    for name, p in union.items():
        assert torch.equal(p, full[name])


def test_explicit_layers_and_in_place_pruning() -> None:
    model = build()
    parts = build_pipeline_stages(model, 1, 2, layers_per_stage=[3, 5])
    assert parts.model is model and parts.parts == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert isinstance(model.layers, nn.ModuleDict) and list(model.layers.keys()) == ["3", "4", "5", "6", "7"]
    assert model.tok is None and model.head is not None
    assert {n.split(".")[0] for n, _ in model.named_parameters()} == {"layers", "norm", "head"}


def test_check_sequential_accepts_chains_and_the_reference_models() -> None:
    from lightning_4d.models import GPT2, GPT2Config, HFStyleConfig, HFStyleLM, Llama, LlamaConfig

    tokens = torch.randint(0, 16, (2, 4))
    check_sequential(TinyLM(), tokens)
    check_sequential(Llama(LlamaConfig(vocab_size=16, dim=16, n_layers=2, n_heads=2, ffn_hidden=32)), tokens)
    check_sequential(GPT2(GPT2Config(vocab_size=16, n_embd=16, n_layer=2, n_head=2, block_size=8)), tokens)
    check_sequential(HFStyleLM(HFStyleConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=2)), tokens)


def test_check_sequential_names_the_hook() -> None:
    tokens = torch.randint(0, 16, (2, 4))
    model = ScaledEmbedLM()
    with pytest.raises(ValueError, match=r"ScaledEmbedLM: its forward is not the plain composition .* in the modules "
                                         r"before the blocks \(pre\).*pipeline_pre_blocks\(self, inputs\)"):
        check_sequential(model, tokens)
    check_sequential(model, tokens, pre_fn=lambda t: model.tok(t) * 2.0)
    # The hook is used by the stages too.
    torch.manual_seed(0)
    ref = ScaledEmbedLM()
    parts = [build_pipeline_stages(ref, r, 2, copy=True, pre_fn=None) for r in range(2)]
    first = parts[0].modules[0]
    first.stage_forward.pre_fn = lambda t: first.tok(t) * 2.0
    torch.testing.assert_close(parts[1].modules[0](first(tokens)), ref(tokens))


def test_check_sequential_reports_failures_of_the_chain() -> None:
    class TwoInputs(TinyLM):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # post needs both norm and a residual
            h = self.tok(tokens)
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h) + h)

    match = r"TwoInputs: .*in the modules after the blocks \(post\).*pipeline_post_blocks"
    with pytest.raises(ValueError, match=match):
        check_sequential(TwoInputs(), torch.randint(0, 16, (2, 4)))


def test_split_errors() -> None:
    with pytest.raises(ValueError, match="Sequential: no container of repeated blocks"):
        find_pipeline_split(nn.Sequential(nn.Linear(2, 2)))

    class Direct(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(4))

    with pytest.raises(ValueError, match=r"Direct: parameter\(s\) \['pos'\] sit directly on an ancestor"):
        find_pipeline_split(Direct())
    with pytest.raises(ValueError, match="blocks_path='norm' is not an nn.ModuleList"):
        find_pipeline_split(TinyLM(), "norm")
    with pytest.raises(ValueError, match="num_stages=16 is more than the 8 blocks"):
        build_pipeline_stages(TinyLM(), 0, 8, 2)


def test_tied_parameters() -> None:
    tied = build(tie=True)
    assert find_tied_parameters(tied, find_pipeline_split(tied)) == [("tok.weight", "head.weight")]
    assert find_tied_parameters(TinyLM(), find_pipeline_split(TinyLM())) == []
    parts = build_pipeline_stages(copy.deepcopy(tied), 1, 2)
    assert parts.tied == [("tok.weight", "head.weight")] and "head.weight" in dict(parts.model.named_parameters())
    shared = TinyLM()
    shared.layers[1].fc1 = shared.layers[0].fc1
    # a module reused at several depths: kept where all its uses land on one stage, refused (naming it, the rule and
    # the fix) where they do not
    split = find_pipeline_split(shared)
    assert find_tied_parameters(shared, split, {k: 0 for k in split.block_keys}) == []
    with pytest.raises(ValueError, match=r"layers\.1\.fc1 is a module reused at several depths: .* shared by blocks 0 "
                                         r"and 1 of layers, which land on stages 0 and 1\. Rule: .* Fix: "):
        find_tied_parameters(shared, split, {k: i for i, k in enumerate(split.block_keys)})
    with pytest.raises(ValueError, match="module reused at several depths"):
        find_tied_parameters(shared, split)
    onto_norm = TinyLM()
    onto_norm.layers[1].norm = onto_norm.norm  # a block sharing a weight with a module after the blocks
    with pytest.raises(ValueError, match="weights tied to a block cannot be split"):
        find_tied_parameters(onto_norm, find_pipeline_split(onto_norm), {"0": 0, "1": 0})
