"""Column/row-parallel versions of transformers' `Conv1D` (GPT-2's linear layer, weight stored [in, out]).

The weight keeps its HF orientation, so state-dict keys and shapes stay those of the checkpoint:
column-parallel splits weight dim 1 (and the bias), row-parallel splits weight dim 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.tp_entry import LayerWiring
from .layers import _exit_region, _ShardedModule
from .packed_linear import ReplicatedSegment, sum_segment_grads

try:  # transformers is a dependency; keep the engine importable without it all the same
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    Conv1D = None

CONV1D_TYPES: tuple[type, ...] = (Conv1D,) if Conv1D is not None else ()


class ColumnParallelConv1D(_ShardedModule):
    """y_local = x W[:, local] + b[local]; the output features stay split (packed parts allowed, their
    replicated heads have their gradients summed over the replicas)."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: ProcessGroup,
        segments: Sequence[tuple[ReplicatedSegment, ProcessGroup]] = (),
        wiring: LayerWiring | None = None,
    ) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group = group
        self.segments = tuple(segments)
        self.wiring = wiring or LayerWiring()
        self.nx = weight.shape[0]
        self.nf = weight.shape[1]  # local output features, as HF's Conv1D names them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wiring.entry is not None:
            x = self.wiring.entry(x, self.group, self.wiring.splits_sequence())
        weight = sum_segment_grads(self.weight, 1, self.segments)
        bias = sum_segment_grads(self.bias, 0, self.segments) if self.bias is not None else None
        size_out = x.shape[:-1] + (self.nf,)
        flat = x.reshape(-1, x.shape[-1])
        y = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
        return y.view(size_out)

    def extra_repr(self) -> str:
        return f"nx={self.nx}, nf={self.weight.shard_layout.global_shape[1]} (local {self.nf})"


class RowParallelConv1D(_ShardedModule):
    """y = sum_ranks x_local W[local, :] + b: the input features are split; the output is all-reduced."""

    def __init__(
        self, weight: nn.Parameter, bias: nn.Parameter | None, group: ProcessGroup, wiring: LayerWiring | None = None
    ) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group = group
        self.wiring = wiring or LayerWiring()
        self.nx = weight.shape[0]  # local input features
        self.nf = weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.shape[:-1] + (self.nf,)
        y = (x.reshape(-1, x.shape[-1]) @ self.weight).view(size_out)
        return _exit_region(y, self.group, self.wiring.splits_sequence(), self.bias)

    def extra_repr(self) -> str:
        return f"nx={self.weight.shard_layout.global_shape[0]} (local {self.nx}), nf={self.nf}"
