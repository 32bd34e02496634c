"""Context parallelism (gloo, CPU), both algorithms (all-gather and Ulysses; "auto" picks Ulysses for these
models, whose heads divide): parity of losses and gradients with one process (1e-5 relative, fp32) for the
package's Llama, a user's own SDPA model and transformers' Llama / Qwen3 / Gemma 3 (alternating sliding-window and
global layers) / Mistral (a window on every layer) under cp=2 (and with activation checkpointing, with gradient
accumulation and clipping, and built on the meta device), cp=2 × tp=2 (also both windowed models), cp=2 × dp=2,
cp=2 × pp=2 (also on packed documents, with and without activation checkpointing: each micro-batch's documents) and
an MoE under cp=2 × ep=2;
exact attention on raw tensors (causal, packed documents, GQA, a sliding window with and without documents; each
algorithm) with its bytes on the wire (K/V all-gather, Ulysses' all-to-alls) equal to the formulas; packed documents
giving the loss of each document run alone under cp=2 (each algorithm), cp=2 × tp=2 and cp=2 × pp=2 (and another
loss without the document mask); the communication monitor's cp and dp_cp axes; models refused at set-up, naming
the module (eager attention, Gemma 2's logit soft-capping, positions from the local length)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_4d.testing import run_world
from tests.distributed.common import assert_parity, fit_spec, merge_ranks, world_fit

os.environ.setdefault("OMP_NUM_THREADS", "1")

RTOL = 1e-5
# One optimizer step: AdamW's first update is about lr·sign(g), so gradients of ~1e-8 (tiny random models) turn
# rounding differences into parameter differences; the Llama runs three steps (its gradients are not that small).
ONE_STEP = dict(steps=1, clip=None)
THREE_STEPS = dict(steps=3, clip=None)


def _spec(model: str, strategy: dict[str, Any], world: int, **extra: Any) -> dict[str, Any]:
    """A run of ``model`` under ``strategy``; ``extra``: e.g. ``meta=True`` (built on the meta device, materialised
    shard by shard), ``accumulate`` / ``clip`` — the reference (:func:`_reference`) has them too."""
    return {"model": model, **(THREE_STEPS if model == "llama" else ONE_STEP), **extra, "world": world,
            "strategy": strategy}


def _reference(spec: dict[str, Any]) -> dict[str, Any]:
    """The single-process run ``spec`` is compared with."""
    return {k: v for k, v in spec.items() if k not in ("world", "strategy")}


def _key(spec: dict[str, Any]) -> str:
    return repr(sorted(_reference(spec).items()))


def _trainer(strategy: dict[str, Any], devices: int, **kwargs: Any) -> L.Trainer:
    from lightning_4d import FourDStrategy

    return L.Trainer(accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
                     strategy=FourDStrategy(**strategy, timeout=timedelta(seconds=60)), enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


# ------------------------------------------------------------------------------------------- raw attention
def _attention_cases(rank: int) -> dict[str, float]:
    """Worst absolute error of outputs and of q/k/v gradients, per case, against the whole sequence."""
    import torch.nn.functional as F

    from lightning_4d.core.batches import document_ids
    from lightning_4d.context_parallel import ContextParallelAttention, SequenceShard, zigzag_split
    from lightning_4d.models.llama import packed_causal_mask

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_4d.core.comm import CommCounter, mesh_axis_groups
    from lightning_4d.context_parallel.cost import kv_wire_bytes, ulysses_wire_bytes
    from lightning_4d.context_parallel.windows import track_windows
    from tests.distributed.cp_models import WINDOW

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    B, H, KV, T, E = 2, 4, 2, 16, 8
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3], list(range(16))])  # (B, T)
    out: dict[str, float] = {}

    def windowed(pos: torch.Tensor, docs: bool) -> torch.Tensor:  # (B, 1, n, n): window over sequence indices
        n = pos.shape[1]
        idx = torch.arange(n)
        band = (idx[:, None] - idx[None, :] < WINDOW)[None, None]  # (1, 1, n, n)
        return band & (packed_causal_mask(pos) if docs else torch.ones(1, 1, n, n, dtype=torch.bool).tril())

    class Layer(torch.nn.Module):  # declares its window as transformers' Qwen2 / Gemma 3 attention modules do
        sliding_window = WINDOW

        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return F.scaled_dot_product_attention(*args, **kwargs)

    layer = Layer()
    track_windows(layer)
    for case in CASES:
        algorithm = "ulysses" if case.startswith("ulysses") else "allgather"
        kv_heads = KV if case.endswith("gqa") else H
        q = torch.randn(B, H, T, E, generator=gen, requires_grad=True)
        k, v = (torch.randn(B, kv_heads, T, E, generator=gen, requires_grad=True) for _ in range(2))
        w = torch.randn(B, H, T, E, generator=gen)
        kwargs: dict[str, Any] = dict(enable_gqa=True) if case.endswith("gqa") else {}
        documents, window = "documents" in case, "window" in case
        mask = windowed(positions, documents) if window else packed_causal_mask(positions) if documents else None
        whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **kwargs)
        (whole * w).sum().backward()
        local = [zigzag_split(t.detach(), 2, rank, dim=2).requires_grad_() for t in (q, k, v)]
        local_pos = zigzag_split(positions if documents else torch.arange(T)[None].expand(B, T), 2, rank)
        # the model's mask from its local chunk: the jump between the zigzag chunks starts a "document" (transformers)
        shard = SequenceShard(mesh.get_group(), 2, rank, T, global_docs=document_ids(positions) if documents
                              else None, local_docs=document_ids(local_pos))
        local_mask = windowed(local_pos, True) if window else packed_causal_mask(local_pos) if documents else None
        with CommCounter(mesh_axis_groups(mesh)) as counter:
            with ContextParallelAttention(shard, algorithm=algorithm):
                y = (layer if window else F.scaled_dot_product_attention)(
                    *local, attn_mask=local_mask, is_causal=local_mask is None, **kwargs)
            (y * zigzag_split(w, 2, rank, dim=2)).sum().backward()
        # K/V on the wire (one layer): traced = formula (GQA left to SDPA gathers the repeated heads).
        out[f"{case} bytes"] = sum(v["sent_bytes"] for (axis, _), v in counter.totals().items() if axis == "cp")
        out[f"{case} formula"] = kv_wire_bytes(B, T, H * E, layers=1, cp=2, act_bytes=4) if algorithm == "allgather" \
            else ulysses_wire_bytes(B, T, H * E, H * E, layers=1, cp=2, act_bytes=4)
        errs = [float((y.detach() - zigzag_split(whole.detach(), 2, rank, dim=2)).abs().max())]
        errs += [float((a.grad - zigzag_split(b.grad, 2, rank, dim=2)).abs().max()) for a, b in zip(local, (q, k, v))]
        out[f"{case} error"] = max(errs)
        if window:  # the window matters: the whole sequence's attention without it differs
            full = F.scaled_dot_product_attention(q, k, v, attn_mask=packed_causal_mask(positions) if documents
                                                  else None, is_causal=not documents)
            out[f"{case} without window"] = float((full - whole).detach().abs().max())
    return out


# ------------------------------------------------------------------------------------------- packed documents
def _packed_losses(strategy: dict[str, Any], devices: int) -> dict[str, float]:
    from lightning_4d.context_parallel import SequenceShard
    from tests.distributed.test_batches import _lm, _TrainLoss, packed_rows

    x, y, pos, _ = packed_rows()
    record = _TrainLoss()
    trainer = _trainer(strategy, devices, max_steps=1, callbacks=[record])
    lm = _lm("llama")
    packed = trainer.validate(lm, DataLoader([(x, y, pos)], batch_size=None), verbose=False)[0]["val_loss"]
    crossing = trainer.validate(lm, DataLoader([(x, y)], batch_size=None), verbose=False)[0]["val_loss"]
    global_mask, whole_mask = SequenceShard.global_mask, SequenceShard.whole_mask
    try:  # global positions, but the mask causal only: documents see each other across the ranks
        SequenceShard.global_mask = lambda self, documents, device, window=None: global_mask(  # type: ignore
            self, False, device, window)
        SequenceShard.whole_mask = lambda self, documents, device, window=None: whole_mask(  # type: ignore
            self, False, device, window)
        undivided = trainer.validate(lm, DataLoader([(x, y, pos)], batch_size=None), verbose=False)[0]["val_loss"]
    finally:
        SequenceShard.global_mask, SequenceShard.whole_mask = global_mask, whole_mask  # type: ignore[method-assign]
    trainer.fit(lm, DataLoader([(x, y, pos)], batch_size=None))
    return {"packed": packed, "crossing": crossing, "no_document_mask": undivided, "train": record.losses[0]}


def _packed_reference() -> float:
    from tests.distributed.test_batches import _lm, packed_rows
    from tests.unit.test_packing import one_by_one

    x, y, pos, docs = packed_rows()
    lm = _lm("llama")
    with torch.no_grad():
        single = lm.fourd_loss((x, y, pos)).item()
        reference = one_by_one(lm, y, docs)
    assert abs(single - reference) <= RTOL * abs(reference), (single, reference)
    return reference


def _check_packed(got: dict[str, float], reference: float, label: str) -> None:
    for name in ("packed", "train"):
        assert abs(got[name] - reference) <= RTOL * abs(reference), (label, name, got, reference)
    for name in ("crossing", "no_document_mask"):
        assert abs(got[name] - reference) > 10 * RTOL * abs(reference), (label, name, got, reference)


# ------------------------------------------------------------------------------------------- refusals
REFUSED = {
    "cp-hf-llama-eager": "self_attn",  # transformers' eager attention: matmul + softmax, not SDPA
    "cp-hf-gemma2-softcap": "attn_logit_softcapping",  # Gemma 2: SDPA has no logit soft-capping
    "nanogpt": "transformer.wpe",  # learned positions from torch.arange(T): the first module to differ
}


def _refusal(kind: str) -> str:
    from lightning_4d.context_parallel import UnsplittableAttention
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model, make_dataset

    torch.manual_seed(0)
    lm = CausalLM(build_model(kind), lr=1e-3)
    try:
        _trainer(dict(cp=2), 2, max_steps=1).fit(lm, DataLoader(make_dataset(2), batch_size=2))
    except UnsplittableAttention as err:
        return str(err)
    return "not refused"


# ------------------------------------------------------------------------------------------- a chunk of padding
def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Targets ignored on positions 4..11: all of cp rank 1's tokens under cp=2 (its mean loss would be 0/0)."""
    from tests.distributed.common import make_dataset

    x, y = make_dataset(4)[:]
    y = y.clone()
    y[:, 4:12] = -100
    return x, y


def _padded_losses(rank: int) -> dict[str, float]:
    from tests.distributed.test_batches import _lm, _TrainLoss

    record = _TrainLoss()
    trainer = _trainer(dict(cp=2), 2, max_steps=1, callbacks=[record])
    lm = _lm("llama")
    batch = DataLoader([_padded_batch()], batch_size=None)
    val = trainer.validate(lm, batch, verbose=False)[0]["val_loss"]
    trainer.fit(lm, batch)
    return {"val": val, "train": record.losses[0]}


# ------------------------------------------------------------------------------------------- worlds
def _world2(rank: int, specs: list[dict[str, Any]]) -> dict[str, Any]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    return {"attention": _attention_cases(rank), "fits": world_fit(rank, specs),
            "packed": _packed_losses(dict(cp=2, **AG), 2), "packed ulysses": _packed_losses(dict(cp=2, **UL), 2),
            "padded": _padded_losses(rank),
            "refused": {k: _refusal(k) for k in REFUSED}}


def _monitored(rank: int) -> dict[str, float]:
    """The communication monitor's bytes per axis of one cp=2 × dp=2 step of the Llama."""
    from lightning_4d.callbacks import CommunicationMonitor
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model, make_dataset

    torch.manual_seed(0)
    lm = CausalLM(build_model("llama"), lr=1e-3)
    trainer = _trainer(dict(cp=2, dp=2), 4, max_steps=1, callbacks=[CommunicationMonitor(every_n_steps=1)])
    trainer.fit(lm, DataLoader(make_dataset(8), batch_size=4))
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}


def _world4(rank: int, specs: list[dict[str, Any]]) -> dict[str, Any]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    return {"fits": world_fit(rank, specs), "packed": _packed_losses(dict(cp=2, tp=2), 4),
            "packed pp": _packed_losses(dict(cp=2, pp=2), 4), "monitored": _monitored(rank)}


# Raw attention cases: each algorithm on causal, packed documents, GQA and a sliding window (with documents).
CASES = ("causal", "documents", "gqa", "window", "window documents", "ulysses causal", "ulysses documents",
         "ulysses gqa", "ulysses window documents")
# The models' heads divide by cp (and tp): cp_algorithm="auto" runs Ulysses; "allgather" is named where it is meant.
AG = dict(cp_algorithm="allgather")
UL = dict(cp_algorithm="ulysses")
WORLD2 = [_spec("llama", dict(cp=2, **UL), 2),
          _spec("llama", dict(cp=2, activation_checkpointing="full"), 2),
          _spec("llama", dict(cp=2, activation_checkpointing="selective", **AG), 2),
          _spec("llama", dict(cp=2), 2, meta=True), _spec("llama", dict(cp=2, **AG), 2, accumulate=2, clip=0.05),
          _spec("cp-user", dict(cp=2), 2), _spec("cp-hf-llama", dict(cp=2, **AG), 2),
          _spec("cp-hf-qwen3", dict(cp=2), 2), _spec("cp-hf-gemma3-window", dict(cp=2, **AG), 2),
          _spec("cp-hf-mistral-window", dict(cp=2), 2)]
WORLD4 = [_spec("llama", dict(cp=2, tp=2, **UL), 4),
          _spec("llama", dict(cp=2, dp=2, **AG), 4), _spec("llama", dict(cp=2, pp=2), 4),
          _spec("llama", dict(cp=2, pp=2, **AG), 4, packed=True),  # packed: documents per micro-batch
          _spec("llama", dict(cp=2, pp=2, activation_checkpointing="full"), 4, packed=True),
          _spec("llama", dict(cp=2, dp=2, data_parallel="replicate"), 4), _spec("cp-user", dict(cp=2, tp=2, **AG), 4),
          _spec("cp-user", dict(cp=2, dp=2), 4), _spec("moe", dict(cp=2, ep=2), 4),
          _spec("moe", dict(cp=2, ep=2, tp=2, **AG), 4),
          # sliding windows under cp × tp (their 2 K/V heads leave 1 per tp rank: "auto" picks the all-gather)
          _spec("cp-hf-mistral-window", dict(cp=2, tp=2), 4), _spec("cp-hf-gemma3-window", dict(cp=2, tp=2), 4)]


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    pytest.importorskip("transformers")
    return {_key(s): fit_spec(_reference(s)) for s in {_key(s): s for s in WORLD2 + WORLD4}.values()}


def test_context_parallel_two_ranks(references: dict[str, dict[str, Any]]) -> None:
    specs = WORLD2
    results = run_world(_world2, 2, specs, timeout_s=900, pg_timeout_s=120)
    for rank_result in results:
        found = rank_result["attention"]
        for case in CASES:
            assert found[f"{case} error"] < 1e-5, found
            assert found[f"{case} bytes"] == found[f"{case} formula"] > 0, found
            if "window" in case:
                assert found[f"{case} without window"] > 1e-3, found
    for spec, got in zip(specs, merge_ranks([r["fits"] for r in results])):
        assert_parity(got, references[_key(spec)], RTOL, label=f"{_key(spec)} {spec['strategy']}")
    reference = _packed_reference()
    from tests.distributed.test_batches import _lm

    with torch.no_grad():
        padded = _lm("llama").fourd_loss(_padded_batch()).item()
    for rank_result in results:
        _check_packed(rank_result["packed"], reference, "cp=2 allgather")
        _check_packed(rank_result["packed ulysses"], reference, "cp=2 ulysses")
        for name, got in rank_result["padded"].items():  # a rank without valid targets adds nothing (not NaN)
            assert abs(got - padded) <= RTOL * abs(padded), (name, got, padded)
        for kind, needle in REFUSED.items():
            message = rank_result["refused"][kind]
            assert needle in message and "cp=1" in message, (kind, message)


def test_context_parallel_four_ranks(references: dict[str, dict[str, Any]]) -> None:
    specs = WORLD4
    results = run_world(_world4, 4, specs, timeout_s=900, pg_timeout_s=120)
    for spec, got in zip(specs, merge_ranks([r["fits"] for r in results])):
        assert_parity(got, references[_key(spec)], RTOL, label=f"{_key(spec)} {spec['strategy']}")
    reference = _packed_reference()
    for rank_result in results:
        _check_packed(rank_result["packed"], reference, "cp=2 × tp=2")
        _check_packed(rank_result["packed pp"], reference, "cp=2 × pp=2")
    # The monitor names the cp axis (the formula's bytes: 4 sequences of 16 tokens per rank, 2 layers, the Llama's
    # K/V repeated to its 8 heads of 4 features, fp32; "auto" picks Ulysses: 8 heads divide by cp=2, all-to-all
    # only) and dp_cp (FSDP2 over dp × cp).
    metrics = results[0]["monitored"]
    from lightning_4d.context_parallel.cost import ulysses_wire_bytes

    assert metrics["comm/cp/all_to_all_bytes"] == ulysses_wire_bytes(4, 16, 32, 32, layers=2, cp=2, act_bytes=4)
    assert "comm/cp/all_gather_bytes" not in metrics, metrics
    assert metrics["comm/dp_cp/reduce_scatter_bytes"] > 0, metrics
