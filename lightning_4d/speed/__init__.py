"""Speed features: per-block ``torch.compile`` (:mod:`.compile`) and torchao's Float8 training (:mod:`.float8`).

Example:
    >>> from lightning_4d.speed import compile_backend
    >>> compile_backend(True)
    'inductor'
"""

from lightning_4d.speed.compile import apply_compile, check_compile, compile_backend, compiled_mode
from lightning_4d.speed.float8 import FLOAT8_RECIPES, check_float8, float8_linear_names

__all__ = ["FLOAT8_RECIPES", "apply_compile", "check_compile", "check_float8", "compile_backend", "compiled_mode",
           "float8_linear_names"]
