"""Column- and row-wise splits of Linear and Embedding modules (and the embedding-shaped special cases)."""

from __future__ import annotations

from torch import nn

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..tensor_parallel.spec import ShardSpec, shard_parameter
from .base import COLUMN, ROW, HeadSplitStyle, ParallelStyle


class ColWiseParallel(HeadSplitStyle):
    """Split a Linear's output features (torch weight dim 0) over tp.

    units: split in whole blocks (attention heads); fewer heads than ranks replicates each head
    over tp/heads ranks and sums their gradients. gather_output: all-gather the output features.
    """

    allowed_modules = (nn.Linear,)
    swaps_module = True
    builds = COLUMN
    replicates_heads = True

    def __init__(self, gather_output: bool = False, units: int | None = None) -> None:
        self.gather_output, self.units = gather_output, units

    def param_specs(self, module):
        specs = {"weight": ShardSpec.split(module.weight.shape, 0, self.units)}
        if module.bias is not None:
            specs["bias"] = ShardSpec.split(module.bias.shape, 0, self.units)
        return specs

    def apply(self, module, name, ctx):
        tp = ctx.mesh.tp_size
        replica_group = None
        if self.units is not None and self.units < tp:
            replica_group = ctx.mesh.subgroups("tp", self.units)
        return ColumnParallelLinear.from_linear(
            module, ctx.mesh.tp_group, self.units, self.gather_output, ctx.wiring(name), replica_group=replica_group
        )


class RowWiseParallel(HeadSplitStyle):
    """Split a Linear's input features (torch weight dim 1), or an Embedding's rows (the vocabulary)."""

    allowed_modules = (nn.Linear, nn.Embedding)
    swaps_module = True
    builds = ROW

    def __init__(self, input_is_parallel: bool = True, units: int | None = None) -> None:
        self.input_is_parallel, self.units = input_is_parallel, units

    def param_specs(self, module):
        if isinstance(module, nn.Embedding):
            return {"weight": ShardSpec.split(module.weight.shape, 0)}
        specs = {"weight": ShardSpec.split(module.weight.shape, 1, self.units)}
        if module.bias is not None:
            specs["bias"] = ShardSpec(module.bias.shape)
        return specs

    def apply(self, module, name, ctx):
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding.from_embedding(module, ctx.mesh.tp_group, ctx.wiring(name))
        return RowParallelLinear.from_linear(
            module, ctx.mesh.tp_group, self.units, self.input_is_parallel, ctx.wiring(name)
        )


class LocalColWiseEmbedding(HeadSplitStyle):
    """Split an Embedding's columns (dim 1) in whole `units` and keep its output split: no communication.

    For per-head tables such as T5's relative attention bias (buckets x heads): each rank looks up
    the bias of its own heads only.
    """

    swaps_module = True

    allowed_modules = (nn.Embedding,)

    def param_specs(self, module):
        return {"weight": ShardSpec.split(module.weight.shape, 1, self.units)}

    def apply(self, module, name, ctx):
        rank, world = ctx.tp_rank_world
        weight = shard_parameter(module, "weight", self.param_specs(module)["weight"], rank, world)
        module.embedding_dim = weight.shape[1]
        return module


class TiedBiasColWiseParallel(ParallelStyle):
    """Column-split the Linear `child` of an MLM head whose output bias is tied to the head's own `bias`
    (BERT's `cls.predictions`, RoBERTa's `lm_head`), keeping the tie; the logits are gathered by default
    because those models compute their loss on full logits."""

    swaps_module = True
    builds = COLUMN

    def __init__(self, child: str = "decoder", bias: str = "bias", gather_output: bool = True) -> None:
        self.child, self.bias, self.gather_output = child, bias, gather_output

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        if not isinstance(getattr(module, self.child, None), nn.Linear):
            raise ValueError(f"TiedBiasColWiseParallel on {name!r}: no Linear child named {self.child!r}")

    def param_specs(self, module):
        linear = getattr(module, self.child)
        specs = {f"{self.child}.weight": ShardSpec.split(linear.weight.shape, 0)}
        if linear.bias is not None:
            specs[f"{self.child}.bias"] = ShardSpec.split(linear.bias.shape, 0)
            if getattr(module, self.bias, None) is linear.bias:
                specs[self.bias] = specs[f"{self.child}.bias"]
        return specs

    def apply(self, module, name, ctx):
        linear = getattr(module, self.child)
        tied = linear.bias is not None and getattr(module, self.bias, None) is linear.bias
        new = ColumnParallelLinear.from_linear(linear, ctx.mesh.tp_group, None, self.gather_output, ctx.wiring(name))
        new.train(linear.training)
        setattr(module, self.child, new)
        if tied:
            setattr(module, self.bias, new.bias)
        return module
