"""Command line: ``python -m lightning_4d.data prepare --out DIR [--text PATH ...]``.

Examples::

    # default corpus: the Python standard library's .py files (first 4 MB)
    python -m lightning_4d.data prepare --out data/stdlib
    # your own text files or directories, GPT-2 BPE (needs tiktoken) or a model's own tokenizer directory
    python -m lightning_4d.data prepare --out data/books --text books/ notes.txt --tokenizer gpt2
    # JSONL / Parquet / Arrow / text with the model's tokenizer (chat: its chat template, prompts masked),
    # in worker processes, before a multi-node run (the recipe's data=chat / data=hf_text then reuse it)
    python -m lightning_4d.data prepare-dataset --out data/chat --files chat.jsonl --tokenizer MODEL_DIR --format chat
    # a tiny offline example: a chat JSONL, a tokenizer trained on it and a tiny random model in one directory
    python -m lightning_4d.data example-chat --out tiny-qwen3-moe
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
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (default), a tiktoken name such as 'gpt2', or a Hugging Face tokenizer directory")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help=f"cap on raw text bytes (default: {DEFAULT_MAX_BYTES} for the standard library, none for --text)",
    )
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of tokens for validation")
    d = sub.add_parser("prepare-dataset", help="tokenize JSONL / Parquet / Arrow / text with a model's tokenizer")
    d.add_argument("--out", required=True, type=Path, help="output directory")
    d.add_argument("--files", required=True, nargs="+", type=Path, metavar="PATH", help="data files or directories")
    d.add_argument("--tokenizer", required=True, help="the model's tokenizer directory (usually the model directory)")
    d.add_argument("--format", default="text", choices=("text", "chat"), help="packed text (default) or chat")
    d.add_argument("--val-files", nargs="+", type=Path, default=None, metavar="PATH", help="a validation set")
    d.add_argument("--val-fraction", type=float, default=0.05, help="held out when there are no --val-files")
    d.add_argument("--num-proc", type=int, default=None, help="worker processes (default: by size and cores)")
    d.add_argument("--text-field", default="text", help="column holding the text (text format)")
    d.add_argument("--messages-field", default="messages", help="column holding the conversation (chat)")
    e = sub.add_parser("example-chat", help="write a tiny chat JSONL, tokenizer and random model into a directory")
    e.add_argument("--out", required=True, type=Path, help="output directory")
    e.add_argument("--model", default="qwen3_moe", choices=("qwen3_moe", "llama"), help="model family")
    e.add_argument("--conversations", type=int, default=256, help="number of conversations")
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
        elif args.command == "prepare-dataset":
            from lightning_4d.data.prepared import prepare_dataset

            result = prepare_dataset(args.files, args.out, args.tokenizer, args.format, val_files=args.val_files,
                                     val_fraction=args.val_fraction, num_proc=args.num_proc,
                                     text_field=args.text_field, messages_field=args.messages_field)
            print(result.describe())
        elif args.command == "example-chat":
            from lightning_4d.data.example import write_chat_example

            paths = write_chat_example(args.out, model=args.model, n=args.conversations)
            print(f"model, tokenizer and chat data: {paths['model']} (data: {paths['data']})")
        else:
            _info(args.paths)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
