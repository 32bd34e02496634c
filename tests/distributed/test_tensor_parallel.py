"""Tensor + sequence parallel: parity for tp ∈ {2, 4} × dp ∈ {1, 2} × SP on/off × FSDP2/replicate × three
models (Llama, GPT-2 with tied embeddings, a user model with Hugging Face names), and exact communication."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_4d.testing import run_world
from tests.distributed.common import assert_parity, build_model, fit_spec, make_dataset, world_fit

MODELS = ("llama", "gpt2", "hf")


def _base(model: str) -> dict[str, Any]:
    return dict(model=model, steps=3, accumulate=2, clip=0.05, predict=True)


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {m: fit_spec(_base(m)) for m in MODELS}


def _specs(world: int, tp: int, modes: tuple[str, ...]) -> list[dict[str, Any]]:
    return [
        dict(_base(m), world=world, strategy=dict(tp=tp, sequence_parallel=sp, data_parallel=mode))
        for m in MODELS for sp in (True, False) for mode in modes
    ]


def test_gradient_scale_without_clipping() -> None:
    # Clipping rescales every gradient to the same norm and AdamW ignores a constant scale: check the raw
    # gradients of one step, unclipped, for TP and TP+DP layouts.
    spec = dict(model="llama", steps=1, clip=None)
    ref = fit_spec(spec)
    specs = [dict(spec, world=4, strategy=s) for s in (dict(tp=4), dict(tp=2), dict(tp=2, sequence_parallel=False))]
    for got, s in zip(run_world(world_fit, 4, specs)[0], specs):
        assert_parity(got, ref, label=f"unclipped {s['strategy']}")


@pytest.mark.parametrize(
    "world, tp, modes",
    [(2, 2, ("fsdp",)), (4, 2, ("fsdp", "replicate")), (4, 4, ("fsdp",)), (8, 4, ("fsdp", "replicate"))],
    ids=["tp2", "tp2-dp2", "tp4", "tp4-dp2"],
)
def test_tensor_parallel_parity(world: int, tp: int, modes: tuple[str, ...], references: dict[str, Any]) -> None:
    specs = _specs(world, tp, modes)
    if world == 2:  # activation checkpointing composes with TP/SP and keeps parity
        specs += [dict(_base("llama"), world=2, strategy=dict(tp=2, activation_checkpointing=m))
                  for m in ("full", "selective")]
    results = run_world(world_fit, world, specs, timeout_s=900)
    for spec, got in zip(specs, results[0]):
        assert_parity(got, references[spec["model"]], label=f"{spec['model']} {spec['strategy']}")
    for rank_results in results[1:]:
        for got, ref in zip(rank_results, results[0]):
            assert got["losses"] == ref["losses"]


def _tensor_parallel(lm: Any, mesh: Any, path: str) -> None:
    """What the strategy does for TP: trace one forward, plan, apply."""
    from lightning_4d.tensor_parallel import apply_tensor_parallel, plan_tensor_parallel
    from lightning_4d.analysis.trace import example_tokens, trace_model

    trace = trace_model(lm, path, example_tokens(lm, mesh.dims.tp))
    apply_tensor_parallel(lm, mesh, plan_tensor_parallel(lm, mesh.dims, trace))


def _count_comm(rank: int, model: str, sp: bool) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_4d.core.comm import CommCounter, mesh_axis_groups
    from lightning_4d.mesh import ParallelDims, build_mesh
    from lightning_4d.models import CausalLM
    torch.manual_seed(0)
    lm = CausalLM(build_model(model))
    mesh = build_mesh(ParallelDims.from_world(2, tp=2, sequence_parallel=sp), "cpu")
    path = "model.layers" if model != "gpt2" else "model.h"
    _tensor_parallel(lm, mesh, path)
    x, y = make_dataset(4)[:4]
    debug, counter = CommDebugMode(), CommCounter(mesh_axis_groups(mesh))
    blocks = [f"CausalLM.{path}.{i}" for i in range(2)]
    with debug, loss_parallel():
        with counter:
            out = lm(x)
        loss = lm.loss_fn(out, y)
        loss.backward()
    per_block = [{
        phase: {str(op).rsplit(".", 1)[-1]: n for op, n in debug.comm_module_counts[block][phase].items()}
        for phase in ("forward", "backward")
    } for block in blocks]
    return {"block": per_block, "forward_totals": counter.totals(backward=False), "records": counter.records}


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_communication_is_megatron_exact(model: str) -> None:
    no_sp = run_world(_count_comm, 2, model, False)[0]
    sp = run_world(_count_comm, 2, model, True)[0]
    # Without SP: one all-reduce per attention and one per MLP in each block's forward, and the matching
    # two in backward (Megatron-LM: one all-reduce per MLP forward).
    for block in no_sp["block"]:
        assert block == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    # With SP each all-reduce becomes an all-gather + a reduce-scatter. The sequence is split between the
    # blocks only: the last block also gathers its output (forward), the first all-gathers the gradient of
    # its input split (backward).
    both = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    one_more = {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 2}
    assert sp["block"][0] == {"forward": both, "backward": one_more}
    assert sp["block"][1] == {"forward": one_more, "backward": both}
    # Equal total bytes: per block S = B·T·H·4 bytes; all-reduce sends 2(n−1)/n·S, AG and RS (n−1)/n·S each.
    b, t, h = 4, 16, 32
    s_bytes = b * t * h * 4
    layers = 2
    ar = no_sp["forward_totals"][("tp", "all_reduce")]
    # + the embedding's all-reduce (vocab-parallel, replicated output) when SP is off
    assert ar["count"] == 2 * layers + 1
    assert ar["sent_bytes"] == pytest.approx((2 * layers + 1) * 2 * (1 / 2) * s_bytes)
    ag = sp["forward_totals"][("tp", "all_gather")]
    rs = sp["forward_totals"][("tp", "reduce_scatter")]
    emb_ar = sp["forward_totals"].get(("tp", "all_reduce"), {"count": 0, "sent_bytes": 0.0})
    # SP lives between the blocks: one all-gather per region (2 per block) + the last block's output; one
    # reduce-scatter per region; the vocab-parallel embedding's output is all-reduced (code before the
    # blocks sees the full sequence) and the first block keeps its shard locally.
    assert ag["count"] == 2 * layers + 1
    assert rs["count"] == 2 * layers
    assert emb_ar["count"] == 1
    half = 0.5 * s_bytes  # (n−1)/n·S with n = 2
    blocks_sp = ag["sent_bytes"] + rs["sent_bytes"] - half
    blocks_no_sp = ar["sent_bytes"] - s_bytes
    assert blocks_sp == pytest.approx(blocks_no_sp) == pytest.approx(2 * layers * s_bytes)


def _dropout_masks(rank: int) -> dict[str, Any]:
    from lightning_4d.mesh import ParallelDims, build_mesh
    from lightning_4d.models import GPT2, CausalLM, GPT2Config

    torch.manual_seed(0)
    lm = CausalLM(GPT2(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, block_size=16, dropout=0.5)))
    mesh = build_mesh(ParallelDims.from_world(2, tp=2), "cpu")
    _tensor_parallel(lm, mesh, "model.h")
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(_m: Any, _i: Any, out: torch.Tensor) -> None:
            local = out.to_local() if hasattr(out, "to_local") else out
            seen[name] = (local == 0).clone()
        return hook

    lm.model.embeddings.drop.register_forward_hook(keep("embedding"))  # replicated activations
    lm.model.h[0].attn.resid_dropout.register_forward_hook(keep("residual"))  # sequence shards (SP)
    lm.train()
    lm(torch.randint(0, 64, (2, 16)))
    return seen


def test_dropout_masks_differ_on_shards_and_agree_on_replicas() -> None:
    r0, r1 = run_world(_dropout_masks, 2)
    assert torch.equal(r0["embedding"], r1["embedding"])  # replicated: the same mask on every TP rank
    assert r0["residual"].shape == r1["residual"].shape == (2, 8, 32)  # (B, T/tp, H)
    assert not torch.equal(r0["residual"], r1["residual"])  # sequence shards: independent masks
