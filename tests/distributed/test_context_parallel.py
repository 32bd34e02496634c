"""Context parallelism (gloo, CPU), every algorithm (K/V all-gather, Ulysses, ring): parity of losses and gradients
with one process (1e-5 relative, fp32, one optimizer step) — each algorithm under cp=2, cp=2 × tp=2, cp=2 × pp=2,
cp=2 × ep=2 (MoE) and cp=4, each on plain sequences and on packed documents through sliding windows (Gemma 3's
alternating local / global layers; EXAONE-MoE under ep); transformers' Llama, Qwen3, Mistral, Gemma 3, EXAONE 4 (a
window attribute on every layer, applied by the sliding ones only), EXAONE-MoE and Llama 4 (chunked attention) at
cp=2, their windows and chunks crossed by the 16-token sequences; a user's own SDPA model; activation
checkpointing, gradient accumulation and clipping, a model built on the meta device, HSDP × cp, predict (outputs
gathered over the cp ranks) and validate under cp=2 and cp=2 × pp=2.
Exact attention on raw tensors (every algorithm × causal, packed documents, GQA, a sliding window, chunks, each
also per document) with its bytes on the wire equal to the formulas (the ring's sends counted per rank); packed
documents giving the loss of each document run alone (all-gather and ring; and another loss without the document
mask); the communication monitor's cp and dp_cp axes; models refused at set-up, naming the module and a fix that
applies (eager attention, Gemma 2's logit soft-capping, GPT-OSS' and MiMo-V2-Flash's sinks in eager-only attention,
DeepSeek-V3.2's top-k indexer, Llama 4's temperature tuning and other positions from the local length)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_4d.testing import HostSyncCounter, run_world
from tests.distributed.common import assert_parity, fit_spec, merge_ranks, world_fit

os.environ.setdefault("OMP_NUM_THREADS", "1")

RTOL = 1e-5
# One optimizer step: the gradients of the first step are compared directly (AdamW's first update is about
# lr·sign(g), so later steps would turn rounding differences of tiny gradients into parameter differences).
ONE_STEP = dict(steps=1, clip=None)


def _spec(model: str, strategy: dict[str, Any], world: int, **extra: Any) -> dict[str, Any]:
    """A run of ``model`` under ``strategy``; ``extra``: e.g. ``meta=True`` (built on the meta device, materialised
    shard by shard), ``packed=True``, ``accumulate`` / ``clip``, ``predict`` / ``validate`` — the reference
    (:func:`_reference`) has them too."""
    return {"model": model, **ONE_STEP, **extra, "world": world, "strategy": strategy}


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
def _attention_cases(rank: int, cp: int = 2) -> dict[str, float]:
    """Per algorithm and mask (:data:`CASES`): the worst absolute error of outputs and of q/k/v gradients against
    the whole sequence, the bytes this rank sent on the cp axis and the formula's."""
    import torch.nn.functional as F

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_4d.context_parallel import ContextParallelAttention, MaskSpec, SequenceShard, zigzag_split
    from lightning_4d.context_parallel.cost import wire_bytes_per_rank
    from lightning_4d.context_parallel.layer_masks import LayerMasks
    from lightning_4d.core.batches import document_ids
    from lightning_4d.core.comm import CommCounter, mesh_axis_groups
    from tests.distributed.cp_models import CHUNK, WINDOW

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    B, H, KV, T, E = 2, 4, 2, 8 * cp, 8
    first = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]  # three documents, the last running to the end
    positions = torch.tensor([first + list(range(T - len(first))), list(range(T))])  # (B, T)
    docs = document_ids(positions)
    specs = {"causal": MaskSpec(), "documents": MaskSpec(documents=True), "window": MaskSpec("window", WINDOW),
             "window documents": MaskSpec("window", WINDOW, True), "chunk": MaskSpec("chunk", CHUNK),
             "chunk documents": MaskSpec("chunk", CHUNK, True), "gqa": MaskSpec()}

    class Layer(torch.nn.Module):  # the module the set-up check would have read the mask of
        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return F.scaled_dot_product_attention(*args, **kwargs)

    layer, out = Layer(), {}
    for case in CASES:
        algorithm, _, name = case.partition(" ")
        spec = specs[name]
        kv_heads = KV if name == "gqa" else H
        q = torch.randn(B, H, T, E, generator=gen, requires_grad=True)
        k, v = (torch.randn(B, kv_heads, T, E, generator=gen, requires_grad=True) for _ in range(2))
        w = torch.randn(B, H, T, E, generator=gen)
        gqa: dict[str, Any] = dict(enable_gqa=True) if name == "gqa" else {}
        idx = torch.arange(T)
        whole = F.scaled_dot_product_attention(q, k, v, attn_mask=spec.allowed(idx, idx, docs, docs, positions,
                                                                                positions), **gqa)
        (whole * w).sum().backward()
        local = [zigzag_split(t.detach(), cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
        packed = spec.documents
        shard = SequenceShard(mesh.get_group(), cp, rank, T, global_docs=docs if packed else None,
                              global_positions=positions if packed else None)
        masks = LayerMasks({layer: (spec,)}, {layer: "layer"})
        with CommCounter(mesh_axis_groups(mesh)) as counter, HostSyncCounter() as syncs:
            with ContextParallelAttention(shard, algorithm=algorithm, masks=masks):
                y = layer(*local, is_causal=True, **gqa)  # the local mask is not read: the set-up check's is
            (y * zigzag_split(w, cp, rank, dim=2)).sum().backward()
        out[f"{case} host syncs"] = syncs.count
        out[f"{case} bytes"] = sum(v["sent_bytes"] for (axis, kind), v in counter.totals().items()
                                   if axis == "cp" and kind != "recv")
        # K/V as SDPA receives them (GQA left to SDPA: the repeated heads travel)
        out[f"{case} formula"] = wire_bytes_per_rank(algorithm, B, T, H * E, H * E, 1, cp, 4)
        errs = [float((y.detach() - zigzag_split(whole.detach(), cp, rank, dim=2)).abs().max())]
        errs += [float((a.grad - zigzag_split(b.grad, cp, rank, dim=2)).abs().max()) for a, b in zip(local, (q, k, v))]
        out[f"{case} error"] = max(errs)
        if spec != MaskSpec():  # the mask matters: causal attention over the whole sequence differs
            plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
            out[f"{case} differs"] = float((plain - whole).detach().abs().max())
    out.update(_local_mask_cases(rank, cp, mesh.get_group(), positions, docs, layer, gen))
    return out


def _local_mask_cases(rank: int, cp: int, group: Any, positions: torch.Tensor, docs: torch.Tensor,
                      layer: torch.nn.Module, gen: torch.Generator) -> dict[str, Any]:
    """Without the set-up check's masks, on packed documents: each algorithm given the mask the package's Llama
    builds from its local ``position_ids`` (its error against the whole sequence, host syncs, the step's flag), and
    given a local sliding window instead (the flag, and the error it raises)."""
    import torch.nn.functional as F

    from lightning_4d.context_parallel import ContextParallelAttention, MaskSpec, SequenceShard, zigzag_split
    from lightning_4d.context_parallel.local_masks import pending_flag, raise_if_differed
    from lightning_4d.core.batches import document_ids
    from lightning_4d.models.llama import packed_causal_mask
    from tests.distributed.cp_models import WINDOW

    B, T = positions.shape
    q, k, v = (torch.randn(B, 4, T, 8, generator=gen) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=MaskSpec(documents=True).allowed(
        torch.arange(T), torch.arange(T), docs, docs, positions, positions))
    local_positions = zigzag_split(positions, cp, rank, dim=1)  # (B, T/cp)
    shard = SequenceShard(group, cp, rank, T, global_docs=docs, global_positions=positions,
                          local_docs=document_ids(local_positions))
    n = T // cp
    window = MaskSpec("window", WINDOW).allowed(torch.arange(n), torch.arange(n))  # (1, 1, n, n) on local indices
    out: dict[str, Any] = {}
    for algorithm in ("allgather", "ulysses", "ring"):
        local = [zigzag_split(t, cp, rank, dim=2) for t in (q, k, v)]
        with HostSyncCounter() as syncs:
            with ContextParallelAttention(shard, lambda: "module 'layer'", algorithm=algorithm):
                y = layer(*local, attn_mask=packed_causal_mask(local_positions))
            flag = pending_flag("cpu")
        out[f"local {algorithm} error"] = float((y - zigzag_split(whole, cp, rank, dim=2)).abs().max())
        out[f"local {algorithm} host syncs"] = syncs.count
        out[f"local {algorithm} flag"] = float(flag)
        with ContextParallelAttention(shard, lambda: "module 'layer'", algorithm=algorithm):
            layer(*local, attn_mask=window)
        flag = float(pending_flag("cpu"))
        out[f"window {algorithm} flag"] = flag
        try:
            raise_if_differed(flag)
            out[f"window {algorithm} error"] = "not refused"
        except ValueError as err:
            out[f"window {algorithm} error"] = str(err)
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
    documents = SequenceShard.documents
    try:  # global positions, but the mask causal only: documents see each other across the ranks
        SequenceShard.documents = lambda self, spec: None  # type: ignore[method-assign]
        undivided = trainer.validate(lm, DataLoader([(x, y, pos)], batch_size=None), verbose=False)[0]["val_loss"]
    finally:
        SequenceShard.documents = documents  # type: ignore[method-assign]
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
REFUSED = {  # the model: what its message must say (each also says cp=1)
    "cp-hf-llama-eager": ("self_attn", "attn_implementation='sdpa'"),  # transformers' eager attention: not SDPA
    "cp-hf-gemma2-softcap": ("attn_logit_softcapping",),  # Gemma 2: SDPA has no logit soft-capping
    "nanogpt": ("transformer.wpe",),  # learned positions from torch.arange(T): the first module to differ
    # eager-only with sinks: "switch to SDPA" would not apply
    "cp-hf-gpt-oss": ("GptOssAttention", "attention sinks", "_supports_sdpa=False"),
    "cp-hf-mimo-v2-flash": ("MiMoV2FlashAttention", "attention sinks", "_supports_sdpa=False"),
    "cp-hf-deepseek-v32": ("indexer", "top-k"),  # DSA: top-k over each rank's own keys
    "cp-hf-llama4-tuned": ("self_attn", "attn_temperature_tuning=False"),  # scales from torch.arange(local T)
}


NO_SDPA = ("cp-hf-gpt-oss", "cp-hf-mimo-v2-flash", "cp-hf-deepseek-v32")


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


def _unread_window_refusal() -> str:
    """A user's model built on the meta device, over the set-up check's budget (its masks not read), whose attention
    passes a sliding window of its own (declared nowhere): refused at the first step, on every rank."""
    import torch.nn.functional as F

    from lightning_4d.context_parallel import MaskSpec, UnsplittableAttention
    from lightning_4d.models import CausalLM
    from tests.distributed.common import make_dataset
    from tests.distributed.cp_models import UserAttention, UserLM

    class WindowAttention(UserAttention):
        def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            B, T, _ = x.shape  # (B, T, D)
            q, k, v = (lin(x).view(B, T, self.n_head, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
            window = MaskSpec("window", 3).allowed(positions[0], positions[0])  # (1, 1, T, T) from its positions
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=window)  # (B, H, T, hd)
            return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    with torch.device("meta"):
        model = UserLM()
    for block in model.blocks:
        block.attn.__class__ = WindowAttention
    try:
        _trainer(dict(cp=2, reduced_check_budget=1), 2, max_steps=1).fit(
            CausalLM(model, lr=1e-3), DataLoader(make_dataset(2), batch_size=2))
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
            "packed": _packed_losses(dict(cp=2, **AG), 2), "packed ring": _packed_losses(dict(cp=2, **RING), 2),
            "padded": _padded_losses(rank),
            "refused": {k: _refusal(k) for k in REFUSED}, "unread window": _unread_window_refusal()}


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
    return {"fits": world_fit(rank, specs), "monitored": _monitored(rank)}


# Raw attention cases: each algorithm on causal, packed documents, GQA, a sliding window and chunks (each also
# with documents).
CASES = tuple(f"{a} {m}" for a in ("allgather", "ulysses", "ring")
              for m in ("causal", "documents", "gqa", "window", "window documents", "chunk", "chunk documents"))
AG, UL, RING = (dict(cp_algorithm=a) for a in ("allgather", "ulysses", "ring"))
ALGORITHMS = (AG, UL, RING)
# Per layout, every algorithm on the plain Llama (MoE under ep) and on packed documents through sliding windows.
PLAIN = {"ep": "moe"}
WINDOWED = {"ep": "cp-hf-exaone-moe"}


def _matrix(strategy: dict[str, Any], world: int, axis: str = "") -> list[dict[str, Any]]:
    return [spec for a in ALGORITHMS for spec in (
        _spec(PLAIN.get(axis, "llama"), dict(strategy, **a), world),
        _spec(WINDOWED.get(axis, "cp-hf-gemma3-window"), dict(strategy, **a), world, packed=True))]


WORLD2 = [*_matrix(dict(cp=2), 2),
          # transformers' families (windows and chunks crossed by 16 tokens; "auto" picks per model)
          *(_spec(m, dict(cp=2), 2) for m in ("cp-hf-exaone4", "cp-hf-llama4", "cp-hf-exaone-moe", "cp-hf-qwen3",
                                              "cp-hf-mistral-window", "cp-user")),
          _spec("cp-hf-llama", dict(cp=2, **AG), 2, packed=True),
          _spec("llama", dict(cp=2, activation_checkpointing="full"), 2),
          _spec("llama", dict(cp=2, activation_checkpointing="selective", **RING), 2),
          _spec("llama", dict(cp=2, **UL), 2, meta=True),
          # over the set-up check's budget: each call's local mask (the Llama's own document mask) checked per step
          _spec("llama", dict(cp=2, reduced_check_budget=1, **RING), 2, meta=True, packed=True),
          _spec("llama", dict(cp=2, **RING), 2, accumulate=2, clip=0.05),
          _spec("llama", dict(cp=2), 2, predict=True, validate=True)]
WORLD4 = [*_matrix(dict(cp=2, tp=2), 4), *_matrix(dict(cp=2, pp=2), 4), *_matrix(dict(cp=2, ep=2), 4, "ep"),
          *_matrix(dict(cp=4), 4),
          _spec("llama", dict(cp=2, pp=2, activation_checkpointing="full", **AG), 4, packed=True),
          _spec("llama", dict(cp=2, pp=2), 4, predict=True, validate=True),
          _spec("llama", dict(cp=2, dp=2, **AG), 4), _spec("llama", dict(cp=2, dp=2, data_parallel="replicate"), 4),
          _spec("llama", dict(cp=2, dp=2, data_parallel="hsdp", dp_shard=1, **RING), 4),
          _spec("cp-user", dict(cp=2, tp=2, **AG), 4), _spec("moe", dict(cp=2, ep=2, tp=2, **RING), 4),
          _spec("cp-hf-mistral-window", dict(cp=2, tp=2), 4)]


def _check_fits(specs: list[dict[str, Any]], results: list[dict[str, Any]],
                references: dict[str, dict[str, Any]]) -> None:
    for spec, got in zip(specs, merge_ranks([r["fits"] for r in results])):
        ref, label = references[_key(spec)], f"{_key(spec)} {spec['strategy']}"
        assert_parity(got, ref, RTOL, label=label)
        if spec.get("predict"):  # the outputs of the whole sequence, gathered over the cp ranks
            scale = float(ref["predictions"].abs().max())
            assert float((got["predictions"] - ref["predictions"]).abs().max()) <= RTOL * scale, label
        if spec.get("validate"):
            assert abs(got["val_loss"] - ref["val_loss"]) <= RTOL * abs(ref["val_loss"]), label


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    pytest.importorskip("transformers")
    return {_key(s): fit_spec(_reference(s)) for s in {_key(s): s for s in WORLD2 + WORLD4}.values()}


def test_context_parallel_two_ranks(references: dict[str, dict[str, Any]]) -> None:
    specs = WORLD2
    results = run_world(_world2, 2, specs, timeout_s=900, pg_timeout_s=120)
    _check_fits(specs, results, references)
    for rank_result in results:
        found = rank_result["attention"]
        for case in CASES:
            assert found[f"{case} error"] < 1e-5, (case, found[f"{case} error"])
            assert found[f"{case} bytes"] == found[f"{case} formula"] > 0, (case, found[f"{case} bytes"])
            assert found[f"{case} host syncs"] == 0, (case, found[f"{case} host syncs"])  # none on the step's path
            if not case.endswith(("causal", "gqa")):  # the mask matters (GQA's is causal)
                assert found[f"{case} differs"] > 1e-3, (case, found)
        for algorithm in ("allgather", "ulysses", "ring"):  # the model's own local mask, not read at set-up
            assert found[f"local {algorithm} error"] < 1e-5, found
            assert found[f"local {algorithm} host syncs"] == 0 and found[f"local {algorithm} flag"] == 0.0, found
            assert found[f"window {algorithm} flag"] == 1.0, found  # a local window: refused at the step's read
            assert "module 'layer'" in found[f"window {algorithm} error"], found
            assert "reduced_check_budget" in found[f"window {algorithm} error"], found
    reference = _packed_reference()
    from tests.distributed.test_batches import _lm

    with torch.no_grad():
        padded = _lm("llama").fourd_loss(_padded_batch()).item()
    for rank_result in results:
        _check_packed(rank_result["packed"], reference, "cp=2 allgather")
        _check_packed(rank_result["packed ring"], reference, "cp=2 ring")
        for name, got in rank_result["padded"].items():  # a rank without valid targets adds nothing (not NaN)
            assert abs(got - padded) <= RTOL * abs(padded), (name, got, padded)
        message = rank_result["unread window"]  # on every rank, naming the call, the rule and the fixes
        assert "call 1 of the forward" in message and "sliding window" in message, message
        assert "reduced_check_budget" in message and "cp=1" in message, message
        for kind, needles in REFUSED.items():
            message = rank_result["refused"][kind]
            assert all(n in message for n in needles) and "cp=1" in message, (kind, message)
            if kind in NO_SDPA:  # no SDPA attention exists for them: not a fix
                assert "attn_implementation='sdpa'" not in message, (kind, message)


def test_context_parallel_four_ranks(references: dict[str, dict[str, Any]]) -> None:
    specs = WORLD4
    results = run_world(_world4, 4, specs, timeout_s=900, pg_timeout_s=120)
    _check_fits(specs, results, references)
    # The monitor names the cp axis (the formula's bytes: 4 sequences of 16 tokens per rank, 2 layers, the Llama's
    # K/V repeated to its 8 heads of 4 features, fp32; "auto" picks Ulysses: 8 heads divide by cp=2, all-to-all
    # only) and dp_cp (FSDP2 over dp × cp).
    metrics = results[0]["monitored"]
    from lightning_4d.context_parallel.cost import ulysses_wire_bytes

    assert metrics["comm/cp/all_to_all_bytes"] == ulysses_wire_bytes(4, 16, 32, 32, layers=2, cp=2, act_bytes=4)
    assert "comm/cp/all_gather_bytes" not in metrics, metrics
    assert metrics["comm/dp_cp/reduce_scatter_bytes"] > 0, metrics
