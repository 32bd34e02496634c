"""The README's commands run as written: every fenced ``bash`` block marked ``<!-- runnable -->`` is run, in order,
in one scratch directory (``recipes/``, ``conf/`` and ``examples/`` link into the repository, so a block sees what
the blocks before it wrote, as a reader following the README from a fresh clone would), and a block that fails
fails the test with its text and output. Every ``bash`` block must say whether it is run: ``<!-- runnable -->``,
``<!-- not run: reason -->`` or ``<!-- set-up: ... -->`` (the two set-up commands install things; ``.ci/run`` runs
the test one).

Example:
    >>> [b.marker for b in bash_blocks("<!-- runnable -->\\n```bash\\necho hi\\n```\\n")]
    ['runnable']
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINKED = ("recipes", "conf", "examples")
BLOCK_TIMEOUT_S = 240  # a block is meant to take well under a minute; this only stops a hung one


@dataclass(frozen=True)
class Block:
    """A fenced ``bash`` block: its marker (``runnable``, ``not run``, ``set-up`` or ``None``), text and line."""

    marker: str | None
    text: str
    line: int


def bash_blocks(markdown: str) -> list[Block]:
    """The ``bash`` blocks of ``markdown`` with the marker of the HTML comment on the line before each.

    >>> [(b.marker, b.text) for b in bash_blocks("```bash\\nls\\n```\\n<!-- not run: slow -->\\n```bash\\nx\\n```\\n")]
    [(None, 'ls\\n'), ('not run', 'x\\n')]
    """
    blocks = []
    for m in re.finditer(r"^```bash\n(.*?)^```$", markdown, flags=re.M | re.S):
        before = markdown[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = re.match(r"<!-- (runnable|not run|set-up)\b", before)
        blocks.append(Block(marker.group(1) if marker else None, m.group(1), markdown.count("\n", 0, m.start()) + 1))
    return blocks


BLOCKS = bash_blocks(README.read_text(encoding="utf-8"))


def test_every_bash_block_says_whether_it_runs() -> None:
    unmarked = [f"README.md:{b.line}: {b.text.splitlines()[0]}" for b in BLOCKS if b.marker is None]
    assert not unmarked, ("mark each bash block `<!-- runnable -->`, `<!-- not run: why -->` or `<!-- set-up: ... -->`:"
                          "\n" + "\n".join(unmarked))
    assert sum(b.marker == "set-up" for b in BLOCKS) == 2, "the README starts with exactly two set-up commands"
    assert any(b.marker == "runnable" for b in BLOCKS)


def test_runnable_blocks_run_as_written(tmp_path: Path) -> None:
    for module in ("transformers", "datasets"):  # the fine-tuning example's `[data]` extra
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the README's fine-tuning commands need {module} (pip install -e '.[data]')")
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, (
        str(ROOT), os.environ.get("PYTHONPATH")))), "PATH": os.pathsep.join((str(Path(sys.executable).parent),
                                                                            os.environ.get("PATH", "")))}
    for block in (b for b in BLOCKS if b.marker == "runnable"):
        try:
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"README.md:{block.line}: block did not finish in {BLOCK_TIMEOUT_S} s:\n{block.text}")
        if done.returncode != 0:
            pytest.fail(f"README.md:{block.line}: block failed with exit status {done.returncode}:\n{block.text}\n"
                        f"--- output (last 4000 characters) ---\n{(done.stdout + done.stderr)[-4000:]}")
