"""`validate(request, model, mesh)`: resolve, then check (`resolve.py`, `checks.py`); the name the doors call."""

from __future__ import annotations

from torch import nn

from ..mesh import ParallelMesh
from .checks import SCHEDULES, SHARDING_LEVELS, check, check_data_parallel, check_settings, mesh_layout
from .request import ParallelRequest, ResolvedRequest
from .resolve import resolve


def validate(request: ParallelRequest, model: nn.Module, mesh: ParallelMesh) -> ResolvedRequest:
    """Raise if any step of `compose` would refuse `request` on `model` over `mesh`; change nothing. Returns what
    the steps apply (`resolve`'s decisions, checked)."""
    resolved = resolve(request, model, mesh)
    check(resolved, model, mesh)
    return resolved


__all__ = ["SCHEDULES", "SHARDING_LEVELS", "check_data_parallel", "check_settings", "mesh_layout", "validate"]
