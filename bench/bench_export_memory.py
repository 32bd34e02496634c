"""Peak host memory of ``export-hf`` and ``export``: the old whole-model merge vs the streamed export.

A checkpoint of a Hugging Face Llama (``LlamaConfig``: vocab 32000, hidden 768, 12 layers, intermediate 2048,
untied head: ≈134 M parameters, 537 MB fp32) is written by ``save_sharded`` in one CPU process (no process
group). Each export then runs alone in a fresh child process, which imports everything, resets the kernel's
peak-RSS counter (``VmHWM`` via ``/proc/self/clear_refs``; ``ru_maxrss`` where that is not allowed) and takes its
baseline (``VmRSS``) just before the export; printed: the peak RSS growth over that baseline, seconds, files.

Paths:

- ``old-hf``: the export before streaming (kept here verbatim): ``dcp_to_torch_save`` of the whole checkpoint
  into a temporary file, ``torch.load`` of it, a CPU model built with ``to_empty``, ``load_state_dict``,
  ``save_pretrained``;
- ``hf``: :func:`lightning_4d.checkpoint.export_hf` (one file, ``save_pretrained``'s 50GB default shard size);
- ``hf-shards``: the same with ``max_shard_size="100MB"`` (model-0000k-of-0000n.safetensors + index);
- ``old-export``: the old consolidated export (the same merge, then ``safetensors.torch.save_file``);
- ``export``: :func:`lightning_4d.checkpoint.export_consolidated` to one file.

The outputs of ``old-hf`` and ``hf`` / ``hf-shards`` are compared tensor by tensor (one at a time).

Run: OMP_NUM_THREADS=1 python bench/bench_export_memory.py [--paths old-hf,hf,hf-shards,old-export,export]
     [--layers 12 --hidden 768 --vocab 32000 --intermediate 2048] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATHS = ("old-hf", "hf", "hf-shards", "old-export", "export")
MB = 1e6


# ----------------------------------------------------------------------------------------------- the old path
def old_read_model_state(checkpoint: str) -> dict[str, Any]:
    """``read_model_state`` before streaming: DCP's converter writes the whole checkpoint to one torch file."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_4d.checkpoint.state import check_checkpoint, verify_checkpoint

    check_checkpoint(checkpoint)
    verify_checkpoint(checkpoint, checksums=True)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(checkpoint), str(target))
        full = torch.load(target, weights_only=False, map_location="cpu")
    model = full["model"] if "model" in full else full
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def old_export_hf(checkpoint: str, out: str) -> None:
    """``export_hf`` before streaming: merge, load into a CPU model, ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_4d.checkpoint.hf_export import _resolve, _dtype_of, load_strict, strip_prefix
    from lightning_4d.checkpoint.stream import TensorSpec

    config, _ = _resolve(Path(checkpoint), None)
    state = old_read_model_state(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_dtype_of({k: TensorSpec.of(v)
                                                                          for k, v in state.items()}))
    model = model.to_empty(device="cpu")
    model.tie_weights()
    _, state = strip_prefix(state, model.state_dict())
    load_strict(model, state, source=checkpoint)
    tmp = Path(out + ".partial")
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    os.replace(tmp, out)


def old_export(checkpoint: str, out: str) -> None:
    """``export_consolidated`` before streaming: merge, split experts, ``save_file``."""
    from safetensors.torch import save_file

    from lightning_4d.checkpoint.consolidate import split_experts

    state = split_experts(old_read_model_state(checkpoint))
    save_file({k: v.contiguous() for k, v in state.items()}, out)


# ----------------------------------------------------------------------------------------------- child process
def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``); -1 where there is none."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return -1
    match = re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.MULTILINE)
    return int(match.group(1)) * 1024 if match else -1


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child(path: str, checkpoint: str, out: str) -> dict[str, Any]:
    """Run one export in this (fresh) process and measure it."""
    # Imports first: they are the baseline, not the export (both paths use all of these).
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint.format_utils  # noqa: F401
    import transformers  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers.utils import logging as hf_logging

    from lightning_4d.checkpoint import export_consolidated, export_hf

    hf_logging.disable_progress_bar()
    run = {"old-hf": lambda: old_export_hf(checkpoint, out),
           "hf": lambda: export_hf(checkpoint, out),
           "hf-shards": lambda: export_hf(checkpoint, out, max_shard_size="100MB"),
           "old-export": lambda: old_export(checkpoint, out),
           "export": lambda: export_consolidated(checkpoint, out)}[path]
    resettable = _reset_peak()
    base_rss = _status("VmRSS")
    base_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"path": path, "growth": peak - base_rss, "baseline": base_rss, "seconds": seconds,
            "counter": "VmHWM" if resettable else "ru_maxrss", "maxrss_before": base_max}


# ----------------------------------------------------------------------------------------------- parent
def make_checkpoint(directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    from lightning_4d.checkpoint import save_sharded
    from lightning_4d.models import CausalLM, HFLogits
    from lightning_4d.models.hf import CHECKPOINT_KEY, checkpoint_record

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=4,
                                   max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    lm = CausalLM(HFLogits.from_config(cfg))
    state = dict(lm.state_dict())
    info = {"params": sum(p.numel() for p in lm.parameters()),
            "bytes": sum(v.nbytes for v in state.values()),
            "largest": max(v.nbytes for v in state.values()),
            "largest_name": max(state, key=lambda k: state[k].nbytes).removeprefix("model.model.")}
    checkpoint = {"state_dict": state, "optimizer_states": [], "epoch": 0, CHECKPOINT_KEY: checkpoint_record(lm)}
    save_sharded(checkpoint, str(directory), is_global_zero=True)
    return info


def _tensors(directory: Path) -> dict[str, Path]:
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            where.update({k: file for k in handle.keys()})
    return where


def same_export(a: Path, b: Path) -> bool:
    """Same tensor names and values (read one at a time), same config."""
    import torch
    from safetensors import safe_open

    left, right = _tensors(a), _tensors(b)
    if left.keys() != right.keys():
        return False
    for name in left:
        with safe_open(str(left[name]), "pt") as x, safe_open(str(right[name]), "pt") as y:
            if not torch.equal(x.get_tensor(name), y.get_tensor(name)):
                return False
    return json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workdir", default=None, help="where the checkpoint and exports go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--child", nargs=3, metavar=("PATH", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return

    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"--paths: unknown {unknown}; choose from {', '.join(PATHS)}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_export_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        info = make_checkpoint(work / "ckpt", args)
        print(f"model: {info['params'] / 1e6:.1f} M parameters, {info['bytes'] / MB:.0f} MB fp32; largest tensor "
              f"{info['largest_name']} {info['largest'] / MB:.1f} MB; checkpoint written in "
              f"{time.perf_counter() - start:.1f}s")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        rows = []
        for path in paths:
            out = work / (path + (".safetensors" if path.endswith("export") else ""))
            proc = subprocess.run([sys.executable, __file__, "--child", path, str(work / "ckpt"), str(out)],
                                  capture_output=True, text=True, env=env, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(f"{path}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
                continue
            row = json.loads(line[len("RESULT "):])
            row["files"] = len(list(out.glob("*.safetensors"))) if out.is_dir() else 1
            rows.append(row)
            print(f"{path:>11}: peak growth {row['growth'] / MB:7.0f} MB = {row['growth'] / info['bytes']:.2f} x model "
                  f"= {row['growth'] / info['largest']:.2f} x largest tensor; {row['seconds']:5.1f}s; "
                  f"{row['files']} file(s) (baseline {row['baseline'] / MB:.0f} MB, {row['counter']})", flush=True)
        for new in ("hf", "hf-shards"):
            if (work / "old-hf").is_dir() and (work / new).is_dir():
                print(f"{new} == old-hf (names, values, config): {same_export(work / new, work / 'old-hf')}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
