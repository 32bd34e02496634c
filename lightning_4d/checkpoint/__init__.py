"""Sharded DCP checkpoints, exact resume, resharding and consolidated export / import.

Example:
    >>> from lightning_4d.checkpoint import export_consolidated, import_consolidated
"""

from lightning_4d.checkpoint.consolidate import export_consolidated, import_consolidated, read_model_state
from lightning_4d.checkpoint.state import check_checkpoint, is_checkpoint, load_sharded, save_sharded

__all__ = ["check_checkpoint", "export_consolidated", "import_consolidated", "is_checkpoint", "load_sharded",
           "read_model_state", "save_sharded"]
