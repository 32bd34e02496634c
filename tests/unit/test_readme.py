"""The README and the docs pages: every ```python block compiles and its imports resolve, every dotted
``lightning_4d.…`` name they quote exists, their relative links resolve, the README stays short (at most
``README_MAX_LINES``) and every docs page is reachable from it by links.

Example:
    >>> sorted(_quoted_names("see `lightning_4d.analysis.trace` and `lightning_4d.models.CausalLM`"))
    ['lightning_4d.models.CausalLM', 'lightning_4d.analysis.trace']
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import textwrap
from pathlib import Path

import pytest

README_PATH = Path(__file__).resolve().parents[2] / "README.md"
README = README_PATH.read_text(encoding="utf-8")
README_MAX_LINES = 300  # depth goes to a docs/ page, linked from the README
DOCS = sorted((README_PATH.parent / "docs").glob("*.md"))
PAGES = {"README.md": README, **{f"docs/{p.name}": p.read_text(encoding="utf-8") for p in DOCS}}
BLOCKS = [(page, textwrap.dedent(block)) for page, text in PAGES.items()  # a block in a list item: indented
          for block in re.findall(r"^ *```python\n(.*?)```", text, flags=re.DOTALL | re.MULTILINE)]


def _quoted_names(text: str) -> set[str]:
    return set(re.findall(r"`(lightning_4d(?:\.\w+)+)", text))


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_compiles_and_imports(index: int) -> None:
    page, block = BLOCKS[index]
    compile(block, f"{page} python block {index}", "exec")
    for line in block.splitlines():
        if not re.match(r"(from \S+ )?import ", line):
            continue
        top = line.split()[1].split(".")[0]
        if top != "lightning_4d" and importlib.util.find_spec(top) is None:
            continue  # an optional third-party package that is not installed here
        exec(line, {})  # noqa: S102 - the README's own import line


@pytest.mark.parametrize("name", sorted(set().union(*map(_quoted_names, PAGES.values()))))
def test_quoted_name_exists(name: str) -> None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return


@pytest.mark.parametrize("page", ["README.md", "recipes/README.md", *sorted(
    str(p.relative_to(README_PATH.parent)) for p in (README_PATH.parent / "docs").glob("*.md"))])
def test_relative_links_exist(page: str) -> None:
    """Every relative Markdown link of the README, the recipes' README and the docs pages names a file that exists."""
    path = README_PATH.parent / page
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", path.read_text(encoding="utf-8"))
    missing = [t for t in targets if not (path.parent / t).exists()]
    assert not missing, f"{page} links to missing files: {missing}"


def _links(page: Path) -> set[Path]:
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", page.read_text(encoding="utf-8"))
    return {(page.parent / t).resolve() for t in targets}


def test_readme_is_short() -> None:
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, at most {README_MAX_LINES}: move depth to a "
                                       "docs/ page and link it")


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    seen, todo = set(), [README_PATH.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo.extend(_links(page))
    unreachable = [p.name for p in DOCS if p.resolve() not in seen]
    assert not unreachable, f"docs pages no link from README.md leads to: {unreachable}"
