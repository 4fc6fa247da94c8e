"""The process grid: named dp/pp/cp/tp dims over a DeviceMesh (`ParallelMesh`); a one-process stand-in for plans."""

from .parallel_mesh import DEFAULT_TIMEOUT, MESH_DIMS, ParallelMesh, check_positive_int, get_mesh, init_mesh, set_mesh
from .simulated import SimulatedMesh

__all__ = [
    "DEFAULT_TIMEOUT",
    "MESH_DIMS",
    "ParallelMesh",
    "check_positive_int",
    "SimulatedMesh",
    "get_mesh",
    "init_mesh",
    "set_mesh",
]
