"""A module's own parameter split over tp, for per-head parameters that sit beside head-split projections."""

from __future__ import annotations

from torch import nn

from ..tensor_parallel.spec import ShardSpec, shard_parameter
from .base import ParallelStyle, check_style_heads


class SplitParameter(ParallelStyle):
    """Split the module's own parameter `param` along `dim` over tp, in whole `units` (heads; None: in rows).

    For a parameter with one entry per attention head (gpt_oss's attention `sinks`) next to a column-parallel q
    projection split in the same heads: each rank keeps its heads' entries, so its gradient is its own, whole.
    """

    def __init__(self, param: str, dim: int = 0, units: int | None = None) -> None:
        self.param, self.dim, self.units = param, dim, units

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        param = module._parameters.get(self.param)
        if not isinstance(param, nn.Parameter) or not -param.dim() <= self.dim < param.dim():
            raise ValueError(
                f"SplitParameter({self.param!r}, dim={self.dim}) on {name!r}: no parameter {self.param!r} with that "
                f"dim; allowed: its own parameters {sorted(module._parameters)}"
            )
        size = param.shape[self.dim]
        if self.units is not None and size % self.units:
            raise ValueError(f"{name}.{self.param}: dim {self.dim} of size {size} is not {self.units} whole units")
        check_style_heads(self.units or size, ctx.mesh.tp_size, f"{name}.{self.param}", allow_replication=False)

    def param_specs(self, module):
        param = getattr(module, self.param)
        return {self.param: ShardSpec.split(param.shape, self.dim % param.dim(), self.units)}

    def apply(self, module, name, ctx):
        rank, world = ctx.tp_rank_world
        shard_parameter(module, self.param, self.param_specs(module)[self.param], rank, world)
        return module
