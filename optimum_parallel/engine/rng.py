"""Which layers bound the split regions whose random numbers each tp rank draws on its own (tensor_parallel/random.py):
from a column-parallel layer's output (not gathered, not the LM head's logits) to the next row-parallel layer."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..mesh import ParallelMesh
from ..plan.wrappers import unwrap
from ..styles.base import COLUMN, ROW
from ..tensor_parallel.random import SplitRegions, share_rng_states


def install_tp_random(model: nn.Module, mesh: ParallelMesh, layers: Mapping[str, str] | None) -> SplitRegions | None:
    """The tp ranks share the default streams (replicated work draws the same masks); split work draws from streams
    of its own per rank. `layers`: the plan's tensor-parallel layers (None: no plan, nothing to do)."""
    if layers is None or mesh.size("tp") == 1:
        return None
    share_rng_states(mesh.tp_group)
    return install_split_regions(model, layers, mesh.rank("tp"))


def install_split_regions(model: nn.Module, layers: Mapping[str, str], tp_rank: int) -> SplitRegions:
    """`layers`: {module name: COLUMN or ROW} of the tensor-parallel layers the plan built in `model`."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    modules = dict(model.named_modules())
    columns = [
        modules[name]
        for name, kind in layers.items()
        if kind == COLUMN and modules[name] is not head and not getattr(unwrap(modules[name]), "gather_output", False)
    ]
    rows = [modules[name] for name, kind in layers.items() if kind == ROW]
    regions = SplitRegions(tp_rank)
    regions.install(model, columns, rows)
    return regions
