"""Set-up of a 64-expert Hugging Face MoE under expert parallelism: memory per rank ∝ share, seconds per rank ∝ share.

The model: transformers' ``Qwen3MoeConfig`` with 64 experts of width 512, hidden 256, 2 layers, vocabulary 4096
(one layer's fused ``gate_up_proj`` is ``64 × 1024 × 256`` = 64 MiB in fp32, ~4× a rank's share at ep=8).
Trained for one step under ``FourDStrategy(ep=E)`` on ``E`` CPU ranks (gloo, ``OMP_NUM_THREADS=1``; the experts
over ``ep``, the rest FSDP2-sharded over ``dp = E``), built on the meta device two ways:

- ``pretrained``: ``HFLogits.from_pretrained(dir)`` of a ``save_pretrained`` copy (per-expert keys on disk): each
  rank reads only its experts' keys (``lightning_4d.materialize.load_sources``);
- ``random``: ``HFLogits.from_config(config)``: each rank computes only its elements' initial values
  (``lightning_4d.materialize.local_shards``).

Each rank first runs the same path on a tiny model (imports, process groups, one-time buffers), then resets the
kernel's peak-RSS counter (``VmHWM``) and records, up to ``on_fit_start``: ``set-up`` (peak RSS growth), ``share``
(its local parameter bytes), ``init s`` (CPU seconds of this rank's thread inside
``materialize_local_shards``: robust to 8 processes sharing 2 cores), and the issue's bound
``1.5 · share + one expert's largest matrix``. The old behaviour allocated one layer's whole fused stack on every
rank (``share + 64 MiB`` at least); the table prints set-up ÷ bound and ÷ (share + that stack).

``--degrees 1,2,4,8`` repeats the ``random`` path at each ep (world = ep) and prints the rank-mean ``init s``
relative to ep=1 next to 1/ep: work per rank falls with the share.

``--scratch`` (one process, no world): materialises the whole model at several chunk sizes and prints the peak
growth over the model's bytes per chunk element (the slope between chunk sizes), next to
``init_pieces.SCRATCH_BYTES_PER_ELEMENT``, the constant the planner's set-up term uses; it exits 1 when the slope
exceeds it.

Run: OMP_NUM_THREADS=1 python bench/bench_moe_setup.py [--paths pretrained,random] [--degrees 1,2,4,8] [--scratch]
     [--json f]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from memory_probes import clear_peak, kernel_peak, rss  # bench/: on the path when run as a script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=512, num_experts=64,
             num_experts_per_tok=4, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             max_position_embeddings=64, norm_topk_prob=True, tie_word_embeddings=False)
WARMUP = {**MODEL, "vocab_size": 256, "hidden_size": 32, "moe_intermediate_size": 16, "intermediate_size": 16,
          "num_experts": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
SEQ, BATCH = 32, 8
MB = 2**20


def _config(values: dict[str, Any]) -> Any:
    import transformers

    return transformers.Qwen3MoeConfig(**values)


def facts(values: dict[str, Any]) -> dict[str, int]:
    """Bytes of the model, one layer's fused gate/up stack and one expert's largest matrix (fp32)."""
    e, i, h = values["num_experts"], values["moe_intermediate_size"], values["hidden_size"]
    return {"stack": 4 * e * 2 * i * h, "expert_matrix": 4 * 2 * i * h}


def save(values: dict[str, Any], directory: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(values), dtype=torch.float32).save_pretrained(directory)


# ---------------------------------------------------------------------------------------------- one rank
def _fit(source: str, path: str, ep: int, out: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_4d.strategy as strategy_module
    from lightning_4d import FourDStrategy
    from lightning_4d.models import CausalLM, HFLogits

    timed = strategy_module.materialize_local_shards
    seconds = [0.0]

    def materialize(*args: Any, **kwargs: Any) -> Any:
        out["before_init"] = kernel_peak() - baseline
        at = rss()
        clear_peak()
        start = time.thread_time()
        try:
            return timed(*args, **kwargs)
        finally:
            seconds[0] += time.thread_time() - start
            out["init_peak"] = kernel_peak() - at

    class Probe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            out["setup_peak"] = kernel_peak() - baseline
            out["share"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                               for p in pl_module.parameters())
            out["init_s"] = seconds[0]

    values = json.loads(source) if path == "random" else None
    vocab = values["vocab_size"] if values else json.loads((Path(source) / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=max(BATCH // ep, 1))
    strategy_module.materialize_local_shards = materialize
    try:
        clear_peak()
        baseline = rss()
        trainer = L.Trainer(accelerator="cpu", devices=ep, strategy=FourDStrategy(ep=ep), max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, callbacks=[Probe()])
        with trainer.init_module(empty_init=True):
            net = (HFLogits.from_config(_config(values)) if values else HFLogits.from_pretrained(source))
        trainer.fit(CausalLM(net, lr=1e-5), train_dataloaders=loader)
        src = getattr(net.model, "fourd_weight_source", None)
        out["expert_keys_read"] = len([k for k in src.keys_read if ".experts." in k]) if src is not None else None
    finally:
        strategy_module.materialize_local_shards = timed


def _rank(rank: int, source: str, warmup: str, path: str, ep: int) -> dict[str, Any]:
    _fit(warmup, path, ep, {})
    out: dict[str, Any] = {"rank": rank}
    _fit(source, path, ep, out)
    return out


# ---------------------------------------------------------------------------------------------- report
def _table(path: str, ep: int, rows: list[dict[str, Any]]) -> str:
    f = facts(MODEL)
    lines = [f"\n{path}, ep={ep} on {ep} ranks (one layer's fused gate/up stack {f['stack'] / MB:.0f} MiB, one "
             f"expert's largest matrix {f['expert_matrix'] / MB:.1f} MiB)",
             f"{'rank':>4} {'share MiB':>9} {'set-up MiB':>10} {'bound MiB':>9} {'set-up/bound':>12} "
             f"{'set-up/(share+stack)':>20} {'init s':>7} {'expert keys read':>16}"]
    for r in rows:
        bound = 1.5 * r["share"] + f["expert_matrix"]
        lines.append(f"{r['rank']:>4} {r['share'] / MB:>9.1f} {r['setup_peak'] / MB:>10.1f} {bound / MB:>9.1f} "
                     f"{r['setup_peak'] / bound:>12.2f} {r['setup_peak'] / (r['share'] + f['stack']):>20.2f} "
                     f"{r['init_s']:>7.2f} {r['expert_keys_read'] if r['expert_keys_read'] is not None else '-':>16}")
    return "\n".join(lines)


_HEADER = """# Set-up of a 64-expert MoE per rank (measured)

Generated by `OMP_NUM_THREADS=1 python bench/bench_moe_setup.py --markdown docs/moe_setup.md` (see its docstring:
transformers' Qwen3-MoE, 64 experts of width 512, hidden 256, 2 layers, fp32; MiB = 2^20 bytes; seconds are CPU
seconds of each rank's thread inside `materialize_local_shards`, 8 processes on 2 cores). `bound` is
`1.5 · share + one expert's largest matrix`; `share + stack` is what set-up held before pieces (the rank's share
plus one layer's fused gate/up stack). `tests/unit/test_moe_setup_doc.py` checks every row against those bounds.

"""


def _markdown(path: str, rows: list[dict[str, Any]]) -> str:
    f = facts(MODEL)
    lines = [f"## `{path}` under ep=8 on 8 ranks\n", "| rank | share MiB | set-up MiB | bound MiB | set-up / bound | "
             "set-up / (share + stack) | init s | expert keys read |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bound = 1.5 * r["share"] + f["expert_matrix"]
        keys = r["expert_keys_read"] if r["expert_keys_read"] is not None else "-"
        lines.append(f"| {r['rank']} | {r['share'] / MB:.1f} | {r['setup_peak'] / MB:.1f} | {bound / MB:.1f} | "
                     f"{r['setup_peak'] / bound:.2f} | {r['setup_peak'] / (r['share'] + f['stack']):.2f} | "
                     f"{r['init_s']:.2f} | {keys} |")
    total = 3 * MODEL["num_experts"] * MODEL["num_hidden_layers"]
    return "\n".join(lines) + f"\n\n(of {total} per-expert keys in the files)\n" if path == "pretrained" \
        else "\n".join(lines) + "\n"


def _sweep_markdown(sweep: dict[int, float]) -> str:
    first = min(sweep)
    lines = ["## Initialisation seconds per rank against ep (random init, mean over ranks)\n",
             "| ep | init s | ÷ ep=1 | share ÷ ep=1 |", "|---:|---:|---:|---:|"]
    lines += [f"| {ep} | {s:.2f} | {s / sweep[first]:.2f} | {first / ep:.2f} |" for ep, s in sweep.items()]
    return "\n".join(lines) + "\n"


def _scratch_point(chunk: int) -> float:
    """Peak RSS growth over the model's bytes when one process materialises ``MODEL`` with ``chunk``."""
    import torch
    import transformers

    import lightning_4d.materialize.local_shards as materialize

    materialize.CHUNK_ELEMENTS = chunk
    for values in (WARMUP, MODEL):  # the warm-up's one-time costs (imports, allocator arenas) are not scratch
        with torch.device("meta"):
            net = transformers.AutoModelForCausalLM.from_config(_config(values))
        if values is WARMUP:
            materialize.materialize_local_shards(materialize.meta_skeleton(net), net, torch.device("cpu"))
    size = sum(p.numel() * p.element_size() for p in net.parameters())
    clear_peak()
    base = rss()
    materialize.materialize_local_shards(materialize.meta_skeleton(net), net, torch.device("cpu"))
    return float(kernel_peak() - base - size)


def _scratch_rank(rank: int, chunk: int) -> float:
    return _scratch_point(chunk)


def scratch(chunks: tuple[int, ...] = (1 << 14, 1 << 16, 1 << 18)) -> bool:
    """Print the measured scratch per chunk element; ``True`` when within ``SCRATCH_BYTES_PER_ELEMENT``."""
    from lightning_4d.materialize.init_pieces import CHUNK_ELEMENTS, SCRATCH_BYTES_PER_ELEMENT, scratch_bytes
    from lightning_4d.testing import run_world

    over = {c: run_world(_scratch_rank, 1, c, timeout_s=600)[0] for c in chunks}  # a fresh process each
    print(f"\n{'chunk':>7} {'over model MiB':>14}")
    for c, v in over.items():
        print(f"{c:>7} {v / MB:>14.1f}")
    slope = (over[chunks[-1]] - over[chunks[0]]) / (chunks[-1] - chunks[0])
    ok = slope <= SCRATCH_BYTES_PER_ELEMENT and over[CHUNK_ELEMENTS] <= scratch_bytes() if CHUNK_ELEMENTS in over \
        else slope <= SCRATCH_BYTES_PER_ELEMENT
    print(f"scratch per chunk element: {slope:.0f} B (SCRATCH_BYTES_PER_ELEMENT = {SCRATCH_BYTES_PER_ELEMENT}); at "
          f"the default chunk ({CHUNK_ELEMENTS}) {over.get(CHUNK_ELEMENTS, float('nan')) / MB:.1f} MiB over the model, "
          f"scratch_bytes() = {scratch_bytes() / MB:.1f} MiB: {'within' if ok else 'OVER'}")
    return ok


def main(argv: Optional[list[str]] = None) -> None:
    from lightning_4d.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="pretrained,random", help="comma-separated: pretrained, random (at ep=8)")
    parser.add_argument("--degrees", default="1,2,4,8", help="ep degrees of the seconds-per-share sweep ('' = none)")
    parser.add_argument("--scratch", action="store_true", help="measure the scratch per chunk element and stop")
    parser.add_argument("--json", default=None, help="write every rank's numbers here")
    parser.add_argument("--markdown", default=None, help="write the tables here (docs/moe_setup.md)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.scratch:
        sys.exit(0 if scratch() else 1)
    results: dict[str, Any] = {}
    doc: list[str] = []
    with tempfile.TemporaryDirectory(prefix="l4d_moe_bench_") as tmp:
        for path in [p for p in args.paths.split(",") if p]:
            if path == "pretrained":
                source, warmup = Path(tmp) / "model", Path(tmp) / "warmup"
                save(MODEL, source)
                save(WARMUP, warmup)
                source, warmup = str(source), str(warmup)
            else:
                source, warmup = json.dumps(MODEL), json.dumps(WARMUP)
            rows = run_world(_rank, 8, source, warmup, path, 8, timeout_s=1800, pg_timeout_s=600)
            print(_table(path, 8, rows), flush=True)
            results[path] = rows
            doc.append(_markdown(path, rows))
        sweep: dict[int, float] = {}
        for ep in [int(d) for d in args.degrees.split(",") if d]:
            rows = run_world(_rank, ep, json.dumps(MODEL), json.dumps(WARMUP), "random", ep, timeout_s=1800,
                             pg_timeout_s=600)
            sweep[ep] = sum(r["init_s"] for r in rows) / len(rows)
            results[f"random/ep{ep}"] = rows
        if sweep:
            first = min(sweep)
            print(f"\ninit seconds per rank (random init, rank mean) vs ep={first}:")
            print(f"{'ep':>3} {'init s':>7} {'ratio':>6} {'share ratio':>11}")
            for ep, s in sweep.items():
                print(f"{ep:>3} {s:>7.2f} {s / sweep[first]:>6.2f} {first / ep:>11.2f}")
            doc.append(_sweep_markdown(sweep))
    if args.markdown:
        Path(args.markdown).write_text(_HEADER + "\n".join(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
