"""The planner against published runs and this machine's CPU runs, through the path a user runs
(``python recipes/plan.py`` with each row's overrides): prints the tables; ``--write docs/planner_calibration.md``
regenerates the document.

Example:
    python bench/calibrate_planner.py --write docs/planner_calibration.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: Optional[list[str]] = None) -> int:
    """Print the document; ``--write PATH`` also writes it."""
    from lightning_4d.recipes.calibration import calibration_markdown

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", default=None, help="markdown file to write")
    args = ap.parse_args(argv)
    text = calibration_markdown()
    print(text)
    if args.write:
        Path(args.write).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
