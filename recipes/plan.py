"""Plan a lightning_4d training run without any GPU: memory per rank, bytes per collective and mesh axis,
pipeline bubble, step time and MFU — and a dry run of the real rewriting on a fake process group.

    python recipes/plan.py model=moe_1t parallel=moe_1t                  # the reference 1T MoE, 64 × 8 H100
    python recipes/plan.py model=moe_1t parallel=moe_1t plan.device=H200 plan.search=true
    python recipes/plan.py model=llama3_8b parallel=tp plan.nodes=2      # dp=auto fills 2 × 8 GPUs
    python recipes/plan.py model=tiny_moe parallel=cpu_4d plan.trace_ranks=[0,5]
    python recipes/plan.py model=hf model.path=DIR parallel.tp=2 plan.device=A100-40GB plan.search=true
    python recipes/plan.py trainer=cpu plan.device=cpu plan.trace=false  # the default recipe on this machine's CPUs

Same config groups as recipes/train.py (conf/plan.yaml; the trainer defaults to `gpu`) plus the `plan`
section (device by name or custom with a family, nodes, bandwidths, batch, what only the planner models, search,
trace). Each row of docs/planner_calibration.md prints the command that reproduces it. Prints a table and writes plan.json in
Hydra's run directory. Exit status: 0 when the layout fits; 3 when it does not fit the device (its peak, training
step or set-up, exceeds the usable memory; the message says which and what to try); 1 when it fits but the traced
collectives disagree with the formulas; 2 when the request is impossible (layout, cluster, batch, or nothing fits
in the search).
The logic lives in lightning_4d.recipes.planning (importable and tested); see recipes/README.md.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from lightning_4d.recipes import RecipeConfigError, register_configs
from lightning_4d.recipes.planning import EXIT_DOES_NOT_FIT, EXIT_IMPOSSIBLE, run_plan

register_configs()


@hydra.main(config_path="../conf", config_name="plan", version_base=None)
def main(cfg: DictConfig) -> None:
    """Compose, plan, print, write plan.json; exit 2 on an impossible request, 3 when the layout does not fit."""
    try:
        outcome = run_plan(cfg)
    except RecipeConfigError as err:  # PlanError included: a clear message, no traceback
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_IMPOSSIBLE) from None
    print(outcome.text, flush=True)
    if outcome.exit_code == EXIT_DOES_NOT_FIT:
        line = next(x for x in outcome.text.splitlines() if x.startswith("DOES NOT FIT"))
        print(f"error: {line}", file=sys.stderr, flush=True)
    if outcome.exit_code:
        raise SystemExit(outcome.exit_code)


if __name__ == "__main__":
    main()
