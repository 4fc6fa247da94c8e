"""The region ops as torch custom ops, for code that torch.compile traces (a compiled decoder block).

Each of Megatron's conjugate pairs (`autograd_collectives.py`) is one custom op whose backward is the other op of its
pair: `enter` / `reduce`, `gather` / `scatter`, `sequence_gather` / `sequence_reduce_scatter`, and `all_to_all` (its
own inverse). `merge_entries` folds the region entries of one tensor into one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ..mesh import ranks
from . import collectives

_LIB = "optimum_parallel"


def group_name(group: ProcessGroup) -> str:
    """The name a compiled graph carries for `group`."""
    return group.group_name


def _group(name: str) -> ProcessGroup:
    return torch._C._distributed_c10d._resolve_process_group(name)


def _sizes(x: Tensor, dim: int, name: str, sizes: list[int] | None) -> list[int]:
    if sizes:
        return list(sizes)
    world = ranks.world_size(_group(name))
    length = x.shape[dim]
    return [length // world + (r < length % world) for r in range(world)]


def _fresh(out: Tensor, x: Tensor) -> Tensor:
    """`out`, copied where it shares `x`'s memory (a custom op's output may not alias its input)."""
    same = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return out.clone(memory_format=torch.contiguous_format) if same else out


def _reshaped(x: Tensor, dim: int, length) -> Tensor:
    shape = list(x.shape)
    shape[dim] = length
    return x.new_empty(shape)


# -- the ops ------------------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_LIB}::enter", mutates_args=())
def enter(x: Tensor, group: str) -> Tensor:
    """Identity forward, all-reduce of the gradient backward (`copy_to_tensor_parallel_region`)."""
    return x.clone()


@torch.library.custom_op(f"{_LIB}::reduce", mutates_args=())
def reduce(x: Tensor, group: str) -> Tensor:
    """All-reduce forward, identity backward (`reduce_from_tensor_parallel_region`)."""
    return collectives.all_reduce(x.clone(memory_format=torch.contiguous_format), _group(group))


@torch.library.custom_op(f"{_LIB}::gather", mutates_args=())
def gather(x: Tensor, dim: int, group: str, sizes: list[int] | None) -> Tensor:
    """All-gather `dim` forward (uneven shards by `sizes`), this rank's slice backward."""
    return _fresh(collectives.all_gather(x, dim, _group(group), list(sizes) if sizes else None), x)


@torch.library.custom_op(f"{_LIB}::scatter", mutates_args=())
def scatter(x: Tensor, dim: int, group: str, sizes: list[int] | None) -> Tensor:
    """This rank's slice of `dim` forward, all-gather backward."""
    return _fresh(collectives.split(x, dim, _group(group), list(sizes) if sizes else None), x)


@torch.library.custom_op(f"{_LIB}::sequence_gather", mutates_args=())
def sequence_gather(x: Tensor, dim: int, group: str) -> Tensor:
    """All-gather of the sequence forward, reduce-scatter backward (the entry under sequence parallelism)."""
    return _fresh(collectives.all_gather(x, dim, _group(group)), x)


@torch.library.custom_op(f"{_LIB}::sequence_reduce_scatter", mutates_args=())
def sequence_reduce_scatter(x: Tensor, dim: int, group: str) -> Tensor:
    """Reduce-scatter of the sequence forward, all-gather backward (a row layer's exit under sequence
    parallelism)."""
    return _fresh(collectives.reduce_scatter(x.contiguous(), dim, _group(group)), x)


@torch.library.custom_op(f"{_LIB}::all_to_all", mutates_args=())
def all_to_all(x: Tensor, group: str) -> Tensor:
    """`dist.all_to_all_single` of equal splits along dim 0 (its own inverse: the backward is the same op)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=_group(group))
    return out


# -- shapes (fake tensors) -------------------------------------------------------------------------------------------


@enter.register_fake
def _(x, group):
    return torch.empty_like(x)


@reduce.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@gather.register_fake
def _(x, dim, group, sizes):
    dim = dim % x.dim()
    total = sum(sizes) if sizes else x.shape[dim] * ranks.world_size(_group(group))
    return _reshaped(x, dim, total)


@scatter.register_fake
def _(x, dim, group, sizes):
    dim = dim % x.dim()
    return _reshaped(x, dim, _sizes(x, dim, group, sizes)[ranks.rank(_group(group))])


@sequence_gather.register_fake
def _(x, dim, group):
    dim = dim % x.dim()
    return _reshaped(x, dim, x.shape[dim] * ranks.world_size(_group(group)))


@sequence_reduce_scatter.register_fake
def _(x, dim, group):
    dim = dim % x.dim()
    return _reshaped(x, dim, x.shape[dim] // ranks.world_size(_group(group)))


@all_to_all.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# -- gradients: each op's backward is the other op of its pair ---------------------------------------------------


def _keep(ctx, inputs, output):
    ctx.args = inputs[1:]


def _enter_backward(ctx, grad):
    return reduce(grad, ctx.args[0]), None


def _reduce_backward(ctx, grad):
    return grad, None


def _gather_backward(ctx, grad):
    dim, group, sizes = ctx.args
    return scatter(grad, dim, group, sizes), None, None, None


def _scatter_backward(ctx, grad):
    dim, group, sizes = ctx.args
    return gather(grad, dim, group, sizes), None, None, None


def _sequence_gather_backward(ctx, grad):
    dim, group = ctx.args
    return sequence_reduce_scatter(grad, dim, group), None, None


def _sequence_reduce_scatter_backward(ctx, grad):
    dim, group = ctx.args
    return sequence_gather(grad, dim, group), None, None


def _all_to_all_backward(ctx, grad):
    return all_to_all(grad, ctx.args[0]), None


enter.register_autograd(_enter_backward, setup_context=_keep)
reduce.register_autograd(_reduce_backward, setup_context=_keep)
gather.register_autograd(_gather_backward, setup_context=_keep)
scatter.register_autograd(_scatter_backward, setup_context=_keep)
sequence_gather.register_autograd(_sequence_gather_backward, setup_context=_keep)
sequence_reduce_scatter.register_autograd(_sequence_reduce_scatter_backward, setup_context=_keep)
all_to_all.register_autograd(_all_to_all_backward, setup_context=_keep)

ENTRIES = (torch.ops.optimum_parallel.enter.default, torch.ops.optimum_parallel.sequence_gather.default)


def merge_entries(graph: torch.fx.Graph) -> int:
    """Fold the region entries of one tensor into the first (the same op, the same arguments): the layers reading it
    share one collective each way, whatever traced them. Every rank traces the same program and merges alike.
    Returns how many were folded."""
    seen: dict[tuple, torch.fx.Node] = {}
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in ENTRIES:
            continue
        key = (node.target, node.args, tuple(sorted(node.kwargs.items())))
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            folded += 1
    return folded
