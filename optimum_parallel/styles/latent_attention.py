"""Multi-head latent attention (DeepSeek-V2's MLA: deepseek_v2, glm4_moe_lite, longcat_flash): the kv down-projection
`kv_a_proj_with_mqa` stays whole, its output [kv latent | shared rope key] read by every head."""

from __future__ import annotations

import torch
from torch import nn

from ..comm.autograd_collectives import copy_to_tensor_parallel_region
from .base import ParallelStyle


class LatentKeyValueProjection(ParallelStyle):
    """Keep the projection whole; sum over tp the gradient of its last `rope_dim` output features.

    The latent (the first features) goes through a norm over the whole latent into `kv_b_proj`, column-split by heads,
    whose entry already sums its gradient over tp. The rope key (the last `rope_dim` features) goes straight to the
    attention of this rank's heads: each rank holds only its heads' share of that gradient, summed here.
    """

    allowed_modules = (nn.Linear,)

    def __init__(self, rope_dim: int) -> None:
        if not isinstance(rope_dim, int) or isinstance(rope_dim, bool) or rope_dim <= 0:
            raise ValueError(f"LatentKeyValueProjection(rope_dim={rope_dim!r}): allowed: a positive int")
        self.rope_dim = rope_dim

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        if module.out_features <= self.rope_dim:
            raise ValueError(
                f"LatentKeyValueProjection on {name!r}: rope_dim={self.rope_dim} leaves no latent of its "
                f"{module.out_features} output features; allowed: rope_dim < {module.out_features}"
            )

    def apply(self, module, name, ctx):
        group, rope_dim = ctx.mesh.tp_group, self.rope_dim

        def sum_rope_gradient(module, args, output: torch.Tensor) -> torch.Tensor:
            latent, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
            return torch.cat([latent, copy_to_tensor_parallel_region(rope, group)], dim=-1)

        module.register_forward_hook(sum_rope_gradient)
        return module
