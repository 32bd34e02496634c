"""Train a language model with lightning_4d from Hydra configs (``conf/``).

    python recipes/train.py                                     # tiny MoE, 8 CPU ranks, tp=pp=ep=dp=2
    python recipes/train.py model=tiny_dense parallel=tp        # tp=2 × dp=4 on 8 CPU ranks
    python recipes/train.py parallel.tp=4 trainer.max_steps=20  # any key can be overridden
    python recipes/train.py -m optim.lr=1e-3,3e-3               # multirun: one job after the other
    python recipes/train.py --cfg job                           # print the composed config

The logic lives in :mod:`lightning_4d.recipes.build` (importable and tested); see recipes/README.md.
"""

from __future__ import annotations

import sys
import warnings

import hydra
from omegaconf import DictConfig

from lightning_4d.recipes import RecipeConfigError, ResourceError, register_configs, run

register_configs()
# Lightning 2.6 calls torch's deprecated LeafSpec on every step (torch >= 2.10): not actionable here.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> float:
    """Compose, check, build and train; returns the last training loss (for sweepers)."""
    try:
        result = run(cfg)
    except (RecipeConfigError, ResourceError) as err:  # a clear message, no traceback
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return result.losses[-1] if result.losses else float("nan")


if __name__ == "__main__":
    main()
