"""The checks and overrides installed once per model so that a parallel model behaves as one device's: the ranks of a
batch replica share one batch (`data_parallel/shared_batch.py`), the copies of every replicated tensor stay equal
(`data_parallel/replica_watch.py`, on a cadence), and `save_pretrained` writes the whole model, as one device would
(`full_model.py`)."""

from __future__ import annotations

from torch import nn

from ..data_parallel.replica_watch import install_replica_watch
from ..data_parallel.shared_batch import install_shared_batch
from ..mesh import ParallelMesh
from .full_model import install_save_pretrained


def install_guards(model: nn.Module, mesh: ParallelMesh, shared_batch: str, installed: bool) -> bool:
    """Install the three on `model` unless `installed` (an earlier composition of it did); returns True."""
    if not installed:
        install_shared_batch(model, mesh, shared_batch)
        install_replica_watch(model, mesh)
        install_save_pretrained(model)
    return True
