"""lightning_4d: 4D parallelism (TP/SP, PP, EP, DP) for any PyTorch Lightning model.

Example:
    >>> import lightning as L
    >>> from lightning_4d import FourDStrategy
    >>> # not run: needs a Trainer
    >>> trainer = L.Trainer(strategy=FourDStrategy(tp=2, pp=2), devices=8)  # doctest: +SKIP
"""

from lightning_4d.config import FourDConfig
from lightning_4d.layout_plan import LayoutPlan, load_plan
from lightning_4d.mesh import Axis, FourDMesh, ParallelDims, build_mesh
from lightning_4d.mixin import FourDModule
from lightning_4d.parallelize import apply_layout, plan_layout
from lightning_4d.strategy import FourDStrategy

import lightning_4d.callbacks.summary  # noqa: E402,F401  (registers the whole-model summary with the strategy)

__all__ = ["Axis", "FourDConfig", "FourDMesh", "FourDModule", "FourDStrategy", "LayoutPlan", "ParallelDims",
           "apply_layout", "build_mesh", "load_plan", "plan_layout"]
__version__ = "0.1.0"
