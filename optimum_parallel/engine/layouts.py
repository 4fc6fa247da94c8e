"""A mesh of sizes alone, for asking on one process whether the engine runs a layout (`SimulatedMesh`).

The planner (`memory_planner/estimate.py`) estimates and proposes only the layouts that `checks.validate` (with the
family's part) accepts over this mesh, so each rule is written once, in the engine's checks. A meta model is enough:
validation reads shapes and structure, changes nothing and makes no process group.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..mesh import SimulatedMesh


def layout_mesh(sizes: Mapping[str, int]) -> SimulatedMesh:
    """A mesh of `sizes` ({dim: size} over dp, pp, cp, tp and ep; a missing dim is 1) with no process group: what
    the checks read of a mesh (its sizes, dp x cp, ep, the device type). ValueError if ep does not divide dp x cp."""
    rest = {dim: size for dim, size in sizes.items() if dim != "tp"}
    return SimulatedMesh(sizes.get("tp", 1), sizes=rest)
