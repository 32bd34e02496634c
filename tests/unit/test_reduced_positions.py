"""The set-up value check knows positions and runs at every size; stages get what runs before the blocks by value.

Gemma 4 picks each layer's type, rotary table, head width and per-layer input by its index. The reduced copy used
to renumber its kept blocks (a raw ``RuntimeError``: rotary width 32 vs 16), and with the check off pipeline stages
fed the per-layer inputs from zero stand-ins (8.9e-3 off, silently). Here, without a process group (pp alone: the
staged check runs in one process): every position is kept, a copy over its budget is checked in passes of one
block, stand-in zeros are refused, and the plan for tp cuts the per-layer input with its column-parallel gate.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_4d.config import FourDConfig
from lightning_4d.layout.derive_plan import plan_layout
from lightning_4d.layout.reduced_check import check_reduced_model
from lightning_4d.mesh import ParallelDims
from lightning_4d.models import CausalLM

pytest.importorskip("transformers")

PP2 = ParallelDims.from_world(2, pp=2)


def _meta_lm(kind: str) -> CausalLM:
    from tests.distributed.common import build_model

    torch.manual_seed(0)
    with torch.device("meta"):
        return CausalLM(build_model(kind))


def _check(lm: CausalLM, dims: ParallelDims = PP2, budget: float | None = None) -> str | None:
    plan = plan_layout(lm, dims, FourDConfig(pp=dims.pp, tp=dims.tp))
    mesh = SimpleNamespace(dims=dims)  # pp alone: the check runs in one process, no group is used
    return check_reduced_model(lm, plan, mesh, budget_bytes=budget)  # type: ignore[arg-type]


def _bytes(module: torch.nn.Module) -> float:
    return float(sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]))


def test_layers_picked_by_position_are_checked_at_their_own_positions() -> None:
    # blocks 0 (sliding) and 3 (global, wider heads) are the two structures, 0 and 2 start the stages: each stays at
    # its own index (config.layer_types[i], per_layer_inputs[:, :, i]); block 1 is a stand-in
    what = _check(_meta_lm("hf-gemma4ple-4"))
    assert what is not None and "blocks ['0', '2', '3'] of 4 at their own positions" in what


def test_a_copy_over_its_budget_is_value_checked_one_block_per_pass() -> None:
    lm = _meta_lm("hf-gemma4ple-4")
    blocks = lm.model.model.model.layers
    outside = _bytes(lm) - _bytes(blocks)  # the vocabulary is cut too: this bounds the copy from above
    one_pass = 2 * (outside + _bytes(blocks[0]) + _bytes(blocks[2]) + _bytes(blocks[3]))
    budget = 2 * (outside + _bytes(blocks[3])) + 1  # room for the largest block alone, not for all three
    assert budget < one_pass
    what = _check(lm, budget=budget)
    assert what is not None and "in 3 passes of one block" in what and "structurally" not in what
    assert "structurally only" in (_check(lm, budget=1024) or "")  # one block alone over it: the only skip


def test_stages_reading_stand_in_zeros_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The per-layer inputs are computed before the blocks; stood in for by zeros on the second stage (nothing
    # carried), the staged forward differs from the plain one and the set-up check says so.
    import lightning_4d.pipeline.staged as staged

    monkeypatch.setattr(staged, "carried_calls", lambda run_stage, num_stages: ())
    with pytest.raises(ValueError, match="differs from the plain forward"):
        _check(_meta_lm("hf-gemma4ple-4"))


def test_the_per_layer_inputs_are_carried_and_nothing_else() -> None:
    from lightning_4d.analysis.trace import example_tokens, trace_model
    from lightning_4d.pipeline.checks import check_staged
    from lightning_4d.pipeline.staged import prepare_staged
    from tests.distributed.common import build_model

    for kind, carried in (("hf-gemma4ple-4", ("embed_tokens_per_layer", "per_layer_projection_norm")),
                          ("hf-gemma4-4", ())):
        torch.manual_seed(0)
        model = build_model(kind).eval()
        tokens = example_tokens(model)
        trace = trace_model(model, "model.model.layers", tokens)
        stages = prepare_staged(model, trace, num_stages=2)
        assert tuple(path.rpartition(".")[2] for path, _ in stages.carried) == carried  # not the token embedding
        with torch.no_grad():
            check_staged(stages, tokens, trace.output)  # stage by stage equals the plain forward


def test_the_per_layer_input_is_cut_with_its_gate_and_the_indexer_stays_whole() -> None:
    from lightning_4d.analysis.trace import example_tokens, trace_model
    from lightning_4d.tensor_parallel.apply import tp_styles
    from tests.distributed.common import build_model

    torch.manual_seed(0)
    gemma = build_model("hf-gemma4ple")
    layout = tp_styles(gemma, trace_model(gemma, "model.model.layers", example_tokens(gemma)), 2, True)
    assert layout.feature_inputs == {f"model.model.layers.{i}": {1: 8} for i in range(2)}  # not the rotary tables
    kinds = {n.rpartition(".")[2]: s.kind for n, s in layout.styles.items() if n.startswith("model.model.layers.0.")}
    assert kinds["per_layer_input_gate"] == "Colwise" and kinds["per_layer_projection"] == "Rowwise"
    deepseek = build_model("hf-dsv32")
    layout = tp_styles(deepseek, trace_model(deepseek, "model.model.layers", example_tokens(deepseek)), 2, True)
    indexer = {n: s.kind for n, s in layout.styles.items() if ".indexer." in n}
    assert set(indexer.values()) == {"LowRankDown"} and len(indexer) == 6  # wq_b, wk, weights_proj in 2 layers
    assert layout.styles["model.model.layers.0.self_attn.q_b_proj"].kind == "Colwise"


def test_gemma4_moe_router_stays_whole_and_kv_sharing_is_named() -> None:
    # Gemma 4's MoE layers hold their experts and router beside attention and MLP: the router's proj (an (E, H)
    # weight) was planned row-parallel (a raw DTensor error); it stays whole, and SP is refused naming the layer.
    # Its KV-shared layers read K and V an earlier layer wrote into one dict handed to every layer: found by value
    # (named by the pipeline check when a stage lacks them).
    from lightning_4d.analysis.trace import example_tokens, trace_model
    from lightning_4d.tensor_parallel.apply import tp_styles
    from lightning_4d.tensor_parallel.plan import block_plan
    from tests.distributed.common import build_model

    torch.manual_seed(0)
    moe = build_model("hf-gemma4moe")
    trace = trace_model(moe, "model.model.layers", example_tokens(moe))
    layout = tp_styles(moe, trace, 2, False)
    assert not any(".router." in n or ".experts" in n for n in layout.styles)  # whole on every rank
    assert layout.styles["model.model.layers.0.mlp.down_proj"].kind == "Rowwise"
    with pytest.raises(ValueError, match=r"layers.0 holds its experts and router itself .*sequence_parallel=False"):
        block_plan(moe.model.model.layers[0], "layers.0", 2, trace, sequence_parallel=True)
    kv = build_model("hf-gemma4kv")
    assert trace_model(kv, "model.model.layers", example_tokens(kv)).shared_args == ("shared_kv_states",)
