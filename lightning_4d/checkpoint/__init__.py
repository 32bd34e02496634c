"""Sharded DCP checkpoints (written at once or in the background), exact resume, resharding and consolidated
export / import.

Example:
    >>> from lightning_4d.checkpoint import export_consolidated, export_hf, import_consolidated
"""

from lightning_4d.checkpoint.consolidate import export_consolidated, import_consolidated, read_model_state
from lightning_4d.checkpoint.hf_export import export_hf
from lightning_4d.checkpoint.latest import find_checkpoints, latest_checkpoint
from lightning_4d.checkpoint.state import (CheckpointIntegrityError, CheckpointSaveError, check_checkpoint,
                                           is_checkpoint, load_sharded, recover_checkpoint, save_sharded,
                                           verify_checkpoint)

__all__ = ["CheckpointIntegrityError", "CheckpointSaveError", "check_checkpoint", "export_consolidated", "export_hf",
           "find_checkpoints", "import_consolidated", "is_checkpoint", "latest_checkpoint", "load_sharded",
           "read_model_state", "recover_checkpoint", "save_sharded", "verify_checkpoint"]
