"""Devices by name: every part carries its family's calibrated constants, custom devices name a family (or an
efficiency), ``plan.device`` takes every name, overrides mark the device, and a plan prints what it used and what
only the planner models."""

from __future__ import annotations

import pytest

from lightning_4d.mesh import ParallelDims
from lightning_4d.planner import ClusterSpec, TrainSpec, TransformerSpec, format_table, make_plan
from lightning_4d.planner.hardware import (
    DEVICE_ALIASES,
    DEVICES,
    FAMILIES,
    H100,
    H100_HBM2E_500W,
    DeviceFamily,
    custom_device,
    device_by_name,
    device_names,
)
from lightning_4d.planner.spec import planner_only, runtime_speed_notes
from lightning_4d.recipes.planning import PlanError, plan_device
from lightning_4d.recipes.schema import PlanConfig, RecipeConfigError

ISSUE_DEVICES = ("A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H100-NVL", "H100-96GB-500W", "H200", "cpu")


@pytest.mark.parametrize("name", ISSUE_DEVICES)
def test_every_named_device_has_its_family_constants(name: str) -> None:
    dev = device_by_name(name)
    fam = FAMILIES[dev.family]
    for field in ("compute_efficiency", "gemm_half_intensity", "usable_fraction", "allocator_overhead",
                  "latency_intra", "latency_inter", "layer_overhead"):
        assert getattr(dev, field) == getattr(fam, field), (name, field)
    assert dev.note and dev.peak_flops > 0 and dev.memory_bytes > 0
    assert PlanConfig(device=name).device == name  # plan.device takes it


def test_aliases_and_labels_resolve_to_the_same_part() -> None:
    assert device_by_name("H100") is device_by_name("H100-SXM") is H100
    assert device_by_name("A100") is device_by_name("A100-80GB")
    for key, dev in DEVICES.items():
        assert device_by_name(dev.name) is dev and DEVICE_ALIASES[dev.name] == key
    assert set(device_names()) >= set(ISSUE_DEVICES)


def test_memory_sizes_are_the_parts() -> None:
    gb = {k: d.memory_bytes / 1e9 for k, d in DEVICES.items()}
    assert (gb["A100-40GB"], gb["A100-80GB"], gb["H100-SXM"], gb["H100-NVL"], gb["H200"]) == (40, 80, 80, 94, 141)
    assert H100_HBM2E_500W.memory_bytes == 96 * 2**30


def test_unknown_device_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"device 'B300' is not known; use one of .*H100-PCIe.* custom"):
        device_by_name("B300")
    with pytest.raises(RecipeConfigError, match=r"plan.device='B300' is not one of .*'H100-NVL'"):
        PlanConfig(device="B300")


def test_custom_devices_take_their_family_or_an_efficiency() -> None:
    hop = custom_device(96, 800, 450, 50, family="hopper")
    assert (hop.family, hop.compute_efficiency, hop.allocator_overhead) == ("hopper", 0.6, 0.1)
    own = custom_device(96, 800, 450, 50, compute_efficiency=0.5)
    assert (own.family, own.compute_efficiency) == ("custom", 0.5)
    both = custom_device(96, 800, 450, 50, family="ampere", compute_efficiency=0.5)
    assert (both.family, both.compute_efficiency, both.gemm_half_intensity) == ("ampere", 0.5, 60.0)
    with pytest.raises(ValueError, match="a custom device needs a family .* or an explicit compute_efficiency"):
        custom_device(96, 800, 450, 50)
    with pytest.raises(ValueError, match="family='volta' is not one of"):
        custom_device(96, 800, 450, 50, family="volta")


def test_plan_section_rules_for_custom_devices() -> None:
    four = dict(memory_gb=96, peak_tflops=800, nvlink_gb_s=450, infiniband_gb_s=50)
    with pytest.raises(RecipeConfigError, match="plan.device=custom needs plan.family .* or plan.compute_efficiency"):
        PlanConfig(device="custom", **four)
    with pytest.raises(RecipeConfigError, match="plan.family=hopper describes a custom device"):
        PlanConfig(device="H100", family="hopper")
    with pytest.raises(RecipeConfigError, match=r"plan.compute_efficiency=1.5 is a share of the peak"):
        PlanConfig(device="H100", compute_efficiency=1.5)
    with pytest.raises(RecipeConfigError, match=r"plan.selective_policy='some' is not one of"):
        PlanConfig(selective_policy="some")
    assert plan_device(PlanConfig(device="custom", family="hopper", **four)).compute_efficiency == 0.6


def test_overrides_mark_the_device_and_cpu_cores_need_a_cpu() -> None:
    dev = plan_device(PlanConfig(device="H200", memory_gb=100, compute_efficiency=0.5))
    assert (dev.name, dev.memory_bytes, dev.compute_efficiency, dev.family) == ("H200-SXM-141GB*", 100e9, 0.5, "hopper")
    assert plan_device(PlanConfig(device="cpu", cpu_cores=16)).cores == 16
    with pytest.raises(PlanError, match="plan.cpu_cores=16 applies to CPU ranks; plan.device=H100 is a hopper"):
        plan_device(PlanConfig(device="H100", cpu_cores=16))


def test_the_plan_prints_the_constants_and_planner_only_options() -> None:
    spec = TransformerSpec(vocab_size=256, hidden=256, layers=4, heads=4, seq_len=128, name="toy")
    train = TrainSpec(8, activation_checkpointing="selective", selective_policy="every_other_matmul", compile=True,
                      data_parallel="zero1")
    plan = make_plan(spec, ParallelDims.from_world(8), ClusterSpec(1, 8, H100_HBM2E_500W), train)
    text = format_table(plan)
    assert "device: H100-96GB-HBM2e-500W (family hopper: compute_efficiency 0.6" in text
    assert "calibrated on TorchTitan's Llama 3.1 8B H100 runs" in text
    labels = [line for line in text.splitlines() if line.startswith("planner only")]
    assert len(labels) == 2 and any("every_other_matmul" in x for x in labels) and any("zero1" in x for x in labels)
    assert not any("compile" in x for x in labels)  # a runtime feature: described, not labelled planner only
    assert runtime_speed_notes(train)[0].startswith("compile: the runtime compiles each block")
    assert planner_only(TrainSpec(8, activation_checkpointing="selective")) == []  # the runtime's policy


def test_family_is_a_frozen_record() -> None:
    fam = DeviceFamily("x", 0.5)
    with pytest.raises(AttributeError):
        fam.compute_efficiency = 0.7  # type: ignore[misc]
