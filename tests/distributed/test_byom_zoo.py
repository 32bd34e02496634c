"""Bring your own model, more families: tensor (and pipeline, expert) parallelism with no user code.

Families (:mod:`tests.distributed.byom_zoo`, weights perturbed as a checkpoint's would be): StableLM (per-head norm
list), Gemma 2 / 3 (norms on the attention and MLP outputs), Phi-3 (fused ``qkv_proj`` sliced with sizes from
``config``, ``gate_up_proj`` chunked), OLMo 2 / OLMoE (q/k norms over every head), GPT-OSS (attention sinks),
GPT-BigCode and Falcon multi-query (one KV head in a fused projection), Falcon's new decoder (in-place residual add
on a projection's output), a one-KV-head Llama, Llama 4 text MoE (its forward reads the embedding's weight on every
pipeline stage), OPT (linears held by the decoder layer), Bloom and MPT (ALiBi biases cut with the heads),
Qwen3-Next (linear attention: a fused projection viewed per key-head group, q | k | v concatenated before a
depthwise convolution), LongCat-Flash (zero experts: a router over more experts than the experts module holds, the
identities computed by the layer; norms and sublayers kept in lists), Kimi-Linear (KDA linear attention: three
projections concatenated into one depthwise convolution, a per-feature ``dt_bias``, a ``(1, 1, heads, 1)``
``A_log``, low-rank gates; latent attention; MoE), the state-space and hybrid families (Mamba-2 with one and two
B/C groups, Granite 4.0-H dense and MoE, Falcon-H1, Nemotron-H, LFM2's short convolutions, Zamba2's shared block
with per-use adapters, Mamba-1), Gemma 4 (layer types, rotary tables, head widths and per-layer inputs picked by
layer index; per-layer input embeddings computed before the blocks), DeepSeek-V3.2 (a sparse-attention indexer of
its own heads, no gradient) and the ``torchtitan`` package's Llama 3 and Qwen3 MoE.
Each family runs under tp=2 with and without sequence parallelism and tp=2 × pp=2, each MoE family under ep=2 (and
tp=2 × ep=2), or is refused at set-up (:data:`REFUSED`).

Every family × layout must match the single-process reference: per-step global losses and the final raw
gradients within 1e-5 relative (fp32, lr=1e-4 as in test_byom), each gradient relative to its own norm or, for a
gradient that is zero in exact arithmetic (OPT's key bias: a softmax does not see it), to 1e-4 of the largest
gradient norm (its rounding noise is an absolute ~1e-11 here; a real gradient that small is held to 1e-9 of the
largest). TorchTitan's grouped experts compute in bf16 by design, so every gradient of that model carries
bf16 rounding noise: it is held to 10× its noise floor, measured in the same world as the error of plain data
parallelism (which changes only how the batch is split, not the math); so is Gemma 4, whose fp32 rounding from a
batch split alone is near 1e-5 (:data:`FLOOR_MODELS`). ``fit_spec`` also checks under tp>1 that every parameter the TP ranks hold whole is identical on each.

Layouts run many families in one world (a world costs seconds to start; an expected set-up refusal does not end it);
the worst relative error per family × layout is printed at the end of the module (the table
of ``docs/zoo.md``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from lightning_4d.testing import run_world
from tests.distributed.common import References, fit_spec, merge_ranks

os.environ.setdefault("OMP_NUM_THREADS", "1")

BASE: dict[str, Any] = dict(steps=3, global_batch=8, lr=1e-4)
PG_TIMEOUT_S = 120  # CI runs 4 ranks on 2 loaded cores: a gloo wait past this aborts the rank (SIGABRT)
TOL = 1e-5

# name -> (world, strategy kwargs, layers)
LAYOUTS: dict[str, tuple[int, dict[str, Any], int]] = {
    "tp2": (2, dict(tp=2), 2),
    "tp2-nosp": (2, dict(tp=2, sequence_parallel=False), 2),
    "dp2": (2, dict(), 2),
    "pp2": (2, dict(pp=2), 4),
    "dp2-4": (2, dict(), 4),  # the noise floor of a 4-layer model in a 2-rank world (FLOOR_MODELS)
    "dp4": (4, dict(), 4),
    "ep2": (2, dict(ep=2), 2),
    "tp2-ep2": (2, dict(tp=2, ep=2), 2),
    "tp2-pp2": (4, dict(tp=2, pp=2), 4),
    "tp2-pp2-nosp": (4, dict(tp=2, pp=2, sequence_parallel=False), 4),
    "tp2-dp2": (4, dict(tp=2, data_parallel="fsdp"), 2),
    "tp4": (4, dict(tp=4), 2),
}

_HF0 = "model.model.model.layers.0"
_MAMBA0 = "model.model.backbone.layers.0.mixer"
_ZAMBA_SHARED = f"{_HF0}.shared_transformer"  # used by every hybrid layer (its weights tied: listed under layer 0)
_LLAMA_LIKE = [f"{_HF0}.self_attn.q_proj.weight", f"{_HF0}.self_attn.o_proj.weight", f"{_HF0}.mlp.down_proj.weight"]
# Under tp>1 these parameters (LightningModule names) must be DTensors sharded on tp: a layout that silently
# replicated the projections would train correctly but be no tensor parallelism.
SHARDED: dict[str, list[str]] = {
    "hf-stablelm": _LLAMA_LIKE, "hf-gemma2": _LLAMA_LIKE, "hf-gemma3": _LLAMA_LIKE, "hf-olmo2": _LLAMA_LIKE,
    "hf-mq": _LLAMA_LIKE,
    "hf-phi3": [f"{_HF0}.self_attn.qkv_proj.weight", f"{_HF0}.mlp.gate_up_proj.weight", f"{_HF0}.mlp.down_proj.weight"],
    "hf-olmoe": [f"{_HF0}.self_attn.q_proj.weight", f"{_HF0}.self_attn.q_norm.weight"],
    "hf-gptoss": [f"{_HF0}.self_attn.q_proj.weight", f"{_HF0}.self_attn.o_proj.weight"],
    "hf-llama4": [f"{_HF0}.self_attn.q_proj.weight", f"{_HF0}.self_attn.o_proj.weight"],
    "hf-bigcode": [f"model.model.transformer.h.0.{n}.weight" for n in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")],
    "hf-falcon-mq": [f"model.model.transformer.h.0.{n}.weight" for n in ("self_attention.dense", "mlp.dense_h_to_4h")],
    "hf-falcon": [f"model.model.transformer.h.0.{n}.weight" for n in ("self_attention.query_key_value",
                                                                      "self_attention.dense", "mlp.dense_4h_to_h")],
    "hf-opt": [f"model.model.model.decoder.layers.0.{n}.weight" for n in ("self_attn.q_proj", "fc1", "fc2")],
    "tt-llama3": [f"model.model.layers.0.{n}.weight" for n in ("attention.qkv_linear.wqkv", "attention.wo",
                                                               "feed_forward.w2")],
    "tt-qwen3moe": [f"model.model.layers.0.{n}.weight" for n in ("attention.qkv_linear.wqkv", "attention.wo")],
    "hf-bloom": [f"model.model.transformer.h.0.{n}.weight" for n in ("self_attention.query_key_value",
                                                                     "self_attention.dense", "mlp.dense_4h_to_h")],
    "hf-mpt": [f"model.model.transformer.blocks.0.{n}.weight" for n in ("attn.Wqkv", "attn.out_proj", "ffn.up_proj")],
    "hf-xglm": [f"{_HF0}.{n}.weight" for n in ("self_attn.k_proj", "self_attn.out_proj", "fc1", "fc2")],
    "hf-gptneo": [f"model.model.transformer.h.0.{n}.weight" for n in ("attn.attention.k_proj",
                                                                      "attn.attention.out_proj", "mlp.c_fc")],
    "hf-codegen": [f"model.model.transformer.h.0.{n}.weight" for n in ("attn.qkv_proj", "attn.out_proj",
                                                                       "mlp.fc_in")],
    "hf-cohere": _LLAMA_LIKE, "hf-apertus": _LLAMA_LIKE,
    "hf-dbrx": [f"model.model.transformer.blocks.0.norm_attn_norm.attn.{n}.weight" for n in ("Wqkv", "out_proj")],
    # Mamba-2 with one B/C group: the gated norm over the inner width runs distributed (its weight sharded); with
    # two groups (tp=2) the fused in_proj is sharded piece by piece.
    "hf-mamba2": [f"{_MAMBA0}.{n}" for n in ("out_proj.weight", "norm.weight")],
    "hf-mamba2grp": [f"{_MAMBA0}.{n}.weight" for n in ("in_proj", "out_proj")],
    "hf-granite4h": [f"{_HF0}.mamba.out_proj.weight", f"{_HF0}.mamba.norm.weight",
                     "model.model.model.layers.1.self_attn.q_proj.weight", f"{_HF0}.shared_mlp.output_linear.weight"],
    "hf-falconh1": [f"{_HF0}.mamba.out_proj.weight", f"{_HF0}.mamba.norm.weight", f"{_HF0}.self_attn.q_proj.weight"],
    "hf-nemotronh": [f"{_HF0}.mixer.out_proj.weight", f"{_HF0}.mixer.norm.weight",
                     "model.model.model.layers.1.mixer.q_proj.weight"],
    # Zamba2: the shared block's projections and the up-projections of its per-use adapters (added to q/k/v and to
    # the fused gate|up: sharded, and permuted, like them); one use per block, every adapter trained
    "hf-zamba2": [f"{_ZAMBA_SHARED}.{n}.weight" for n in ("self_attn.q_proj", "self_attn.o_proj",
                                                           "self_attn.linear_q_adapter_list.1.1",
                                                           "feed_forward.gate_up_proj",
                                                           "feed_forward.gate_up_proj_adapter_list.0.1",
                                                           "feed_forward.down_proj")]
    + [f"{_HF0}.mamba_decoder.mamba.out_proj.weight"],
    "hf-qwen3next": [f"{_HF0}.linear_attn.{n}.weight" for n in ("in_proj_qkvz", "in_proj_ba", "out_proj")]
    + ["model.model.model.layers.1.self_attn.q_proj.weight"],
    # LongCat-Flash: its two attention and MLP sublayers kept in lists (MLA: the LoRA up-projections sharded)
    "hf-longcat": [f"{_HF0}.self_attn.0.q_b_proj.weight", f"{_HF0}.self_attn.1.o_proj.weight",
                   f"{_HF0}.mlps.1.down_proj.weight"],
    # Kimi-Linear: q | k | v from three projections concatenated into one depthwise conv; the forget gate's low-rank
    # up-projection (viewed per head) sharded with the heads; latent attention's kv_b_proj in the next layer
    "hf-kimilinear": [f"{_HF0}.self_attn.{n}.weight" for n in ("q_proj", "v_proj", "forget_gate.f_b_proj", "b_proj",
                                                              "g_b_proj", "o_proj")]
    + [f"model.model.model.layers.1.self_attn.{n}.weight" for n in ("q_proj", "kv_b_proj", "o_proj")],
    "hf-lfm2": [f"{_HF0}.conv.in_proj.weight", f"{_HF0}.conv.out_proj.weight",
                "model.model.model.layers.1.self_attn.q_proj.weight", f"{_HF0}.feed_forward.w2.weight"],
    # Gemma 4: the global layer's wider heads (keys are values there: no v_proj); with per-layer inputs the gate is
    # column-parallel (the per-layer input cut with it) and the projection back row-parallel
    "hf-gemma4": _LLAMA_LIKE + ["model.model.model.layers.1.self_attn.k_proj.weight"],
    "hf-gemma4ple": _LLAMA_LIKE + [f"{_HF0}.{n}.weight" for n in ("per_layer_input_gate", "per_layer_projection")],
    "hf-gemma4moe": _LLAMA_LIKE, "hf-gemma4kv": _LLAMA_LIKE + ["model.model.model.layers.1.self_attn.q_proj.weight"],
    # DeepSeek-V3.2: latent attention's up-projections sharded, the sparse-attention indexer whole (REPLICATED)
    "hf-dsv32": [f"{_HF0}.self_attn.{n}.weight" for n in ("q_b_proj", "kv_b_proj", "o_proj")],
}
SHARDED["hf-zamba2first"] = SHARDED["hf-zamba2"]
# Parameters a layout must leave whole and replicated (the projections computing KV heads fewer than tp): by family,
# then by (family, layout) where it depends on tp.
REPLICATED: dict[Any, list[str]] = {
    "hf-mq": [f"{_HF0}.self_attn.k_proj.weight", f"{_HF0}.self_attn.v_proj.weight"],
    "hf-bigcode": ["model.model.transformer.h.0.attn.c_attn.weight"],
    "hf-falcon-mq": ["model.model.transformer.h.0.self_attention.query_key_value.weight"],
    ("hf-phi3", "tp4"): [f"{_HF0}.self_attn.qkv_proj.weight"],  # q | k | v fused, 2 KV heads for 4 ranks
    ("hf-stablelm", "tp4"): [f"{_HF0}.self_attn.k_proj.weight"],
    # one B/C group for 2 ranks: z | x | B | C | dt read whole, each rank computing its heads' rows and the group
    "hf-mamba2": [f"{_MAMBA0}.in_proj.weight"], "hf-granite4h": [f"{_HF0}.mamba.in_proj.weight"],
    "hf-falconh1": [f"{_HF0}.mamba.in_proj.weight"], "hf-nemotronh": [f"{_HF0}.mixer.in_proj.weight"],
    # the adapters' down-projections (low rank, read whole) and the linear after the shared block (nothing sharded
    # reaches it)
    "hf-zamba2": [f"{_HF0}.mamba_decoder.mamba.in_proj.weight", f"{_HF0}.linear.weight",
                  f"{_ZAMBA_SHARED}.self_attn.linear_q_adapter_list.1.0.weight",
                  f"{_ZAMBA_SHARED}.feed_forward.gate_up_proj_adapter_list.0.0.weight"],
}
REPLICATED["hf-zamba2first"] = REPLICATED["hf-zamba2"]
# the indexer returns top-k key positions (no gradient): each rank computes them whole from the gathered input
# Gemma 4's router and (at ep=1) its experts: whole on every tp rank, fed the block's own tokens
REPLICATED["hf-gemma4moe"] = [f"{_HF0}.router.proj.weight", f"{_HF0}.experts.gate_up_proj"]
REPLICATED["hf-dsv32"] = [f"{_HF0}.self_attn.indexer.{n}.weight" for n in ("wq_b", "wk", "weights_proj")]
# Models that compute part of their forward in bf16 by design (TorchTitan's grouped experts): every gradient
# downstream of that rounding is held to 10x the noise floor of plain data parallelism, measured in the same world.
BF16_MODELS = ("tt-qwen3moe",)
# Models whose fp32 gradients carry rounding near the 1e-5 tolerance from a mere split of the batch (Gemma 4:
# unscaled attention logits of normalised queries and keys; one process with the batch in two micro-batches differs
# from it whole by up to 9e-6 after 3 AdamW steps): held like BF16_MODELS, to 10x the floor plain data parallelism
# measures in the same world on the same depth (dp2: 2 layers, dp2-4 / dp4: 4 layers), which must come first.
FLOOR_MODELS = BF16_MODELS + ("hf-gemma4", "hf-gemma4ple", "hf-gemma4moe", "hf-gemma4kv")
# Expected refusals at set-up: (family, layout) -> what the error must name (the cause and the fix are checked by
# tests/unit/test_tp_heads_plan.py and test_mixer_plan.py): tp=4 with 2 KV groups interleaved in TorchTitan's
# fused wqkv.
REFUSED: dict[tuple[str, str], str] = {
    ("tt-llama3", "tp4"): "attention.qkv_linear.wqkv: its features 0:64 form 2 interleaved groups",
    # DBRX keeps its two norms inside one module with the attention: sequence parallelism cannot reach them.
    ("hf-dbrx", "tp2"): "norm_attn_norm.norm_1 holds parameters (weight) outside the attention/MLP regions",
    ("hf-jetmoe", "ep2"): "running its forward on a subset of its experts failed",
    # two B/C groups for four ranks: the gated norm's groups would straddle ranks
    ("hf-mamba2grp", "tp4"): "mixer.norm normalises the mixer's inner width (64 features) in 2 groups of 32",
    # Zamba2 under SP: the norms of its hybrid layers sit one level down (shared_transformer.*, mamba_decoder.*), and
    # the shared block concatenates the embeddings (a second full-sequence input) to the hidden state
    ("hf-zamba2", "tp2"): "mamba_decoder.input_layernorm holds parameters (weight) outside the attention/MLP",
    # its shared block is used by blocks 0 and 2, which pp=2 puts on two stages (rule: one stage for all its uses)
    ("hf-zamba2", "pp2"): "layers.2.shared_transformer is a module reused at several depths",
    ("hf-zamba2", "tp2-pp2"): "layers.2.shared_transformer is a module reused at several depths",
    # Mamba-1's x_proj reads the sharded inner width and feeds dt_proj: a reduction inside the mixer
    ("hf-mamba1", "tp2"): "mixer.dt_proj is a linear layer whose role is unknown",
    # Gemma 4's MoE layers hold their experts and router beside attention and MLP: not under SP yet (without: held)
    ("hf-gemma4moe", "tp2"): "holds its experts and router itself",
    ("hf-gemma4moe", "tp2-ep2"): "holds its experts and router itself",
    # Gemma 4's KV-shared layers read the K and V an earlier layer stored, here on the other stage
    ("hf-gemma4kv", "pp2"): "share state through their argument(s) 'shared_kv_states'",
}

ERRORS: dict[str, str] = {}  # "family layout" -> worst relative error, or the refusal


def _kind(family: str, layers: int) -> str:
    return family if layers == 2 else f"{family}-{layers}"


def _spec(family: str, layout: str) -> dict[str, Any]:
    world, strategy, layers = LAYOUTS[layout]
    spec = dict(BASE, model=_kind(family, layers), world=world, strategy=dict(strategy, timeout_s=PG_TIMEOUT_S),
                label=f"{family} {layout}", placements=True, refusal=(family, layout) in REFUSED)
    if strategy.get("tp", 1) > 1:
        spec["check_sharded"] = sorted(set(SHARDED.get(family, [])) | set(_replicated(family, layout)))
    return spec


def _replicated(family: str, layout: str) -> list[str]:
    return REPLICATED.get(family, []) + REPLICATED.get((family, layout), [])


def _zoo_world(rank: int, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker: every spec in turn; a failing spec is reported (the same error on every rank: set-up refusals are
    decided before any collective). An unexpected failure ends the world's run, the rest marked not run; an expected
    set-up refusal (``refusal``) does not, as no rank has started a collective of it."""
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    import warnings

    warnings.filterwarnings("ignore")
    out: list[dict[str, Any]] = []
    stopped = False
    for spec in specs:
        if stopped:
            out.append({"error": "not run (an earlier family failed in this world)"})
            continue
        try:
            out.append(fit_spec({k: v for k, v in spec.items() if k not in ("label", "refusal")}))
        except Exception as err:  # noqa: BLE001 - reported per family
            out.append({"error": f"{type(err).__name__}: {err}"})
            stopped = not spec["refusal"]
    return out


@pytest.fixture(scope="module")
def references() -> References:
    pytest.importorskip("transformers")
    return References(BASE)


@pytest.fixture(scope="module", autouse=True)
def _report() -> Any:
    start = time.monotonic()
    yield
    if ERRORS:
        width = max(len(k) for k in ERRORS)
        lines = [f"  {k:<{width}}  {v}" for k, v in sorted(ERRORS.items())]
        print(f"\nfamily × layout ({time.monotonic() - start:.0f} s):\n" + "\n".join(lines))


def _errors(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Relative error of every loss and gradient (see the module docstring for the floor)."""
    errs = {f"loss {i}": abs(a - b) / max(abs(b), 1e-12) for i, (a, b) in enumerate(zip(got["losses"], ref["losses"]))}
    if len(got["losses"]) != len(ref["losses"]):
        errs["losses"] = float("inf")
    floor = 1e-4 * max(float(g.norm()) for g in ref["grads"].values())
    for name, g in ref["grads"].items():
        if name not in got["grads"]:
            errs[name] = float("inf")
            continue
        errs[name] = float((got["grads"][name].float() - g.float()).norm()) / max(float(g.norm()), floor)
    return errs


def _check(family: str, layout: str, got: dict[str, Any], ref: dict[str, Any], floor: float = 0.0) -> list[str]:
    """Problems with one family × layout (empty: parity, sharding and replication as required, or the expected
    refusal)."""
    label = f"{family} {layout}"
    expected = REFUSED.get((family, layout))
    if expected is not None:
        ERRORS[label] = "refused: " + got.get("error", "NOT REFUSED")[:120]
        if expected in got.get("error", ""):
            return []
        return [f"{label}: expected a refusal naming {expected!r}, got {got.get('error', 'a run')}"]
    if "error" in got:
        ERRORS[label] = "ERROR " + got["error"][:200]
        return [f"{label}: {got['error']}"]
    errs = _errors(got, ref)
    tol = max(TOL, 10 * floor)
    bad = [f"{label}: {name} relative error {err:.2e} > {tol:.1e}" for name, err in errs.items() if err > tol]
    ERRORS[label] = f"{max(errs.values()):.1e}" + (f" (tol {tol:.0e})" if tol > TOL else "")
    for name, sharded in got.get("sharded", {}).items():
        want = name not in _replicated(family, layout)
        if sharded is not want:
            bad.append(f"{label}: {name} should be {'sharded on tp' if want else 'whole'} (sharded={sharded})")
    if "ep" in layout:
        experts = [n for n, (mesh, _) in got.get("placements", {}).items() if "experts" in n and "ep" in mesh]
        if not experts:
            bad.append(f"{label}: no expert parameter is sharded over an ep mesh")
    return bad


def _run(cases: list[tuple[str, str]], references: References) -> list[str]:
    """Run every (family, layout) of one world size in one world; the problems found (see :func:`_check`).
    A FLOOR_MODELS model's floor comes from its plain data-parallel case of the same depth (``dp2``, ``dp2-4``,
    ``dp4``), which must come first."""
    specs = [_spec(f, lay) for f, lay in cases]
    # single-process references, before the world starts (none for an expected refusal)
    refs = [{} if s["refusal"] else references[s["model"]] for s in specs]
    results = merge_ranks(run_world(_zoo_world, specs[0]["world"], specs, timeout_s=900, pg_timeout_s=PG_TIMEOUT_S))
    floors: dict[tuple[str, int], float] = {}  # (family, layers) -> noise floor
    problems: list[str] = []
    for (family, layout), got, ref in zip(cases, results, refs):
        depth = LAYOUTS[layout][2]
        if family in FLOOR_MODELS and layout.startswith("dp") and "error" not in got:
            floors[(family, depth)] = max(_errors(got, ref).values())
            ERRORS[f"{family} {layout} (noise floor)"] = f"{floors[(family, depth)]:.1e}"
            continue
        problems += _check(family, layout, got, ref, floors.get((family, depth), 0.0))
    return problems


# ----------------------------------------------------------------------------------------------- parity
def test_per_head_norm_list_shards_with_its_heads(references: References) -> None:
    # Regression: StableLM keeps one LayerNorm per head in a ModuleList applied with zip(norms, heads). After the
    # tensor-parallel rewrite each rank holds half of the heads; zipped with the whole list, rank 1 normalised its
    # heads 2-3 with norms 0-1: silently wrong with identical initial norms (1.4e-4 after 6 steps), refused with
    # per-head weights that differ (these are perturbed). Now each rank sees its own heads' norms.
    problems = _run([("hf-stablelm", "tp2"), ("hf-stablelm", "tp2-nosp")], references)
    assert not problems, "\n".join(problems)


# Every family under tp=2 with and without SP and tp=2 x pp=2; TorchTitan's Qwen3 MoE (bf16 experts) in the expert
# world, after its noise floor.
DENSE_TP = ["hf-gemma2", "hf-gemma3", "hf-phi3", "hf-olmo2", "hf-gptoss", "hf-bigcode", "hf-falcon-mq", "hf-falcon",
            "hf-opt", "hf-mq", "hf-llama4", "hf-olmoe", "hf-bloom", "hf-mpt", "hf-xglm", "hf-gptneo", "hf-codegen",
            "hf-cohere", "hf-apertus", "hf-mamba2", "hf-mamba2grp", "hf-granite4h", "hf-lfm2",
            "hf-falconh1", "hf-nemotronh", "hf-qwen3next", "hf-kimilinear", "tt-llama3"]
# DBRX: without sequence parallelism (with it: refused, see REFUSED); its fused Wqkv is clamped before the split.
NO_SP = ["hf-dbrx", "hf-zamba2"]  # Zamba2: a shared block reused by every hybrid layer, per-use adapters
EP = [("tt-qwen3moe", "dp2"), ("tt-qwen3moe", "ep2"), ("tt-qwen3moe", "tp2-ep2"), ("tt-qwen3moe", "tp2"),
      ("tt-qwen3moe", "tp2-nosp"), ("hf-olmoe", "ep2"), ("hf-olmoe", "tp2-ep2"), ("hf-gptoss", "ep2"),
      ("hf-gptoss", "tp2-ep2"), ("hf-llama4", "ep2"), ("hf-llama4", "tp2-ep2"), ("hf-qwen3next", "ep2"),
      ("hf-granite4hmoe", "ep2"), ("hf-granite4hmoe", "tp2-ep2"), ("hf-qwen3next", "tp2-ep2"),
      # LongCat-Flash: a router over 4 experts and 2 zero (identity) experts the layer computes itself; its norms,
      # attention and MLP sublayers kept in lists (sequence parallelism reaches the norms in them)
      ("hf-longcat", "ep2"), ("hf-longcat", "tp2-ep2"),
      ("hf-kimilinear", "ep2"), ("hf-kimilinear", "tp2-ep2")]
# Pipeline alone where tensor parallelism is not the point: Llama 4 reads its embedding's weight on every stage
# (a shape-only stand-in on later ones); Qwen3-Next and the hybrids (blocks of different structures as stages,
# Nemotron-H's loop reading each block's block_type); JetMoE, whose experts
# cannot be split over ep (its refusal below) but need not be at ep=1 (it was refused under pp alone).
PP = ["hf-llama4", "hf-qwen3next", "hf-jetmoe", "hf-mamba2", "hf-granite4h", "hf-lfm2", "hf-falconh1", "hf-nemotronh",
      "hf-kimilinear", "hf-mamba1", "hf-zamba2first"]
# Zamba2 with its hybrid layers (every use of the shared block) on the first of two stages: kept there whole, under
# tp without SP too (hf-zamba2, its uses on two stages, is refused: REFUSED)
PP_TP_NOSP = ["hf-zamba2first"]
PP_TP = ["hf-stablelm"] + DENSE_TP + ["tt-qwen3moe"]
# tp=4 with 2 KV heads (StableLM: its per-KV-head norm list too; Phi-3: replicated KV pieces of a fused projection)
# and 1 KV head (hf-mq): each rank computes the KV head its query heads use; GPT-OSS: sinks over 4 ranks.
TP4 = ["hf-mq", "hf-stablelm", "hf-phi3", "hf-gptoss", "hf-mamba2"]
FSDP = ["hf-stablelm", "hf-gptoss", "hf-mamba2"]


def _titan_importable() -> bool:
    try:
        import torchtitan.models.llama3  # noqa: F401 - it imports triton too
    except ImportError:
        return False
    return True


def _available(cases: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The cases whose packages import here (the ``torchtitan`` rows need the ``test`` extra)."""
    titan = _titan_importable()
    return [(f, lay) for f, lay in cases if titan or not f.startswith("tt-")]


def _refusals(world: int) -> list[tuple[str, str]]:
    return [case for case in REFUSED if LAYOUTS[case[1]][0] == world]


def test_tensor_parallel_with_and_without_sequence_parallelism(references: References) -> None:
    # tp=2 for every family, with sequence parallelism (norms on region outputs, linears held by the block, in-place
    # residual adds, experts that see sequence shards, ALiBi biases cut with the heads) and without it.
    cases = [(f, "tp2") for f in DENSE_TP] + [(f, "tp2-nosp") for f in DENSE_TP + NO_SP]
    problems = _run(_available(cases), references)
    assert not problems, "\n".join(problems)


# Layers configured by position (Gemma 4: each layer's type, rotary table, head width and per-layer input picked by
# its index), with and without per-layer input embeddings (computed before the blocks, carried to later pipeline
# stages, cut with the column-parallel gate under tp), with experts held by the layer itself and with K and V
# shared across layers (under tp; refused under pp: REFUSED), and DeepSeek-V3.2's sparse-attention indexer under
# tp; the Gemma 4 floors first (FLOOR_MODELS).
BY_POSITION = ([(f, lay) for f in ("hf-gemma4", "hf-gemma4ple", "hf-gemma4moe") for lay in ("dp2", "dp2-4")]
               + [("hf-gemma4kv", "dp2")]
               + [("hf-gemma4", "tp2"), ("hf-gemma4", "pp2"), ("hf-gemma4ple", "tp2"), ("hf-gemma4ple", "tp2-nosp"),
                  ("hf-gemma4ple", "pp2"), ("hf-gemma4moe", "tp2-nosp"), ("hf-gemma4moe", "ep2"),
                  ("hf-gemma4moe", "pp2"), ("hf-gemma4kv", "tp2"), ("hf-dsv32", "tp2"), ("hf-dsv32", "tp2-ep2")])
BY_POSITION_4 = [("hf-gemma4ple", "dp4"), ("hf-gemma4ple", "tp2-pp2")]


def test_expert_and_pipeline_layouts_and_refusals(references: References) -> None:
    # Expert parallelism for every MoE family (with tp where it applies), pipeline parallelism alone, and the
    # families refused at set-up: each refusal names the module, and the world goes on after it.
    cases = EP + [(f, "pp2") for f in PP] + BY_POSITION + _refusals(2)
    problems = _run(_available(cases), references)
    assert not problems, "\n".join(problems)


def test_four_rank_layouts(references: References) -> None:
    # tp=2 x pp=2 for every family (TorchTitan's Qwen3 MoE after its noise floor over 4 ranks); FSDP2 over dp swaps
    # the parameters a per-head list or a per-head parameter is read from: tp2-dp2 checks that each rank still uses
    # (and gives zero gradients to) the right ones.
    cases = ([("tt-qwen3moe", "dp4")] + BY_POSITION_4 + [(f, "tp2-pp2") for f in PP_TP]
             + [(f, "tp2-pp2-nosp") for f in PP_TP_NOSP]
             + [(f, "tp4") for f in TP4]
             + [(f, "tp2-dp2") for f in FSDP] + _refusals(4))
    problems = _run(_available(cases), references)
    assert not problems, "\n".join(problems)
