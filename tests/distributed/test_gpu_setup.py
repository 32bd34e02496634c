"""GPU first contact, on CPU. Every tensor the package hands a collective is on its group's device, from set-up to the
last step (GPU audit B1-B4), checked with the host-tensor guard (:mod:`tests.host_guard`: the package's collectives
refuse tensors a GPU run would leave on the host, as NCCL does); and the set-up checks hold under TF32 (B5, with
:mod:`tests.emulated_tf32`). One 2-rank world runs each path once, under the guard:

- B1: a model built for real in ``__init__`` (the README's example), and one built in ``configure_model`` (under the
  strategy's ``tensor_init_context``), under the default ``sync_module_states``: broadcast from the device;
- B2: context parallelism's set-up check with a model built for real: its tokens, model and flag on the device;
- B3: the expert token-shard check of a user TP plan under ep×tp: its fingerprints built on the tokens' device (the
  plan keeps the sequence whole, so the check's own ``ValueError`` is the expected end);
- B4: a meta-built model holding a tensor made for real on the host (``device="cpu"``): broadcast from the device;
- B5: tp=2 with TF32 matmuls (``torch.set_float32_matmul_precision("high")``, emulated): the set-up checks run in
  full fp32 and accept the rewrite; the user's precision is "high" again after set-up;
- two steps, a validation and a prediction under pp=2, and under tp=2 × ep=2 (the steps' collectives);
- Lightning Fabric's strategy (``lightning_4d.fabric``): LitGPT's Llama built under ``fabric.init_module()`` (on the
  device), three steps of the plain loop under tp=2 and of ``train_step`` under pp=2, clipping and ``eval_step``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_4d.testing import run_world

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _fit(make_lm: Callable[[], L.LightningModule], callbacks: Any = None, **strategy: Any) -> L.LightningModule:
    from lightning_4d import FourDStrategy
    from tests.distributed.common import make_dataset

    torch.manual_seed(0)
    lm = make_lm()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
                        strategy=FourDStrategy(**strategy, timeout=timedelta(seconds=60)))
    dp = 2 // (strategy.get("tp", 1) * strategy.get("cp", 1))
    trainer.fit(lm, DataLoader(make_dataset(4), batch_size=4 // dp))
    return lm


def _llama() -> torch.nn.Module:
    from tests.distributed.common import build_model

    return build_model("llama")


def _b1_init() -> None:
    from lightning_4d.models import CausalLM

    _fit(lambda: CausalLM(_llama()), tp=2)


def _b1_configure_model() -> None:
    from lightning_4d.models import CausalLM

    class Late(CausalLM):
        def configure_model(self) -> None:  # built where the strategy's tensor_init_context says
            if self.model is None:
                self.model = _llama()

    _fit(lambda: Late(None), tp=2)  # type: ignore[arg-type]


def _b2_cp() -> None:
    from lightning_4d.models import CausalLM

    # sync_module_states=False: the cp check is the first collective that sees the model.
    _fit(lambda: CausalLM(_llama()), cp=2, sync_module_states=False)


def _b3_token_check() -> None:
    from tests.distributed.moe_models import build_moe_model
    from tests.distributed.test_expert_user_plan import WholeSequencePlan

    # sync_module_states=False: the token check is the first collective that sees a tensor of the model's.
    with pytest.raises(ValueError, match="sees the same tokens"):
        _fit(lambda: WholeSequencePlan(build_moe_model(), lr=1e-3), tp=2, ep=2, sync_module_states=False)


def _b4_meta_host_tensor() -> None:
    from lightning_4d.models import CausalLM

    def make() -> L.LightningModule:
        with torch.device("meta"):
            model = _llama()
            model.register_buffer("table", torch.arange(4.0, device="cpu") + torch.distributed.get_rank())
        return CausalLM(model)

    table = _fit(make, dp=2).model.table
    assert torch.equal(table.cpu(), torch.arange(4.0)), table  # rank 0's values on every rank


def _b5_tf32() -> None:
    from lightning_4d.models import CausalLM
    from tests.emulated_tf32 import emulated_tf32

    seen: list[str] = []

    class Observe(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            seen.append(torch.get_float32_matmul_precision())

    torch.set_float32_matmul_precision("high")
    try:
        with emulated_tf32():
            # sync_module_states=False: the set-up value check is the first thing to see the model's values.
            _fit(lambda: CausalLM(_llama()), tp=2, callbacks=[Observe()], sync_module_states=False)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert seen == ["high"], seen  # restored after set-up


def _steps(spec: dict[str, Any]) -> Callable[[], None]:
    def run() -> None:
        from tests.distributed.common import fit_spec

        fit_spec(dict(spec, world=2, steps=2, clip=1.0))

    return run


def _fabric(case: dict[str, Any]) -> Callable[[], None]:
    def run() -> None:
        from tests.distributed.fabric_cases import run_case
        from tests.host_guard import DEVICE_STAND_IN

        run_case(dict(case, device=str(DEVICE_STAND_IN)))  # Fabric hands each rank the guard's device

    return run


CASES = {"B1 __init__": _b1_init, "B1 configure_model": _b1_configure_model, "B2 cp check": _b2_cp,
         "B3 token-shard check": _b3_token_check, "B4 meta-built model's host tensor": _b4_meta_host_tensor,
         "B5 set-up checks under TF32": _b5_tf32,
         # The steps' collectives: pipeline (loss and output broadcasts, tied gradients, metrics), expert dispatch
         # under tp (all-to-all, counts, the replica check), clipping's norm, the non-finite guard's flags.
         "steps pp=2": _steps(dict(model="llama", strategy=dict(pp=2), validate=True, predict=True)),
         "steps tp=2 ep=2": _steps(dict(model="moe", strategy=dict(tp=2, ep=2), validate=True)),
         "Fabric tp=2 plain loop": _fabric(dict(model="litgpt", loop="plain", strategy=dict(tp=2))),
         "Fabric pp=2 train_step": _fabric(dict(model="litgpt", loop="step", strategy=dict(pp=2), ignore=0.2))}


def _world(rank: int) -> dict[str, str]:
    from tests.host_guard import host_tensor_guard

    os.environ.setdefault("PL_DISABLE_FORK", "1")
    out = {}
    for name, case in CASES.items():
        try:
            with host_tensor_guard():
                case()
            out[name] = "ok"
        except Exception as err:  # noqa: BLE001 - reported per case
            out[name] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, str]]:
    return run_world(_world, 2, timeout_s=600, pg_timeout_s=60)


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_setup_on_cpu(world: list[dict[str, str]], case: str) -> None:
    assert [r[case] for r in world] == ["ok", "ok"], case
