"""Consolidate a sharded checkpoint, one tensor at a time: ``export`` (one safetensors file, or a directory
of shards) or ``export-hf`` (a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained``
loads). Peak memory is about twice the checkpoint's largest tensor, not the model.

Example:
    python -m lightning_4d.checkpoint export outputs/run/checkpoints/step=200.ckpt model.safetensors
    python -m lightning_4d.checkpoint export outputs/run/checkpoints/step=200.ckpt weights/ --max-shard-size 5GB
    python -m lightning_4d.checkpoint export-hf outputs/run/checkpoints/step=200.ckpt my-model [--base DIR]
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from lightning_4d.checkpoint.stream import DEFAULT_MAX_SHARD_SIZE


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m lightning_4d.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="merge a sharded checkpoint into one safetensors file or a directory "
                                           "of safetensors shards")
    export.add_argument("checkpoint", help="a checkpoint directory written by FourDStrategy")
    export.add_argument("out", help="the .safetensors file to write (its directory is created when missing), or a "
                                    "directory to create (any other name): model.safetensors, or shards and "
                                    "model.safetensors.index.json above --max-shard-size")
    export.add_argument("--max-shard-size", default=None,
                        help="largest file of a directory export, e.g. 5GB or 500MB (default: 50GB, as "
                             "save_pretrained)")
    export.add_argument("--no-verify", action="store_true",
                        help="compare file sizes only, not the SHA-256 checksums of the checkpoint's manifest")
    hf = sub.add_parser("export-hf", help="write a Hugging Face model directory (config.json + safetensors)")
    hf.add_argument("checkpoint", help="a checkpoint directory written by FourDStrategy")
    hf.add_argument("out", help="the directory to create (must not exist or be empty)")
    hf.add_argument("--base", default=None,
                    help="the model directory trained from (config, tokenizer files); default: the one the "
                         "checkpoint records")
    hf.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="cast the weights (default: as trained)")
    hf.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                    help="largest safetensors file, e.g. 5GB or 500MB; above it the weights are split into "
                         "model-0000k-of-0000n.safetensors with model.safetensors.index.json (default: %(default)s, "
                         "as save_pretrained)")
    hf.add_argument("--no-verify", action="store_true",
                    help="compare file sizes only, not the SHA-256 checksums of the checkpoint's manifest")
    args = parser.parse_args(argv)

    try:
        if args.command == "export-hf":
            from transformers.utils import logging as hf_logging

            from lightning_4d.checkpoint.hf_export import export_hf

            hf_logging.disable_progress_bar()  # one line of output, not transformers' progress bars

            target = export_hf(args.checkpoint, args.out, base=args.base, verify=not args.no_verify, dtype=args.dtype,
                               max_shard_size=args.max_shard_size)
        else:
            from lightning_4d.checkpoint.consolidate import export_consolidated

            target = export_consolidated(args.checkpoint, args.out, verify=not args.no_verify,
                                         max_shard_size=args.max_shard_size)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # e.g. a read-only or full output directory
        print(f"error: cannot write {args.out}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
