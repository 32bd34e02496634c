"""Regenerate the generated parts of ``docs/architecture.md`` from the package's source.

Reads ``lightning_4d/`` with :mod:`ast` only (no import of the package, no torch): every room (a top-level
module or a subpackage), its one-line docstring, its modules, and the rooms it imports (module-level and
function-level imports alike, so the table shows every dependency a reader may meet). The text between
``<!-- BEGIN GENERATED: rooms -->`` and ``<!-- END GENERATED: rooms -->`` is replaced; the rest of the page is
written by hand.

Usage::

    python docs/gen_architecture.py          # rewrite docs/architecture.md
    python docs/gen_architecture.py --check  # exit 1 if the page is stale (tests/unit/test_architecture_doc.py)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "lightning_4d"
ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- BEGIN GENERATED: rooms -->", "<!-- END GENERATED: rooms -->"


def _room(path: Path) -> str:
    """``lightning_4d/layout/pipeline_glue.py`` → ``pipeline/``; ``lightning_4d/core/comm.py`` → ``comm.py``."""
    parts = path.relative_to(ROOT / PACKAGE).parts
    return parts[0] + "/" if len(parts) > 1 else parts[0]


def _room_of_module(name: str, rooms: set[str]) -> str | None:
    """``lightning_4d.layout.pipeline_glue`` → ``pipeline/``; ``None`` outside the package."""
    parts = name.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    if parts[1] + "/" in rooms:
        return parts[1] + "/"
    return parts[1] + ".py" if parts[1] + ".py" in rooms else None


def _imports(tree: ast.Module, rooms: set[str]) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from lightning_4d import _compat``: the imported names may be rooms themselves
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names] if node.module == PACKAGE \
                else [node.module]
        for name in names:
            room = _room_of_module(name, rooms)
            if room is not None:
                out.add(room)
    return out


def _first_line(tree: ast.Module) -> str:
    """The docstring's first sentence (its first paragraph up to a full stop), on one line."""
    doc = (ast.get_docstring(tree) or "").strip()
    paragraph = " ".join(line.strip() for line in doc.split("\n\n")[0].splitlines())
    end = paragraph.find(". ")
    sentence = paragraph[: end + 1] if end >= 0 else paragraph
    return sentence.replace("|", "\\|")


def rooms_table() -> str:
    """The generated Markdown: one row per room."""
    files = sorted(p for p in (ROOT / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts)
    rooms = {_room(p) for p in files if p.parent != ROOT / PACKAGE or p.name != "__init__.py"}
    docs: dict[str, str] = {}
    modules: dict[str, list[str]] = {}
    deps: dict[str, set[str]] = {r: set() for r in rooms}
    for path in files:
        if path.parent == ROOT / PACKAGE and path.name == "__init__.py":
            continue
        room = _room(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        deps[room] |= _imports(tree, rooms) - {room}
        if room.endswith("/"):
            rel = path.relative_to(ROOT / PACKAGE / room.rstrip("/"))
            if rel.name == "__init__.py" and len(rel.parts) == 1:
                docs[room] = _first_line(tree)
            else:
                modules.setdefault(room, []).append(rel.with_suffix("").as_posix().replace("/__init__", ""))
        else:
            docs[room] = _first_line(tree)
    lines = [BEGIN,
             "<!-- Written by docs/gen_architecture.py from the source: run it after adding or moving a module. -->",
             "",
             "| room | what it is (its docstring) | modules | imports (rooms of the package) |",
             "|---|---|---|---|"]
    for room in sorted(rooms, key=lambda r: (r.endswith("/"), r.lstrip("_"))):
        mods = ", ".join(f"`{m}`" for m in sorted(modules.get(room, [])))
        used = ", ".join(f"`{d}`" for d in sorted(deps[room], key=lambda r: r.lstrip("_"))) or "—"
        lines.append(f"| `{room}` | {docs.get(room, '')} | {mods or '—'} | {used} |")
    lines.append(END)
    return "\n".join(lines)


def render(page: str) -> str:
    """``page`` with its generated part replaced by :func:`rooms_table`."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + rooms_table() + page[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/architecture.md is stale")
    args = parser.parse_args(argv)
    page = DOC.read_text(encoding="utf-8")
    fresh = render(page)
    if args.check:
        if fresh != page:
            print("docs/architecture.md is stale: run `python docs/gen_architecture.py`.", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
