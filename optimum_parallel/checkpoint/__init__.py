"""Sharded safetensors checkpoints: save, load, consolidate, reshard.

(Stub: filled in by the checkpoint work.)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def save_model_checkpoint(
    model: nn.Module,
    output_dir: str | Path,
    as_regular: bool = False,
    as_sharded: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    raise NotImplementedError("sharded checkpoints are not available yet")


def load_model_checkpoint(model: nn.Module, load_dir: str | Path) -> None:
    raise NotImplementedError("sharded checkpoints are not available yet")


def consolidate_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path) -> None:
    """Sharded checkpoint -> plain Hugging Face checkpoint, streaming tensor by tensor."""
    raise NotImplementedError("consolidation is not available yet")


def reshard_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path, tp: int, pp: int = 1) -> None:
    """Sharded checkpoint -> sharded checkpoint at another layout (optimizer state included)."""
    raise NotImplementedError("resharding is not available yet")
