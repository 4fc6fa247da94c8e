"""Every rank's random generator states, in its own small file of a sharded checkpoint, so that a resume with dropout
on draws the masks the uninterrupted run would have drawn.

The default generators are what is saved (the CPU's and the accelerator's): tensor-parallel split regions draw from
streams seeded from them (`tensor_parallel/random.py`), so they follow. A checkpoint loaded on another number of
ranks leaves the generators as they are (there is no rank to take them from).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from ..mesh import device as devices

PREFIX = "rng-"


def rng_file(global_rank: int) -> str:
    return f"{PREFIX}{global_rank:05d}.pt"


def rng_bytes() -> bytes:
    """This rank's generator states, serialized (taken now: in the step for an asynchronous save)."""
    buffer = io.BytesIO()
    torch.save(devices.rng_states(), buffer)
    return buffer.getvalue()


def restore_rng(directory: Path, global_rank: int, world: int) -> bool:
    """Restore this rank's states from `directory` when it holds one file per rank of this world; whether it did."""
    files = list(directory.glob(f"{PREFIX}*.pt"))
    path = directory / rng_file(global_rank)
    if len(files) != world or not path.exists():
        return False
    devices.set_rng_states(torch.load(path, weights_only=True))
    return True
