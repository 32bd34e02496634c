"""The one precision table against Lightning's own precision plugins, and the one set-up check tolerance."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from lightning_4d.core.precision import (
    PLANNER_PRECISIONS,
    PRECISION_NAMES,
    PRECISIONS,
    allowed_difference,
    max_difference,
    parity_tolerance,
    precision_info,
)


@pytest.mark.parametrize("name", PRECISION_NAMES)
def test_table_matches_lightnings_plugins(name: str) -> None:
    """Weights as Lightning's plugin creates them, compute as its forward context runs it (CPU: Lightning turns
    fp16 AMP into bf16 AMP, so the fp16-mixed names are checked through the name Lightning chose)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(precision=name, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
    plugin = trainer.precision_plugin
    with plugin.tensor_init_context():
        layer = torch.nn.Linear(2, 2)
    with plugin.forward_context():
        out = layer(torch.ones(1, 2, dtype=layer.weight.dtype))
    info = precision_info(trainer.precision)
    assert (info.param_dtype, info.compute_dtype) == (layer.weight.dtype, out.dtype)
    assert info.compute_bytes == out.element_size()
    assert info.mixed == (layer.weight.dtype != out.dtype)
    if name not in ("16-mixed", "16"):  # not substituted on CPU: our name for it is Lightning's
        assert precision_info(name).name == str(trainer.precision)


def test_planner_precisions_and_refusals() -> None:
    assert set(PLANNER_PRECISIONS) == {"bf16-mixed", "32-true"}
    assert precision_info("bf16-mixed").fsdp_param_dtype is torch.bfloat16
    assert all(p.fsdp_param_dtype is None for n, p in PRECISIONS.items() if n != "bf16-mixed")
    assert precision_info("64-true").planner is None
    with pytest.raises(ValueError, match="precision='transformer-engine' is not one lightning_4d knows"):
        precision_info("transformer-engine")


def test_planner_bytes_come_from_the_table() -> None:
    from lightning_4d.layout.data_parallel import mixed_precision_policy
    from lightning_4d.planner.spec import TrainSpec

    assert TrainSpec(global_batch_size=1, precision="bf16-mixed").act_bytes == torch.tensor(0, dtype=torch.bfloat16
                                                                                            ).element_size()
    assert TrainSpec(global_batch_size=1, precision="32-true").act_bytes == 4
    assert mixed_precision_policy("32-true") is None
    assert mixed_precision_policy("bf16-mixed").param_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="is not modelled"):
        TrainSpec(global_batch_size=1, precision="64-true")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tolerance_accepts_rounding_and_refuses_a_wrong_forward(dtype: torch.dtype) -> None:
    """A sum in another order (rounding only) passes; a forward that is off by 1% of one term fails in fp32."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen).to(dtype)
    expected = x.sum(dim=1)
    reordered = x.flip(1).cumsum(dim=1)[:, -1]  # the same sum, another order and another kernel
    diff, scale = max_difference(reordered, expected)
    assert diff <= allowed_difference(expected, scale)
    wrong = expected + 0.01 * scale
    diff, scale = max_difference(wrong, expected)
    assert (diff > allowed_difference(expected, scale)) == (dtype == torch.float32)


def test_max_difference_refuses_other_shapes_and_skips_meta() -> None:
    assert max_difference(torch.ones(2), torch.ones(3)) == (float("inf"), 0.0)
    assert max_difference((torch.ones(2),), (torch.ones(2), torch.ones(2)))[0] == float("inf")
    assert max_difference(torch.ones(2, device="meta"), torch.ones(2, device="meta")) is None


def test_parity_tolerance_follows_bf16_epsilon_and_depth() -> None:
    """``4·σ`` of ``2·(6·blocks + 1)`` roundings of ``±eps/2`` for a gradient; the loss's per-token average, plus one
    unit in the last place when the loss itself is bf16; fp32 refused (its tolerance is its reordering noise)."""
    eps = torch.finfo(torch.bfloat16).eps
    mixed, true = parity_tolerance("bf16-mixed", 2, 100), parity_tolerance("bf16-true", 2, 100)
    assert mixed.grad == pytest.approx(4 * eps / 2 * (2 * 26 / 3) ** 0.5)
    assert mixed.loss == pytest.approx(4 * eps / 2 * (2 * 13 / 3) ** 0.5 / 10)
    assert true.grad == mixed.grad and true.loss == pytest.approx(mixed.loss + eps)
    deeper = parity_tolerance("bf16-mixed", 8, 100)
    assert deeper.grad == pytest.approx(mixed.grad * (98 / 26) ** 0.5)  # 2·(6·8 + 1) roundings against 26
    assert parity_tolerance("16-mixed", 2, 100).grad < mixed.grad  # fp16 has 3 more mantissa bits
    with pytest.raises(ValueError, match="16-bit tolerances only"):
        parity_tolerance("32-true", 2, 100)
    with pytest.raises(ValueError, match="blocks=0"):
        parity_tolerance("bf16-mixed", 0, 100)
def test_tf32_scales_the_tolerances_and_the_checks_run_without_it() -> None:
    """Under the user's TF32 (``set_float32_matmul_precision("high")``) fp32 tolerances scale with TF32's eps; inside
    ``exact_fp32_matmul`` (where the strategy runs its set-up checks) they are fp32's again, and the user's setting
    comes back after, also after an error."""
    from lightning_4d.core.precision import exact_fp32_matmul, output_tolerance
    from lightning_4d.tensor_parallel.replicas import replica_rtol

    fp32 = torch.ones(1)
    try:
        torch.set_float32_matmul_precision("high")
        assert output_tolerance(fp32) == 16 * 2.0**-10 and replica_rtol() == pytest.approx(1e-6 * 2**13)
        with pytest.raises(KeyError), exact_fp32_matmul():
            assert output_tolerance(fp32) == 1e-4 and replica_rtol() == 1e-6
            raise KeyError
        assert torch.get_float32_matmul_precision() == "high"
        torch.set_float32_matmul_precision("medium")
        assert output_tolerance(fp32) == 16 * torch.finfo(torch.bfloat16).eps == output_tolerance(fp32.bfloat16())
    finally:
        torch.set_float32_matmul_precision("highest")
