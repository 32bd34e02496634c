"""Command line: ``python -m lightning_4d.data prepare --out DIR [--text PATH ...]``.

Examples::

    # default corpus: the Python standard library's .py files (first 4 MB)
    python -m lightning_4d.data prepare --out data/stdlib
    # your own text files or directories, GPT-2 BPE (needs tiktoken)
    python -m lightning_4d.data prepare --out data/books --text books/ notes.txt --tokenizer gpt2
    # describe prepared files
    python -m lightning_4d.data info data/stdlib
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from lightning_4d.data.tokens import DEFAULT_MAX_BYTES, TokenFile, prepare

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_4d.data", description="lightning_4d data tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text into DIR/train.bin and DIR/val.bin")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument(
        "--text",
        nargs="+",
        action="extend",
        type=Path,
        default=None,
        metavar="PATH",
        help="text files or directories (default: the Python standard library's .py files)",
    )
    p.add_argument("--tokenizer", default="byte", help="'byte' (default) or a tiktoken name such as 'gpt2'")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help=f"cap on raw text bytes (default: {DEFAULT_MAX_BYTES} for the standard library, none for --text)",
    )
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of tokens for validation")
    i = sub.add_parser("info", help="print the metadata of prepared token files")
    i.add_argument("paths", nargs="+", type=Path, help=".bin files or directories holding train.bin/val.bin")
    return parser


def _info(paths: Sequence[Path]) -> None:
    for path in paths:
        files = [path / "train.bin", path / "val.bin"] if path.is_dir() else [path]
        for f in files:
            tf = TokenFile(f)
            print(f"{f}: {tf.num_tokens} tokens, {tf.dtype.name}, vocab_size={tf.vocab_size}, tokenizer={tf.tokenizer}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as out:
        ...     main(["prepare", "--out", out, "--max-bytes", "2000"])  # doctest: +ELLIPSIS
        corpus: ...
        0
    """
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "prepare":
            r = prepare(
                args.text,
                args.out,
                tokenizer=args.tokenizer,
                val_fraction=args.val_fraction,
                max_bytes=args.max_bytes,
            )
            source = "python standard library" if args.text is None else ", ".join(map(str, args.text))
            print(f"corpus: {source}: {r.num_files} files, {r.num_bytes} bytes")
            print(f"tokenizer: {r.train.tokenizer} (vocab_size={r.train.vocab_size}, dtype={r.train.dtype.name})")
            print(f"train: {r.train.num_tokens} tokens -> {r.train.path}")
            print(f"val: {r.val.num_tokens} tokens -> {r.val.path}")
        else:
            _info(args.paths)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
