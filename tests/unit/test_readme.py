"""The README's examples: every ```python block compiles and its imports resolve, every dotted
``lightning_4d.…`` name it quotes exists, and the relative links of the README and the docs pages resolve.

Example:
    >>> sorted(_quoted_names("see `lightning_4d.analysis.trace` and `lightning_4d.models.CausalLM`"))
    ['lightning_4d.models.CausalLM', 'lightning_4d.analysis.trace']
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

README_PATH = Path(__file__).resolve().parents[2] / "README.md"
README = README_PATH.read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def _quoted_names(text: str) -> set[str]:
    return set(re.findall(r"`(lightning_4d(?:\.\w+)+)", text))


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_compiles_and_imports(index: int) -> None:
    block = BLOCKS[index]
    compile(block, f"README.md python block {index}", "exec")
    for line in block.splitlines():
        if not re.match(r"(from \S+ )?import ", line):
            continue
        top = line.split()[1].split(".")[0]
        if top != "lightning_4d" and importlib.util.find_spec(top) is None:
            continue  # an optional third-party package that is not installed here
        exec(line, {})  # noqa: S102 - the README's own import line


@pytest.mark.parametrize("name", sorted(_quoted_names(README)))
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
