"""``python -m lightning_4d.checkpoint export CKPT OUT.safetensors``: consolidate a sharded checkpoint.

Example:
    python -m lightning_4d.checkpoint export outputs/run/checkpoints/step=200.ckpt model.safetensors
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m lightning_4d.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="merge a sharded checkpoint into one safetensors file")
    export.add_argument("checkpoint", help="a checkpoint directory written by FourDStrategy")
    export.add_argument("out", help="the .safetensors file to write (its directory is created when missing)")
    export.add_argument("--no-verify", action="store_true",
                        help="compare file sizes only, not the SHA-256 checksums of the checkpoint's manifest")
    args = parser.parse_args(argv)
    from lightning_4d.checkpoint.consolidate import export_consolidated

    try:
        target = export_consolidated(args.checkpoint, args.out, verify=not args.no_verify)
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
