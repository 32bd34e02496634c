"""Planner vs published runs (Megatron-LM SC21 Table 1, TorchTitan Llama 3.1 H100): prints the table of
throughput and memory ratios; ``--write docs/planner_calibration.md`` regenerates the doc's table.

Example:
    python bench/calibrate_planner.py --write docs/planner_calibration.md
"""

from lightning_4d.planner.calibrate import main

if __name__ == "__main__":
    raise SystemExit(main())
