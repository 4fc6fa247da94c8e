"""A mesh of sizes alone, for asking on one process whether the engine runs a layout (`SimulatedMesh`).

The planner (`planning/memory_planner.py`) estimates and proposes only the layouts the engine's own validation
accepts over this mesh (a family door's: `frontends/family_request.validate_family_request`), so each rule (the
family's capabilities and its own model check, the plan, the pipeline split, context and expert parallelism, data
parallelism) is written once, in the engine's checks. A meta model is enough: validation reads shapes and
structure, changes nothing and makes no process group.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..mesh import SimulatedMesh


def layout_mesh(sizes: Mapping[str, int]) -> SimulatedMesh:
    """A mesh of `sizes` ({dim: size} over dp, pp, cp, tp and ep; a missing dim is 1) with no process group: what
    the checks read of a mesh (its sizes, dp x cp, ep, the device type). ValueError if ep does not divide dp x cp."""
    rest = {dim: size for dim, size in sizes.items() if dim != "tp"}
    return SimulatedMesh(sizes.get("tp", 1), sizes=rest)
