"""GPU smoke run of lightning_4d: one command, one H100 or H200, at most 8 minutes; one JSON of every figure.

    python bench/gpu_smoke.py                          # on the GPU: writes gpu_smoke.json
    python bench/gpu_smoke.py --dry-run --out d.json   # the same code on CPU at tiny sizes (gloo), under a minute
    python bench/gpu_smoke.py --only tp2-bf16-save     # some cases (comma-separated names)

Cases (``CASES``, a list: append one to extend it; ``docs/gpu_smoke.md`` says what each checks):

- ``one-rank-llama-1b``: the package's Llama at about 1.1 B parameters, built on the meta device, ``bf16-mixed``, one
  rank: set-up seconds, step seconds against a plain PyTorch loop of the same module and optimizer on the same
  device, peak memory against the planner's estimate, host syncs per step (``torch.cuda.set_sync_debug_mode``) and
  MFU for both.
- 2-process worlds sharing the one GPU (``process_group_backend="cuda:gloo"``: gloo on CUDA tensors refuses host
  tensors as NCCL does, and NCCL refuses two ranks on one GPU): a model built for real at dp=2 and at cp=2, tp=2 in
  bf16 with a checkpoint save, ep=2 in bf16, pp=2; each against one process on the same device (losses, and for
  16-bit runs within :func:`lightning_4d.core.precision.parity_tolerance`).

A case that raises is recorded as failed with its error and the run goes on; the exit code is 1 when any case failed.
Needs only the repository, torch >= 2.11 and Lightning 2.6 (no Hydra, nothing to install).
"""

from __future__ import annotations

import argparse
import importlib.util
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

# This repository's package, wherever the script runs from, in this process and in the worlds' ranks.
REPO = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.core.precision import parity_tolerance, precision_info  # noqa: E402
from lightning_4d.materialize.local_shards import materialize  # noqa: E402
from lightning_4d.mesh import ParallelDims  # noqa: E402
from lightning_4d.models import CausalLM, Llama, LlamaConfig  # noqa: E402
from lightning_4d.models.moe import MoEConfig, MoETransformer  # noqa: E402
from lightning_4d.planner import CPU, TrainSpec, TransformerSpec, device_by_name, memory_per_rank  # noqa: E402
from lightning_4d.testing import run_world  # noqa: E402

BUDGET_S = 480.0  # the whole run on one GPU: 8 minutes


# ---------------------------------------------------------------------------------------------- sizes and context
@dataclass(frozen=True)
class Sizes:
    """The scale of a run: the one-rank model and batch, and the worlds' small model and batch."""

    llama: LlamaConfig  # one rank
    seq: int
    batch: int
    warmup: int  # steps before the timed window
    steps: int  # timed steps
    world_llama: LlamaConfig  # the worlds' dense model
    world_moe: MoEConfig
    world_batch: int  # global batch (the same sequences every step, so every layout sees the same set)
    world_steps: int


#: About 1.1 B parameters (TinyLlama's shape): 22 blocks of width 2048, GQA 32/4 heads, SwiGLU 5632, 32k vocabulary.
GPU_SIZES = Sizes(
    llama=LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
                      max_seq_len=2048),
    seq=2048, batch=4, warmup=3, steps=10,
    world_llama=LlamaConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=512,
                            max_seq_len=256),
    world_moe=MoEConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256,
                        num_experts=8, top_k=2, expert_hidden=256, shared_experts=1),
    world_batch=8, world_steps=3,
)
DRY_SIZES = Sizes(
    llama=LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32),
    seq=32, batch=2, warmup=1, steps=2,
    world_llama=LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=64,
                            max_seq_len=16),
    world_moe=MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, max_seq_len=16, num_experts=4,
                        top_k=2, expert_hidden=32, shared_experts=1),
    world_batch=8, world_steps=2,
)


@dataclass(frozen=True)
class Context:
    """Where and how big: picklable, handed to the worlds' ranks."""

    device: str  # "cuda:0" or "cpu"
    backend: str  # the worlds' process-group backend: "cuda:gloo" (GPU) or "cpu:gloo" (dry run)
    sizes: Sizes
    work_dir: str  # checkpoints
    deadline: float  # time.monotonic() after which cases are skipped

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def _sync(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.torch_device)


@contextmanager
def host_syncs(ctx: Context) -> Iterator[list[int]]:
    """Count the host syncs of the block (``torch.cuda.set_sync_debug_mode("warn")``: one warning each); on CPU the
    count stays empty (the mode is CUDA's)."""
    found: list[int] = []
    if not ctx.cuda:
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.append(sum("synchronizing" in str(w.message) for w in caught))


#: CUDA device-name fragments -> the planner's device (the first match wins).
_PLANNER_DEVICES = (("H200", "H200"), ("H800", "H800"), ("H100 PCIe", "H100-PCIe"), ("H100 NVL", "H100-NVL"),
                    ("H100", "H100-SXM"), ("A100-SXM4-40GB", "A100-40GB"), ("A100", "A100-80GB"))


def planner_device(cuda_name: str) -> Any:
    """The planner's device for a CUDA device name (``None``: one it does not know)."""
    return next((device_by_name(known) for fragment, known in _PLANNER_DEVICES if fragment in cuda_name), None)


def _device_spec(ctx: Context) -> Any:
    """The planner's device for the peak FLOP/s and allocator figures (``None``: a GPU it does not know)."""
    return planner_device(torch.cuda.get_device_name(ctx.torch_device)) if ctx.cuda else CPU


def _tokens(n: int, seq: int, vocab: int, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=gen)
    return TensorDataset(tokens[:, :-1].clone(), tokens[:, 1:].clone())


def _trainer(ctx: Context, strategy: Any, precision: str, steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(accelerator="cuda" if ctx.cuda else "cpu", devices=1, strategy=strategy, precision=precision,
                     max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)


class _Losses(L.Callback):
    """Every step's global loss, but none inside ``skip`` (reading one is a host sync)."""

    def __init__(self, skip: range = range(0)) -> None:
        self.losses: list[float] = []
        self.skip = skip

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx not in self.skip:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))


# ---------------------------------------------------------------------------------------------- one rank
class _Window(L.Callback):
    """Set-up seconds (from building the Trainer to the first batch) and the timed window of steps ``warmup .. warmup+steps-1``:
    seconds and host syncs."""

    def __init__(self, ctx: Context, warmup: int, steps: int) -> None:
        self.ctx, self.warmup, self.steps = ctx, warmup, steps
        self.started = time.perf_counter()
        self.setup_s = self.step_s = math.nan
        self.syncs: Optional[int] = None
        self._count: Any = None
        self._found: list[int] = []
        self._t0 = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.setup_s = time.perf_counter() - self.started

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            _sync(self.ctx)
            self._t0 = time.perf_counter()
            self._count = host_syncs(self.ctx)
            self._found = self._count.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx == self.warmup + self.steps - 1:
            self._count.__exit__(None, None, None)
            _sync(self.ctx)
            self.step_s = (time.perf_counter() - self._t0) / self.steps
            self.syncs = self._found[0] if self._found else None


def _peak_reset(ctx: Context) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.torch_device)


def _peaks(ctx: Context) -> dict[str, Optional[float]]:
    if not ctx.cuda:
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return {"peak_allocated_bytes": float(torch.cuda.max_memory_allocated(ctx.torch_device)),
            "peak_reserved_bytes": float(torch.cuda.max_memory_reserved(ctx.torch_device))}


def _mfu(ctx: Context, flops_per_step: float, step_s: float) -> Optional[float]:
    spec = _device_spec(ctx)
    return None if spec is None or not step_s > 0 else flops_per_step / step_s / spec.peak_flops


def plain_loop(ctx: Context, precision: str) -> dict[str, Any]:
    """The same module and optimizer (``CausalLM.configure_optimizers``) in a plain PyTorch loop on the device."""
    s = ctx.sizes
    info = precision_info(precision)
    _peak_reset(ctx)
    torch.manual_seed(0)
    with ctx.torch_device:
        model = Llama(s.llama)
    model = model.to(info.param_dtype)
    optimizer = CausalLM(model, lr=3e-4).configure_optimizers()
    autocast = torch.autocast(ctx.torch_device.type, dtype=info.compute_dtype) if info.mixed else nullcontext()
    data = _tokens(s.batch * (s.warmup + s.steps), s.seq, s.llama.vocab_size)
    syncs: list[int] = []
    t0 = 0.0
    for i, (x, y) in enumerate(DataLoader(data, batch_size=s.batch)):
        if i == s.warmup:
            _sync(ctx)
            t0 = time.perf_counter()
            window = host_syncs(ctx)
            syncs = window.__enter__()
        x, y = x.to(ctx.torch_device, non_blocking=True), y.to(ctx.torch_device, non_blocking=True)
        with autocast:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (B·T, V) against (B·T,)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    window.__exit__(None, None, None)
    _sync(ctx)
    step_s = (time.perf_counter() - t0) / s.steps
    out = {"plain_step_s": step_s, "plain_host_syncs_per_step": syncs[0] / s.steps if syncs else None,
           "plain_final_loss": float(loss.detach())}
    out.update({f"plain_{k}": v for k, v in _peaks(ctx).items()})
    del model, optimizer
    _peak_reset(ctx)
    return out


@dataclass(frozen=True)
class OneRank:
    """The package's Llama (``Sizes.llama``) built on meta under ``FourDStrategy(**strategy)`` on one rank, against
    the plain loop (computed once per precision and shared by the one-rank cases)."""

    name: str
    checks: str
    precision: str = "bf16-mixed"
    strategy: dict[str, Any] = field(default_factory=dict)

    def run(self, ctx: Context, shared: dict[str, Any]) -> dict[str, Any]:
        s = ctx.sizes
        info = precision_info(self.precision)
        with torch.device("meta"):
            model = Llama(s.llama)
        params, flops_per_token = model.num_params(), model.flops_per_token(s.seq)
        lm = CausalLM(model, lr=3e-4)
        _peak_reset(ctx)
        window = _Window(ctx, s.warmup, s.steps)
        losses = _Losses(skip=range(s.warmup, s.warmup + s.steps - 1))  # the timed steps but the last
        strategy = FourDStrategy(parallel_devices=[ctx.torch_device], **self.strategy)
        trainer = _trainer(ctx, strategy, self.precision, s.warmup + s.steps, [window, losses])
        data = _tokens(s.batch * (s.warmup + s.steps), s.seq, s.llama.vocab_size)
        trainer.fit(lm, DataLoader(data, batch_size=s.batch))
        out: dict[str, Any] = {"params": params, "tokens_per_step": s.batch * s.seq, "setup_s": window.setup_s,
                               "step_s": window.step_s,
                               "host_syncs_per_step": None if window.syncs is None else window.syncs / s.steps,
                               "losses": losses.losses, **_peaks(ctx)}
        spec = _device_spec(ctx)
        train = TrainSpec(global_batch_size=s.batch, seq_len=s.seq, precision=info.planner or "bf16-mixed",
                          flash_attention=ctx.cuda, **({"activation_checkpointing": self.strategy[
                              "activation_checkpointing"]} if "activation_checkpointing" in self.strategy else {}))
        planned = memory_per_rank(TransformerSpec.from_config(s.llama, seq_len=s.seq), ParallelDims.from_world(1),
                                  train, allocator_overhead=spec.allocator_overhead if spec else 0.0)[0]
        out.update(planner_allocated_bytes=planned.allocated, planner_setup_bytes=planned.setup,
                   planner_total_bytes=planned.total)
        if out["peak_allocated_bytes"] is not None:
            out["peak_over_planner"] = out["peak_allocated_bytes"] / max(planned.allocated, planned.setup)
        del trainer, lm, model, strategy
        if torch.distributed.is_initialized():  # the one-rank group; the worlds start their own processes
            torch.distributed.destroy_process_group()
        plain = shared.get(("plain", self.precision))
        if plain is None:
            plain = shared[("plain", self.precision)] = plain_loop(ctx, self.precision)
        out.update(plain)
        flops = flops_per_token * s.batch * s.seq
        out.update(step_over_plain=out["step_s"] / out["plain_step_s"], mfu=_mfu(ctx, flops, out["step_s"]),
                   plain_mfu=_mfu(ctx, flops, out["plain_step_s"]),
                   peak_flops=None if spec is None else spec.peak_flops)
        finite = all(math.isfinite(x) for x in out["losses"]) and math.isfinite(out["plain_final_loss"])
        return {**out, "ok": finite, "error": None if finite else f"non-finite losses: {out['losses']}"}


# ---------------------------------------------------------------------------------------------- worlds
@dataclass(frozen=True)
class World:
    """A ``ranks``-process world on the one device (``Context.backend``) training ``model`` under
    ``FourDStrategy(**strategy)`` for ``Sizes.world_steps`` steps, against one process on the same device."""

    name: str
    checks: str
    model: str  # "llama" | "moe"
    strategy: dict[str, Any]
    precision: str
    meta: bool = False  # built on the meta device (else for real, in __init__: the README's own example)
    save: bool = False  # save a checkpoint after training
    ranks: int = 2
    needs: tuple[str, ...] = ()  # optional packages the case imports (reported as not run where missing)

    def run(self, ctx: Context, shared: dict[str, Any]) -> dict[str, Any]:
        reference = fit(self, ctx, rank=None)
        left = max(30.0, ctx.left_s())
        results = run_world(_world_rank, self.ranks, self, ctx, timeout_s=min(300.0, left), pg_timeout_s=120.0,
                            raise_on_error=False, backend=ctx.backend)
        failed = [(r, res) for r, res in enumerate(results) if not res["ok"]]
        if failed:
            rank, res = failed[0]
            tail = res.get("traceback", "").strip().splitlines()[-12:]
            return {"ok": False, "error": f"rank {rank}: {res['error']}", "traceback": tail,
                    "reference_losses": reference["losses"]}
        got = results[0]["value"]
        err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], reference["losses"]))
        out = {**got, "reference_losses": reference["losses"], "loss_rel_err": err}
        cfg = ctx.sizes.world_moe if self.model == "moe" else ctx.sizes.world_llama
        finite = all(math.isfinite(x) for x in got["losses"]) and len(got["losses"]) == len(reference["losses"])
        if precision_info(self.precision).compute_bytes == 2:
            tol = parity_tolerance(self.precision, cfg.n_layers, ctx.sizes.world_batch * cfg.max_seq_len)
            out["loss_tolerance"] = tol.loss
            ok = finite and err <= tol.loss
        else:
            ok = finite  # fp32: the figure is reported; the parity tests hold fp32 to its reordering noise
        return {**out, "ok": ok, "error": None if ok else f"losses {got['losses']} vs one process "
                                                          f"{reference['losses']} (rel {err:.2e})"}


def _world_model(case: World, ctx: Context) -> torch.nn.Module:
    if case.model == "moe":
        return MoETransformer(ctx.sizes.world_moe)
    return Llama(ctx.sizes.world_llama)


def fit(case: World, ctx: Context, rank: Optional[int]) -> dict[str, Any]:
    """Train ``case`` here: under ``FourDStrategy`` as rank ``rank`` of its world, or (``rank=None``) as one plain
    Lightning process: the same initial weights (seed 0) and the same sequences every step."""
    torch.manual_seed(0)
    s = ctx.sizes
    cfg = s.world_moe if case.model == "moe" else s.world_llama
    data = _tokens(s.world_batch, cfg.max_seq_len, cfg.vocab_size, seed=1)
    with torch.device("meta") if case.meta else nullcontext():
        model = _world_model(case, ctx)
    lm = CausalLM(model, lr=1e-3)
    if case.meta and rank is None:  # the values every layout draws (a function of the seed and the names)
        materialize(lm, ctx.torch_device)
    if case.strategy.get("float8") and rank is None:  # the reference converted as the strategy converts
        _float8_reference(lm.to(ctx.torch_device), ctx)
    losses = _Losses()
    if rank is None:
        trainer = _trainer(ctx, "auto", case.precision, s.world_steps, [losses])
        batch = s.world_batch
    else:
        options = dict(case.strategy)
        if options.get("compile") is True and not ctx.cuda:
            options["compile"] = "aot_eager"  # the dry run: the same graphs without Inductor's C++ compiles
        strategy = FourDStrategy(parallel_devices=[ctx.torch_device] * case.ranks, process_group_backend=ctx.backend,
                                 **options)
        trainer = _trainer(ctx, strategy, case.precision, s.world_steps, [losses])
        per_replica = case.strategy.get("tp", 1) * case.strategy.get("pp", 1) * case.strategy.get("cp", 1)
        batch = s.world_batch // (case.ranks // per_replica)
    trainer.fit(lm, DataLoader(data, batch_size=batch))
    out: dict[str, Any] = {"losses": losses.losses}
    if case.save and rank is not None:
        path = Path(ctx.work_dir) / f"{case.name}.ckpt"
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        out["save_s"] = time.perf_counter() - start
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() \
            else path.stat().st_size
    return out


def _float8_reference(lm: torch.nn.Module, ctx: Context) -> None:
    """Convert one process's model as ``FourDStrategy(float8=True)`` does (the plan's rule, torchao's config)."""
    from lightning_4d.config import FourDConfig
    from lightning_4d.layout.derive_plan import plan_layout
    from lightning_4d.speed.float8 import apply_float8, emulated

    plan = plan_layout(lm, ParallelDims(world_size=1), FourDConfig(float8=True))
    apply_float8(lm, plan.float8_linears, plan.float8, emulate=emulated(ctx.torch_device), fsdp_all_gather=False)


def _world_rank(rank: int, case: World, ctx: Context) -> dict[str, Any]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    return fit(case, ctx, rank)


# ---------------------------------------------------------------------------------------------- the cases
CASES: list[Any] = [
    OneRank("one-rank-llama-1b", "set-up seconds, step time against a plain PyTorch loop, peak memory against the "
                                 "planner, host syncs per step and MFU of a meta-built 1.1 B Llama in bf16-mixed"),
    World("dp2-real", "a model built for real at dp=2 (FSDP2): rank 0's weights broadcast on the device", "llama",
          {}, "32-true"),
    World("cp2-real", "a model built for real at cp=2: the context-parallel set-up check's tensors on the device",
          "llama", {"cp": 2}, "32-true"),
    World("tp2-bf16-save", "tp=2 in bf16-mixed (loss_parallel under autocast, no FSDP2) and a DCP checkpoint save",
          "llama", {"tp": 2}, "bf16-mixed", meta=True, save=True),
    World("ep2-bf16", "ep=2 in bf16-mixed: the all-to-all token dispatch and the experts' dtypes", "moe", {"ep": 2},
          "bf16-mixed", meta=True),
    World("pp2", "pp=2 (1F1B): stage P2P and shape inference on the device", "llama", {"pp": 2}, "32-true",
          meta=True),
    World("dp2-compile", "compile=True under dp=2 (FSDP2): each block compiled by Inductor before FSDP2 wraps it "
                         "(aot_eager in the dry run)", "llama", {"compile": True}, "32-true"),
    World("tp2-float8", "float8=True under tp=2: torchao's Float8 linears, real Float8 GEMMs on compute capability "
                        "8.9 or more (emulated elsewhere), against one process converted the same way", "llama",
          {"tp": 2, "float8": True}, "32-true", needs=("torchao",)),
]


def run(cases: list[Any], ctx: Context) -> dict[str, Any]:
    """Run ``cases`` in order; every figure and a verdict per case."""
    import lightning

    shared: dict[str, Any] = {}
    started = time.monotonic()
    report: dict[str, Any] = {
        "torch": torch.__version__, "lightning": lightning.__version__, "device": ctx.device,
        "device_name": torch.cuda.get_device_name(ctx.torch_device) if ctx.cuda else "cpu",
        "dry_run": not ctx.cuda, "backend": ctx.backend, "sizes": asdict(ctx.sizes), "cases": [],
    }
    for case in cases:
        entry: dict[str, Any] = {"name": case.name, "checks": case.checks}
        missing = [m for m in getattr(case, "needs", ()) if importlib.util.find_spec(m) is None]
        if missing:  # the GPU machine has torch and Lightning only: an optional extra is reported, not failed
            entry.update(ok=None, skipped=True, error=f"skipped: {', '.join(missing)} is not installed here")
        elif ctx.left_s() <= 0:
            entry.update(ok=False, skipped=True, error="skipped: the time budget was spent")
        else:
            start = time.perf_counter()
            try:
                entry.update(case.run(ctx, shared))
            except Exception as err:  # noqa: BLE001 - recorded; the next case runs
                entry.update(ok=False, error=f"{type(err).__name__}: {err}",
                             traceback=traceback.format_exc().strip().splitlines()[-12:])
            entry["seconds"] = time.perf_counter() - start
        report["cases"].append(entry)
        verdict = "ok" if entry["ok"] else str(entry["error"]) if entry["ok"] is None else \
            "FAILED " + str(entry["error"])[:300]
        print(f"gpu_smoke: {case.name}: {verdict}", flush=True)
    report["seconds"] = time.monotonic() - started
    report["passed"] = sum(bool(c["ok"]) for c in report["cases"])
    report["not_run"] = [c["name"] for c in report["cases"] if c["ok"] is None]
    report["failed"] = len(report["cases"]) - report["passed"] - len(report["not_run"])
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, gloo (what the test suite runs)")
    parser.add_argument("--out", default="gpu_smoke.json", help="the JSON report")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="skip the cases left after this")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry-run on a CPU")
    cases = CASES if args.only is None else [c for c in CASES if c.name in args.only.split(",")]
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as work:
        ctx = Context(device="cpu" if args.dry_run else "cuda:0", backend="cpu:gloo" if args.dry_run else "cuda:gloo",
                      sizes=DRY_SIZES if args.dry_run else GPU_SIZES, work_dir=work,
                      deadline=time.monotonic() + args.budget_s)
        report = run(cases, ctx)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"gpu_smoke: {report['passed']} passed, {report['failed']} failed in {report['seconds']:.0f} s; "
          f"{args.out}", flush=True)
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
