"""The process grid: a table of dims (`layout`), one protocol (`ParallelMesh`) over a torch DeviceMesh (`TorchMesh`)
or torch-xla's replica groups (`XlaParallelMesh`), the device module (`device`), the process groups' timeouts
(`timeouts`: long while ranks may drift apart, shorter once training runs), and a sizes-only mesh for planning."""

from .init import DEFAULT_TIMEOUT, get_mesh, init_mesh, set_mesh
from .layout import GRID_DIMS, MeshLayout, check_expert_parallel_size, check_positive_int
from .protocol import ParallelMesh
from .simulated import SimulatedMesh
from .timeouts import Timeouts

__all__ = [
    "DEFAULT_TIMEOUT",
    "GRID_DIMS",
    "MeshLayout",
    "ParallelMesh",
    "SimulatedMesh",
    "Timeouts",
    "check_expert_parallel_size",
    "check_positive_int",
    "get_mesh",
    "init_mesh",
    "set_mesh",
]
