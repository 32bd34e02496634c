"""lightning_4d: 4D parallelism (TP/SP, PP, EP, DP) for any PyTorch Lightning model.

Example:
    >>> import lightning as L
    >>> from lightning_4d import FourDStrategy
    >>> # not run: needs a Trainer
    >>> trainer = L.Trainer(strategy=FourDStrategy(tp=2, pp=2), devices=8)  # doctest: +SKIP
"""

from lightning_4d.config import FourDConfig
from lightning_4d.core.optim import mesh_param_groups
from lightning_4d.plan import LayoutPlan, load_plan
from lightning_4d.mesh import Axis, FourDMesh, ParallelDims, build_mesh
from lightning_4d.mixin import FourDModule
from lightning_4d.layout.parallelize import apply_layout, plan_layout
from lightning_4d.strategy import FourDStrategy

import lightning_4d.callbacks.summary  # noqa: E402,F401  (registers the whole-model summary with the strategy)
import lightning_4d.fabric  # noqa: E402,F401  (registers strategy="fourd" with Lightning Fabric)
from lightning_4d._compat.moved import install as _install_moved  # noqa: E402

_install_moved()  # the pre-0.2 module names (lightning_4d.trace, ...) import for one more release, with a warning

__all__ = ["Axis", "FourDConfig", "FourDMesh", "FourDModule", "FourDStrategy", "LayoutPlan", "ParallelDims",
           "apply_layout", "build_mesh", "load_plan", "mesh_param_groups", "plan_layout"]
__version__ = "0.1.0"
