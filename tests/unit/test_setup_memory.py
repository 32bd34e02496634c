"""The planner's set-up term and the reduced check's budget: one rule, used by the runtime and the planner."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from lightning_4d.materialize import init_pieces
from lightning_4d.config import FourDConfig
from lightning_4d.mesh import ParallelDims
from lightning_4d.models import CausalLM, Llama, LlamaConfig
from lightning_4d.planner.memory import memory_per_rank
from lightning_4d.planner.setup_memory import (largest_tensor_params, reduced_check_params, setup_peak_bytes,
                                               setup_scratch_bytes)
from lightning_4d.planner.spec import TrainSpec, TransformerSpec, seed_moe_1t
from lightning_4d.layout.derive_plan import plan_layout
from lightning_4d.layout.reduced_check import CHECK_FLOOR_BYTES, check_budget_bytes, check_reduced_model, reduced_copy_bytes

SPEC = TransformerSpec(vocab_size=32000, hidden=768, layers=12, heads=12, ffn_hidden=2688)
DIMS = ParallelDims.from_world(8, tp=2, pp=2)


def test_materialisation_is_the_share_plus_one_chunk_of_scratch() -> None:
    share = 72e6
    largest = largest_tensor_params(SPEC) * 4
    assert largest == 32000 * 768 * 4  # the embedding: it sets the check's budget, not the materialisation
    check = reduced_copy_bytes(reduced_check_params(SPEC, DIMS) * 4)
    assert check <= check_budget_bytes(share, largest)  # within budget: counted
    assert setup_scratch_bytes(SPEC) == init_pieces.CHUNK_ELEMENTS * init_pieces.SCRATCH_BYTES_PER_ELEMENT
    assert setup_peak_bytes(SPEC, DIMS, share) == max(share + setup_scratch_bytes(SPEC), check)
    assert setup_peak_bytes(SPEC, DIMS, share) < share + largest


def test_the_scratch_is_the_materialisers_chunk_and_no_more_than_the_largest_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init_pieces, "CHUNK_ELEMENTS", 1000)  # one owner: the planner follows the runtime's chunk
    assert setup_scratch_bytes(SPEC) == 1000 * init_pieces.SCRATCH_BYTES_PER_ELEMENT
    small = TransformerSpec(vocab_size=10, hidden=4, layers=1, heads=1, ffn_hidden=8)  # largest tensor: gate_up 64
    assert largest_tensor_params(small) == 64
    assert setup_scratch_bytes(small) == 64 * init_pieces.SCRATCH_BYTES_PER_ELEMENT


def test_a_meta_built_moe_1t_rank_holds_its_share_not_a_whole_expert_stack() -> None:
    spec = seed_moe_1t(4096)
    dims = ParallelDims.from_world(512, tp=8, pp=8, ep=64, virtual_stages=2)  # conf/parallel/moe_1t_512.yaml
    train = TrainSpec(global_batch_size=1024, seq_len=4096, microbatches=64, schedule="zbv",
                      activation_checkpointing="selective")
    stack = largest_tensor_params(spec) * 4
    assert stack > 60e9  # one layer's experts (64 × 2F × h), fp32
    for m in memory_per_rank(spec, dims, train):
        assert m.params < m.setup <= m.params + init_pieces.scratch_bytes()


def test_a_check_over_its_budget_is_not_counted() -> None:
    wide = TransformerSpec(vocab_size=50000, hidden=12288, layers=96, heads=96)
    dims = ParallelDims.from_world(512, tp=8, pp=8)
    share = 1e9
    largest = largest_tensor_params(wide) * 4
    check = reduced_copy_bytes(reduced_check_params(wide, dims) * 4)
    assert check > check_budget_bytes(share, largest)  # 8 unsharded 1.8 B-parameter blocks: skipped at run time
    assert setup_peak_bytes(wide, dims, share) == share + setup_scratch_bytes(wide)


def test_the_budget_is_the_largest_ranks_and_never_below_the_floor() -> None:
    assert check_budget_bytes(0.0, 0.0) == CHECK_FLOOR_BYTES
    tiny = TransformerSpec(vocab_size=64, hidden=32, layers=4, heads=4)
    # a rank with a small share still runs the check when the largest rank's share makes room for it
    small, big = 1.0, 1e12
    assert setup_peak_bytes(tiny, DIMS, small, largest_share_bytes=big) >= reduced_copy_bytes(
        reduced_check_params(tiny, DIMS) * 4)


def test_built_for_real_holds_the_whole_model_and_raises_the_plan_peak() -> None:
    train = TrainSpec(global_batch_size=8, precision="32-true")
    meta = memory_per_rank(SPEC, DIMS, train)
    real = memory_per_rank(SPEC, DIMS, train.with_(meta_built=False))
    whole = SPEC.total_params() * 4
    for m, r in zip(meta, real):
        assert r.setup >= whole
        assert m.setup == setup_peak_bytes(SPEC, DIMS, m.params, 4, True, max(x.params for x in meta))
        assert m.peak == max(m.total, m.setup + m.runtime)
        assert r.peak >= r.setup_total > m.setup_total


def _meta_llama() -> CausalLM:
    with torch.device("meta"):
        return CausalLM(Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, ffn_hidden=128)))


def test_the_runtime_skips_a_check_over_its_budget_before_any_collective(caplog: pytest.LogCaptureFixture) -> None:
    dims = ParallelDims.from_world(4, tp=2, pp=2)
    mesh = SimpleNamespace(dims=dims)  # no process group: it must not be used
    model = _meta_llama()
    plan = plan_layout(model, dims, FourDConfig(tp=2, pp=2))
    with caplog.at_level(logging.WARNING, logger="lightning_4d.layout.reduced_check"):
        what = check_reduced_model(model, plan, mesh, budget_bytes=1024)  # type: ignore[arg-type]
    assert what is not None and "structurally only" in what and "budget of 0 MiB" in what
    assert any("reduced_check_budget" in r.getMessage() for r in caplog.records)


def test_the_strategy_validates_the_budget() -> None:
    from lightning_4d import FourDStrategy

    with pytest.raises(ValueError, match="reduced_check_budget=-1"):
        FourDStrategy(tp=2, reduced_check_budget=-1)
