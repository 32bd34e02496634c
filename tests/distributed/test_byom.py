"""Bring your own model: real third-party dense models train under every layout with no user code.

Families (:mod:`tests.distributed.byom_models`): Hugging Face Llama / Mistral / Qwen2 / Qwen3 / GPT-2 built
from their config classes (wrapped only in ``HFLogits``), a nanoGPT-style model (``transformer`` ModuleDict,
tied ``lm_head``, ``[q | k | v]`` fused ``c_attn``) and TorchTitan-style models (``layers`` ModuleDict, blocks
called with ``freqs_cis`` and a mask, fused ``wqkv`` or separate ``wq wk wv``).

Every family × layout (tp=2 with SP on/off, pp=2, dp=2 FSDP2/replicate, tp=2×pp=2, tp=2×dp=2) must match the
single-process reference: per-step global losses and the final raw gradients (no clipping, so a gradient
scale error cannot hide) within 1e-5 relative (fp32). Under tp>1 ``fit_spec`` also checks that every
replicated parameter and gradient is identical on all tp ranks, and the main projections of the first
block must really be sharded on tp (a layout that silently replicates them is not tensor parallelism).

Each (family, layout) runs in its own small world: starting a world costs well under a second once the
forkserver is warm, and a failing layout then cannot hide the others. Short process-group timeouts make a
failing world return within about a minute instead of hanging.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from lightning_4d.testing import run_world
from tests.distributed.common import References, assert_parity, fit_spec, merge_ranks, rel_err, world_fit

os.environ.setdefault("OMP_NUM_THREADS", "1")

FAMILIES = ("hf-llama", "hf-mistral", "hf-qwen2", "hf-qwen3", "hf-gpt2", "nanogpt", "titan", "titan-sep")
# lr=1e-4, not fit_spec's 1e-3: AdamW's first updates are ±lr on every element whatever its gradient's size, so
# an element whose gradient is ~0 moves by ±lr on the sign of its rounding error. Measured on the single-process
# references alone, a 1e-7 relative (~1 ulp) perturbation of the initial weights changes the gradients after 2-3
# unclipped steps by up to 3.4e-5 at lr=1e-3 (hf-llama, nanogpt, hf-qwen3, even the in-tree llama-4 at step 4),
# but by at most 2.3e-6 at lr=1e-4, and by ~1e-6 after one step (no update yet). The amplification is
# proportional to lr, so 1e-4 puts the fp32 noise floor well under the 1e-5 tolerance (in float64, a layout that
# missed 1e-5 at lr=1e-3 matched its reference exactly once rounded to fp32), while a real bug still moves
# gradients by O(1).
BASE: dict[str, Any] = dict(steps=3, global_batch=8, lr=1e-4)
PG_TIMEOUT_S = 30  # a rank blocked on a failed peer gives up after this (legit waits here are ~1 s)

# name -> (world, strategy kwargs, layers). Pipeline layouts use 4 layers: 2 blocks per stage.
LAYOUTS: dict[str, tuple[int, dict[str, Any], int]] = {
    "tp2": (2, dict(tp=2), 2),
    "tp2-nosp": (2, dict(tp=2, sequence_parallel=False), 2),
    "pp2": (2, dict(pp=2), 4),
    "dp2-fsdp": (2, dict(data_parallel="fsdp"), 2),
    "dp2-replicate": (2, dict(data_parallel="replicate"), 2),
    "tp2-pp2": (4, dict(tp=2, pp=2), 4),
    "tp2-dp2": (4, dict(tp=2, data_parallel="fsdp"), 2),
    "tp2-dp2-replicate": (4, dict(tp=2, data_parallel="replicate"), 2),
}

# The first block's attention and MLP projections (LightningModule names): under tp>1 each must be a DTensor
# sharded on the tp mesh dimension. CausalLM.model is the user's model; HFLogits.model the transformers one.
_HF_BLOCK0 = "model.model.model.layers.0"
SHARDED: dict[str, list[str]] = {
    **{f: [f"{_HF_BLOCK0}.self_attn.q_proj.weight", f"{_HF_BLOCK0}.self_attn.o_proj.weight",
           f"{_HF_BLOCK0}.mlp.gate_proj.weight", f"{_HF_BLOCK0}.mlp.down_proj.weight"]
       for f in ("hf-llama", "hf-mistral", "hf-qwen2", "hf-qwen3")},
    "hf-gpt2": [f"model.model.transformer.h.0.{n}.weight" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                     "mlp.c_proj")],
    "nanogpt": [f"model.transformer.h.0.{n}.weight" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                               "mlp.c_proj")],
    "titan": [f"model.layers.0.{n}.weight" for n in ("attention.wqkv", "attention.wo", "feed_forward.w1",
                                                      "feed_forward.w2")],
    "titan-sep": [f"model.layers.0.{n}.weight" for n in ("attention.wq", "attention.wo", "feed_forward.w1",
                                                          "feed_forward.w2")],
}


def _kind(family: str, layers: int) -> str:
    return family if layers == 2 else f"{family}-{layers}"


def _spec(family: str, layout: str, **extra: Any) -> dict[str, Any]:
    world, strategy, layers = LAYOUTS[layout]
    spec = dict(BASE, model=_kind(family, layers), world=world,
                strategy=dict(strategy, timeout_s=PG_TIMEOUT_S), **extra)
    if strategy.get("tp", 1) > 1:
        spec.setdefault("check_sharded", SHARDED[family])
    return spec


@pytest.fixture(scope="module")
def references() -> References:
    return References(BASE)


@pytest.fixture(scope="module")
def parity_runs() -> dict[tuple[str, str], dict[str, Any]]:
    """Every (family, layout) trained once: one world per world size runs all of its cells (an 8-rank world
    costs ~15 s before any work on 2 cores; one world per cell spent most of this module's time starting ranks)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for world in sorted({w for w, _, _ in LAYOUTS.values()}):
        cells = [(family, layout) for layout, (w, _, _) in LAYOUTS.items() if w == world for family in FAMILIES]
        out.update(zip(cells, _run([_spec(*cell) for cell in cells])))
    return out


def _run(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    world = specs[0]["world"]
    assert all(s["world"] == world for s in specs)
    return merge_ranks(run_world(world_fit, world, specs, timeout_s=600, pg_timeout_s=PG_TIMEOUT_S))


def _check_sharded(got: dict[str, Any], label: str) -> None:
    if "sharded" in got:
        flat = [name for name, sharded in got["sharded"].items() if not sharded]
        assert not flat, f"{label}: not sharded on tp (a DTensor with a Shard placement expected): {flat}"


# ----------------------------------------------------------------------------------------------- harness checks
def test_references_are_deterministic() -> None:
    # The single-process references (and so every parity check) must not depend on run order or state.
    for family in FAMILIES + ("nanogpt-literal",):
        a, b = fit_spec(dict(BASE, model=family)), fit_spec(dict(BASE, model=family))
        assert a["losses"] == b["losses"], family
        assert a["grads"].keys() == b["grads"].keys(), family
        for name, g in a["grads"].items():
            assert g.equal(b["grads"][name]), f"{family}: {name}"
        assert all(g.abs().sum() > 0 for g in a["grads"].values()), family


# ----------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_byom_parity(family: str, layout: str, references: References,
                     parity_runs: dict[tuple[str, str], dict[str, Any]]) -> None:
    spec = _spec(family, layout)
    got = parity_runs[(family, layout)]
    label = f"{spec['model']} {layout}"
    assert_parity(got, references[spec["model"]], label=label)
    _check_sharded(got, label)


# ----------------------------------------------------------------------------------------------- clear errors
def _literal_tp(rank: int) -> str:
    try:
        fit_spec(dict(BASE, model="nanogpt-literal", steps=1, world=2, strategy=dict(tp=2, timeout_s=PG_TIMEOUT_S)))
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return ""


def test_nanogpt_literal_attention_fails_clearly_under_tp() -> None:
    # nanoGPT's own attention takes its widths from the input (`B, T, C = x.size()`, `.view(B, T, C)`), which a
    # tensor-parallel split cannot follow. Expected: an error on every rank that names the attention module
    # (`c_attn` or its module path), not a raw torch shape/DTensor error deep inside the forward. The exact
    # wording is the library's; only the module must be named.
    messages = run_world(_literal_tp, 2, timeout_s=300, pg_timeout_s=PG_TIMEOUT_S)
    for rank, msg in enumerate(messages):
        assert msg, f"rank {rank}: nanoGPT's literal attention trained under tp=2 without an error"
        assert any(k in msg for k in ("c_attn", "h.0.attn", "LiteralCausalSelfAttention")), (
            f"rank {rank}: the error does not name the attention module:\n{msg}")


# ----------------------------------------------------------------------------------------------- regressions
def test_qwen3_qk_norm_gradients_are_summed_over_tp(references: References,
                                                   parity_runs: dict[tuple[str, str], dict[str, Any]]) -> None:
    # Qwen3's q_norm/k_norm (RMSNorm over head_dim) are replicated parameters applied to each rank's own heads
    # under TP: each rank sees only its heads' contribution to their gradients, which must be summed over tp.
    # Unsummed, rank 0 holds half the gradient (parity fails) and the replicas drift apart after one step
    # (fit_spec's replica check fails).
    ref = references["hf-qwen3"]
    norms = [n for n in ref["grads"] if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 4, norms
    for layout in ("tp2", "tp2-nosp"):  # the parity runs' cells
        spec, got = _spec("hf-qwen3", layout), parity_runs[("hf-qwen3", layout)]
        label = f"hf-qwen3 {spec['strategy']}"
        for name in norms:
            err = rel_err(got["grads"][name], ref["grads"][name])
            assert err <= 1e-5, f"{label}: {name} gradient rel err {err:.2e}"
        assert_parity(got, ref, label=label)


def test_gpt2_conv1d_is_sharded_under_tp(references: References,
                                         parity_runs: dict[tuple[str, str], dict[str, Any]]) -> None:
    # transformers' GPT-2 uses Conv1D (weight stored (in, out)), not nn.Linear: under tp=2 its projections must
    # really be sharded, not silently left replicated (which trains correctly but is no tensor parallelism).
    names = SHARDED["hf-gpt2"]
    assert _spec("hf-gpt2", "tp2")["check_sharded"] == names
    got = parity_runs[("hf-gpt2", "tp2")]
    assert set(got["sharded"]) == set(names)
    for name in names:
        assert got["sharded"][name] is True, f"{name} is not a DTensor sharded on tp after fit"
    assert_parity(got, references["hf-gpt2"], label="hf-gpt2 tp2")



# ----------------------------------------------------------------------------------------------- non-LM outputs
def _regression_fit(rank: int, strategy: Any) -> list[float]:
    """A model whose output is one number per token (mse_loss), not vocabulary logits: its head must stay
    whole under TP (no parallel cross-entropy), and training must match one process."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_4d import FourDModule, FourDStrategy
    from tests.distributed.byom_models import build_byom

    class Regression(FourDModule, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_byom("titan-sep")
            self.model.output = torch.nn.Linear(self.model.output.in_features, 1)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.model(tokens).squeeze(-1)  # (B, T)

        def loss_fn(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(out, targets)

        def count_targets(self, targets: torch.Tensor) -> torch.Tensor:
            return torch.tensor(targets.numel())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    module = Regression()
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (24, 16), generator=gen)
    y = torch.randn(24, 16, generator=gen)
    losses: list[float] = []

    class Keep(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    kwargs = dict(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[Keep()])
    if strategy is None:
        trainer = L.Trainer(devices=1, **kwargs)
        # The strategy's sampler (dp=1) shuffles with seed 0: replay that order.
        order = torch.randperm(24, generator=torch.Generator().manual_seed(0)).tolist()
        loader = DataLoader(TensorDataset(x, y), batch_size=8, sampler=order)
    else:
        trainer = L.Trainer(devices=2, strategy=FourDStrategy(**strategy), **kwargs)
        loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)
    trainer.fit(module, loader)
    return losses


def test_regression_head_under_tp_matches_one_process() -> None:
    ref = _regression_fit(0, None)
    for strategy in (dict(tp=2), dict(tp=2, sequence_parallel=False)):
        got = run_world(_regression_fit, 2, strategy, timeout_s=300, pg_timeout_s=PG_TIMEOUT_S)[0]
        assert len(got) == len(ref) == 3
        for a, b in zip(got, ref):
            assert abs(a - b) <= 1e-5 * abs(b), (strategy, got, ref)


def _soft_targets(rank: int) -> str:
    """Float (probability) targets under tp=2: a clear error on every TP rank before the step's collectives
    (the vocabulary-parallel cross-entropy takes class indices)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_4d import FourDStrategy
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model

    torch.manual_seed(0)
    inputs, targets = torch.randint(0, 64, (8, 16)), torch.rand(8, 16)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(tp=2), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(CausalLM(build_model("llama")), DataLoader(TensorDataset(inputs, targets), batch_size=4))
    except ValueError as err:
        return str(err)
    return ""


def test_soft_targets_under_tp_fail_clearly() -> None:
    for msg in run_world(_soft_targets, 2, timeout_s=300, pg_timeout_s=PG_TIMEOUT_S):
        assert "integer class indices" in msg and "torch.float32" in msg, msg
