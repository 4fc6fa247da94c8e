"""Column/row-parallel Linear and vocab-parallel Embedding on local tensors (Megatron style).

Each layer holds only this rank's shard; every parameter carries its `ShardLayout` as
`param.shard_layout`, so checkpoints, lazy loading and resharding never have to guess. How a layer meets its
neighbours (its region entry, sequence parallelism, overlap) is its `wiring` (`comm/tp_entry.py`), decided with the plan
(`plan/wiring.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.autograd_collectives import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from ..comm.tp_entry import LayerWiring
from ..mesh import device as devices
from ..mesh import ranks
from .spec import ShardSpec, local_parameter, shard_sizes


def _exit_region(
    y: torch.Tensor, group: ProcessGroup, sequence_parallel: bool, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The partial sums `y` all-reduced (reduce-scattered over the sequence under sequence parallelism), plus the
    whole `bias`, added once. On a slice of the sequence each rank's bias gradient holds only its positions: the bias
    then enters through an identity whose backward sums it over tp."""
    if sequence_parallel:  # inside a split sequence: reduce-scatter (a forward that keeps it whole all-reduces)
        y = reduce_scatter_to_sequence_parallel_region(y, group)
        return y if bias is None else y + copy_to_tensor_parallel_region(bias, group)
    y = reduce_from_tensor_parallel_region(y, group)
    return y if bias is None else y + bias


class _ShardedModule(nn.Module):
    in_features: int  # global sizes (the local ones are the weight's shape)
    out_features: int

    @property
    def input_size(self) -> int:
        """Megatron's name for the global input size (PEFT sizes adapters by it)."""
        return self.in_features

    @property
    def output_size(self) -> int:
        """Megatron's name for the global output size."""
        return self.out_features


class ColumnParallelLinear(_ShardedModule):
    """y_local = x W_local^T + b_local: the output features are split over the tp group.

    `gather_output` all-gathers the output features; otherwise the output stays split (the next
    layer is row-parallel, or the loss is vocab-parallel). The input enters the tp region through `wiring.entry`
    (shared with the sibling layers reading the same input), unless the caller entered it already.
    """

    defers_weight_grads = True  # its weight gradient may be computed during the entry's backward collective

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: ProcessGroup,
        gather_output: bool = False,
        wiring: LayerWiring | None = None,
        replica_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group = group
        self.gather_output = gather_output
        self.wiring = wiring or LayerWiring()
        if self.wiring.siblings is not None:
            self.wiring.siblings.layers.append(self)
        self.replica_group = replica_group  # tp ranks holding this same shard: their gradients are summed
        self.in_features = weight.shape[1]
        self.out_features = weight.shard_layout.global_shape[0]

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group: ProcessGroup,
        units: int | None = None,
        gather_output: bool = False,
        wiring: LayerWiring | None = None,
        replica_group: ProcessGroup | None = None,
    ) -> ColumnParallelLinear:
        rank, world = ranks.rank(group), ranks.world_size(group)
        layout = ShardSpec.split(linear.weight.shape, 0, units).local(rank, world)
        if layout.replicas > 1 and replica_group is None:
            raise ValueError("a replicated column shard needs the group of its replicas to sum gradients")
        weight = local_parameter(linear.weight, layout, linear.weight.requires_grad)
        bias = None
        if linear.bias is not None:
            bias_layout = ShardSpec.split(linear.bias.shape, 0, units).local(rank, world)
            bias = local_parameter(linear.bias, bias_layout, linear.bias.requires_grad)
        return cls(weight, bias, group, gather_output, wiring, replica_group if layout.replicas > 1 else None)

    @property
    def output_sizes(self) -> list[int]:
        return shard_sizes(self.out_features, ranks.world_size(self.group))

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """All-gather split outputs (e.g. vocab-parallel logits) into the full feature dim."""
        return gather_from_tensor_parallel_region(y, self.group, dim=-1, sizes=self.output_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.replica_group is not None:  # identity forward, gradient summed over the replicas backward
            weight = copy_to_tensor_parallel_region(weight, self.replica_group)
            bias = copy_to_tensor_parallel_region(bias, self.replica_group) if bias is not None else None
        entry = self.wiring.entry
        y = entry.linear(self, x, weight, bias) if entry is not None else F.linear(x, weight, bias)
        return self.gather(y) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(_ShardedModule):
    """y = sum_ranks x_local W_local^T + b: the input features are split; the output is all-reduced
    (or reduce-scattered over the sequence under sequence parallelism). The bias is added once."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: ProcessGroup,
        input_is_parallel: bool = True,
        wiring: LayerWiring | None = None,
    ) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group = group
        self.input_is_parallel = input_is_parallel
        self.wiring = wiring or LayerWiring()
        self.in_features = weight.shard_layout.global_shape[1]
        self.out_features = weight.shape[0]

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group: ProcessGroup,
        units: int | None = None,
        input_is_parallel: bool = True,
        wiring: LayerWiring | None = None,
    ) -> RowParallelLinear:
        rank, world = ranks.rank(group), ranks.world_size(group)
        layout = ShardSpec.split(linear.weight.shape, 1, units).local(rank, world)
        if layout.replicas > 1:
            raise ValueError(f"row-parallel input of {units} units cannot be split over {world} ranks")
        weight = local_parameter(linear.weight, layout, linear.weight.requires_grad)
        bias = None
        if linear.bias is not None:
            bias = local_parameter(
                linear.bias, ShardSpec(linear.bias.shape).local(rank, world), linear.bias.requires_grad
            )
        return cls(weight, bias, group, input_is_parallel, wiring)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(
                x, self.group, dim=-1, sizes=shard_sizes(self.in_features, ranks.world_size(self.group))
            )
        return _exit_region(F.linear(x, self.weight), self.group, self.wiring.splits_sequence(), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(_ShardedModule):
    """Embedding whose rows (the vocabulary) are split over the tp group; uneven splits allowed.

    Each rank looks up the ids it owns, zeros the rest, and the partial outputs are all-reduced
    (reduce-scattered over the sequence under sequence parallelism).
    """

    def __init__(
        self,
        weight: nn.Parameter,
        group: ProcessGroup,
        padding_idx: int | None = None,
        wiring: LayerWiring | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.group = group
        self.wiring = wiring or LayerWiring()
        self.num_embeddings, self.embedding_dim = weight.shard_layout.global_shape
        self.vocab_start, self.vocab_end = weight.shard_layout.ranges[0]
        self.padding_idx = padding_idx
        in_shard = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self._local_padding_idx = padding_idx - self.vocab_start if in_shard else None

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, group: ProcessGroup, wiring: LayerWiring | None = None
    ) -> VocabParallelEmbedding:
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding does not support max_norm or sparse embeddings")
        rank, world = ranks.rank(group), ranks.world_size(group)
        layout = ShardSpec.split(embedding.weight.shape, 0).local(rank, world)
        weight = local_parameter(embedding.weight, layout, embedding.weight.requires_grad)
        layer = cls(weight, group, embedding.padding_idx, wiring)
        if hasattr(embedding, "embed_scale"):  # scaled word embeddings (Gemma and friends)
            layer.embed_scale = embedding.embed_scale
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if devices.is_graph_device(input_ids):
            return self._xla_forward(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        return self._finish(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def _xla_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The same with no rank in the graph: the shard's bounds reach the device as data, and the padding row
        (on one rank only) gets no gradient through a mask on the global id instead of a local padding_idx."""
        start = ranks.device_scalar(self.vocab_start, input_ids.device)
        end = ranks.device_scalar(self.vocab_end, input_ids.device)
        outside = (input_ids < start) | (input_ids >= end)
        local_ids = (input_ids - start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)
        if self.padding_idx is not None:
            out = torch.where((input_ids == self.padding_idx).unsqueeze(-1), out.detach(), out)
        return self._finish(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "embed_scale"):
            out = out * self.embed_scale.to(out.dtype)
        return _exit_region(out, self.group, self.wiring.splits_sequence())

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"local rows [{self.vocab_start}, {self.vocab_end}), padding_idx={self.padding_idx}"
        )
