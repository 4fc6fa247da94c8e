"""Whether the engine runs a layout, asked on one process: `validate` over a mesh of sizes alone (`SimulatedMesh`).

The planner (`planning/memory_planner.py`) estimates and proposes only the layouts `check_layout` accepts, so
each rule (the family's capabilities and its own model check, the plan, the pipeline split, context and expert
parallelism, data parallelism) is written once, in the checks `validate` runs. A meta model is enough: validation
reads shapes and structure, changes nothing and makes no process group.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..mesh import SimulatedMesh
from .request import CheckedRequest, ParallelRequest
from .validate import validate


def layout_mesh(sizes: Mapping[str, int]) -> SimulatedMesh:
    """A mesh of `sizes` ({dim: size} over dp, pp, cp, tp and ep; a missing dim is 1) with no process group: what
    the checks read of a mesh (its sizes, dp x cp, ep, the device type). ValueError if ep does not divide dp x cp."""
    rest = {dim: size for dim, size in sizes.items() if dim != "tp"}
    return SimulatedMesh(sizes.get("tp", 1), sizes=rest)


def check_layout(request: ParallelRequest, model: nn.Module, sizes: Mapping[str, int]) -> CheckedRequest:
    """Raise the error `validate` raises for `request` on `model` over a mesh of `sizes`, else return what it returns.
    The capabilities are the ones `validate` resolves: `request.family`'s for this model, else the model's
    structure's (`structure.derive_capabilities`), as for every front door's request."""
    return validate(request, model, layout_mesh(sizes))
