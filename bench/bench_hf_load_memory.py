"""Per-rank host memory of loading a pretrained Hugging Face model: streamed into shards vs loaded whole per rank.

A Llama saved with ``save_pretrained`` into a temporary directory (``143m``: vocab 32000, hidden 768, 12 layers,
intermediate 2048, untied head: 134 M parameters, 537 MB fp32; ``small``: hidden 384, 6 layers) is trained for a
step under ``FourDStrategy(tp=2, pp=2)`` × dp 2 (FSDP2) on 8 CPU ranks (gloo, ``OMP_NUM_THREADS=1``), once per path,
each in a fresh world:

- ``new``: ``HFLogits.from_pretrained(dir)`` inside ``trainer.init_module(empty_init=True)``: built on the meta device
  from ``config.json``, the strategy allocates this rank's shards and reads their values straight from the
  safetensors file, one tensor at a time (``lightning_4d.models.hf_source``);
- ``old``: ``HFLogits.from_pretrained(dir, meta=False)``: ``AutoModelForCausalLM.from_pretrained`` of the whole model
  on every rank, then sharded.

Each rank first runs the same path on a tiny model of the same family and layout (warm-up: imports, process groups
and the one-time buffers of the strategy's machinery are then already resident, so they are not counted as the
model's), then takes its baseline (``VmRSS``) just before the measured model and Trainer are built and resets the
kernel's peak-RSS counter (``VmHWM`` via ``/proc/self/clear_refs``; ``ru_maxrss``, which cannot be reset, otherwise).
Printed per rank: ``share`` (bytes of its local parameter shards), ``set-up`` (peak RSS growth over the baseline up
to ``on_fit_start``: model build + ``strategy.setup``), ``step`` (peak growth during the step, counter reset at
``on_fit_start``), set-up seconds, tensors read from the files; then the bound of issue 22,
``1.5 · share + largest tensor`` (the largest single tensor of the model: the 32000 × 768 embedding).

Run: OMP_NUM_THREADS=1 python bench/bench_hf_load_memory.py [--sizes 143m] [--paths new,old] [--steps 1]
     [--sharded] [--json out.json]
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

SIZES: dict[str, dict[str, int]] = {
    "small": dict(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6),
    "143m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
}
WARMUP = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
WORLD, TP, PP = 8, 2, 2
SEQ, GLOBAL_BATCH = 64, 8
MB = 2**20


# ---------------------------------------------------------------------------------------------- memory probes
reset_peak = clear_peak
peak = kernel_peak


# ---------------------------------------------------------------------------------------------- the model directory
def save_model(size: dict[str, int], directory: Path, sharded: bool) -> dict[str, int]:
    """``save_pretrained`` of a seeded random Llama of ``size``; returns its parameter count, bytes and largest tensor."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**size, num_key_value_heads=size["num_attention_heads"],
                                      max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, **({"max_shard_size": "100MB"} if sharded else {}))
    params = list(model.parameters())
    return {"params": sum(p.numel() for p in params), "bytes": sum(p.numel() * p.element_size() for p in params),
            "largest": max(p.numel() * p.element_size() for p in params)}


# ---------------------------------------------------------------------------------------------- one rank
def _fit(directory: str, path: str, steps: int, out: dict[str, Any]) -> None:
    """Build the model of ``directory`` by ``path`` and train ``steps`` steps, recording memory into ``out``."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_4d import FourDStrategy
    from lightning_4d.models import CausalLM, HFLogits

    class Probe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            out["setup_peak"] = peak() - baseline
            out["setup_s"] = time.perf_counter() - start
            out["share"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                               for p in pl_module.parameters())
            report = getattr(trainer.strategy, "materialize_report", None)
            out["loaded"] = report.loaded if report is not None else 0
            reset_peak()

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            out["step_peak"] = peak() - baseline

    vocab = json.loads((Path(directory) / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH * steps, SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // (WORLD // (TP * PP)))
    reset_peak()
    baseline = rss()
    out["baseline"] = baseline
    start = time.perf_counter()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=FourDStrategy(tp=TP, pp=PP), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Probe()])
    if path == "new":
        with trainer.init_module(empty_init=True):
            net = HFLogits.from_pretrained(directory)
        source = net.model.fourd_weight_source
    else:
        net, source = HFLogits.from_pretrained(directory, meta=False), None
    out["built_peak"] = peak() - baseline
    trainer.fit(CausalLM(net, lr=1e-5), train_dataloaders=loader)
    out["reads"] = source.reads if source is not None else None


def _rank(rank: int, directory: str, warmup: str, path: str, steps: int) -> dict[str, Any]:
    """A warm-up run on a tiny model of the same family and layout (imports, process groups, one-time buffers),
    then the measured run."""
    _fit(warmup, path, 1, {})
    out: dict[str, Any] = {"rank": rank}
    _fit(directory, path, steps, out)
    return out


# ---------------------------------------------------------------------------------------------- report
def _table(name: str, path: str, facts: dict[str, int], rows: list[dict[str, Any]]) -> str:
    lines = [(f"\n{name} ({facts['params'] / 1e6:.0f} M params, {facts['bytes'] / MB:.0f} MB fp32, largest tensor "
              f"{facts['largest'] / MB:.1f} MB), path={path}, tp{TP} x pp{PP} x dp{WORLD // (TP * PP)} on {WORLD} ranks"),
             (f"{'rank':>4} {'share MB':>9} {'set-up MB':>10} {'step MB':>8} {'bound MB':>9} {'set-up/bound':>12} "
              f"{'set-up s':>9} {'reads':>6} {'base MB':>8} {'built MB':>9}")]
    for r in rows:
        bound = 1.5 * r["share"] + facts["largest"]
        lines.append(f"{r['rank']:>4} {r['share'] / MB:>9.1f} {r['setup_peak'] / MB:>10.1f} {r['step_peak'] / MB:>8.1f} "
                     f"{bound / MB:>9.1f} {r['setup_peak'] / bound:>12.2f} {r['setup_s']:>9.1f} "
                     f"{r['reads'] if r['reads'] is not None else '-':>6} {r['baseline'] / MB:>8.0f} {r['built_peak'] / MB:>9.1f}")
    worst = max(rows, key=lambda r: r["setup_peak"])
    lines.append(f"max set-up growth {worst['setup_peak'] / MB:.1f} MB (rank {worst['rank']}, share "
                 f"{worst['share'] / MB:.1f} MB) = {worst['setup_peak'] / worst['share']:.1f} x share = "
                 f"{worst['setup_peak'] / facts['bytes']:.2f} x the whole model")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    from lightning_4d.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="143m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--paths", default="new,old", help="comma-separated: new (streamed), old (whole per rank)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--sharded", action="store_true", help="save with max_shard_size=100MB (index.json layout)")
    parser.add_argument("--json", default=None, help="write every rank's numbers here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, Any] = {}
    for name in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix="l4d_hf_bench_") as tmp:
            directory = Path(tmp) / name
            facts = save_model(SIZES[name], directory, args.sharded)
            warmup = Path(tmp) / "warmup"
            save_model(WARMUP, warmup, args.sharded)
            for path in args.paths.split(","):
                rows = run_world(_rank, WORLD, str(directory), str(warmup), path, args.steps, timeout_s=1800,
                                 pg_timeout_s=600)
                print(_table(name, path, facts, rows), flush=True)
                results[f"{name}/{path}"] = {"model": facts, "ranks": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
