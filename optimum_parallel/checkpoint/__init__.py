"""Sharded safetensors checkpoints: save, load, verify, consolidate, reshard.

A checkpoint directory is self-describing (see `metadata.py`): consolidation and resharding are
pure CPU functions of its files, and loading checks every byte against the index.
"""

from ..io.errors import CheckpointError
from .async_save import AsyncCheckpoint, wait_for_pending_save
from .consolidate import consolidate_checkpoint
from .integrity import verify_checkpoint
from .latest import find_last_checkpoint
from .load import load_model_checkpoint
from .metadata import CheckpointIndex, read_index
from .reshard import reshard_checkpoint
from .save import save_model_checkpoint

__all__ = [
    "AsyncCheckpoint",
    "CheckpointError",
    "CheckpointIndex",
    "consolidate_checkpoint",
    "find_last_checkpoint",
    "load_model_checkpoint",
    "read_index",
    "reshard_checkpoint",
    "save_model_checkpoint",
    "verify_checkpoint",
    "wait_for_pending_save",
]
