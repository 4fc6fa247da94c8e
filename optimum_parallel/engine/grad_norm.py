"""The gradient norm of a parallel model, as one device computes it on the whole model: `grad_norm`, `clip_grad_norm_`.

Every distinct piece of the whole gradient is counted exactly once, by one of the ranks holding it (which one:
docs/module_notes.md, "engine/grad_norm.py"); one all-reduce of one scalar over the world adds the pieces.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..expert_parallel import expert_layout
from ..mesh import ParallelMesh, get_mesh, ranks
from ..mesh import device as devices
from ..mesh.loaded import is_dtensor, local_tensor
from ..plan.wrappers import plan_root
from ..state import find_state


def grad_norm(model: nn.Module, norm_type: float = 2.0, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The `norm_type`-norm of the whole model's gradient (parameters without a gradient are left out), equal on
    every rank to torch's `get_total_norm` over the single-device model's gradients. No value is read on the host."""
    norm_type = _check_norm_type(norm_type)
    mesh = mesh if mesh is not None else _current_mesh()
    pieces = list(_counted_pieces(model, mesh))
    on_xla = any(devices.is_graph_device(piece) for piece, _ in pieces)
    if not on_xla:  # on XLA every rank computes every piece: those another rank counts are weighted 0 below
        pieces = [(piece, True) for piece, counted in pieces if counted]
    if not pieces:
        total = torch.zeros((), device=_device(model))
    else:
        terms = torch.stack(
            [piece.abs().max() if math.isinf(norm_type) else piece.abs().pow(norm_type).sum() for piece, _ in pieces]
        )
        if on_xla:  # the weights reach the device as data: every rank runs the same graph (see `mesh.ranks`)
            terms = terms * ranks.device_vector(tuple(float(counted) for _, counted in pieces), terms.device)
        total = terms.max() if math.isinf(norm_type) else terms.sum()
    if mesh is not None and ranks.world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, mesh: ParallelMesh | None = None
) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) (torch's rule) with the global norm; returns the
    norm before clipping."""
    norm = grad_norm(model, norm_type, mesh)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for param in model.parameters():
        if param.grad is not None:
            local_tensor(param.grad).mul_(coef.to(param.grad.dtype))
    return norm


def _check_norm_type(norm_type: float) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float) or not norm_type > 0:
        raise ValueError(f"norm_type={norm_type!r} is not allowed; allowed: a number > 0, or math.inf")
    return float(norm_type)


def _current_mesh() -> ParallelMesh | None:
    """The mesh set by `init_mesh`, or None on a single process that never set one (torch's norm then)."""
    try:
        return get_mesh()
    except RuntimeError:
        if dist.is_initialized() and ranks.world_size() > 1:
            raise
        return None


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _counted_pieces(model: nn.Module, mesh: ParallelMesh | None):
    """This rank's gradients as local float32 tensors, each with whether this rank counts it: each distinct piece of
    the whole gradient is counted on exactly one rank."""
    if mesh is None:
        yield from ((p.grad.float(), True) for p in model.parameters() if p.grad is not None)
        return
    tp, tp_rank = mesh.size("tp"), mesh.rank("tp")
    first_replica = mesh.data_parallel_rank == 0
    first_expert_group = mesh.data_parallel_rank < mesh.size("ep")  # holds each expert once with the others in it
    state = find_state(plan_root(model))
    pipeline = state.pipeline if state is not None else None
    tied_copy = (
        pipeline.tied if pipeline is not None and pipeline.tied_group is not None and not pipeline.holds_first else None
    )
    for param in model.parameters():
        if param.grad is None:
            continue
        counted = not (tied_copy is not None and param is tied_copy)
        if is_dtensor(param.grad):
            counted = counted and _first_on_replicated_dims(param.grad)
        else:
            counted = counted and (first_expert_group if expert_layout(param) is not None else first_replica)
        piece, mine = _tp_share(param.grad, getattr(param, "shard_layout", None), tp, tp_rank)
        yield piece, counted and mine


def _first_on_replicated_dims(tensor) -> bool:
    """Whether this rank is the first holder of a DTensor's local shard (coordinate 0 on every Replicate dim)."""
    coordinate = tensor.device_mesh.get_coordinate()
    return all(coordinate[dim] == 0 for dim, placement in enumerate(tensor.placements) if placement.is_replicate())


def _tp_share(grad: torch.Tensor, layout, tp: int, tp_rank: int) -> tuple[torch.Tensor, bool]:
    """The part of this rank's gradient it counts, as a local float32 tensor, and whether it counts it: all of a tp
    shard it is the first holder of, none of a copy, and in a packed weight (q|k|v) its own rows plus the replicated
    kv heads only where it is their first holder (the row mask is made on the CPU: on XLA the rows it drops differ
    by rank, so they reach the device as data; under FSDP2 the mask is a replicated DTensor: multiplying cuts it as
    the gradient is cut, without communication)."""
    if layout is None or layout.dim is None:
        return local_tensor(grad).float(), tp_rank == 0
    if layout.replicas > 1:
        return local_tensor(grad).float(), tp_rank % layout.replicas == 0
    spec = getattr(layout, "spec", None)
    segments = spec.replicated_segments(tp_rank, tp) if spec is not None else []
    copies = [s for s in segments if tp_rank % (tp // s.heads) != 0]
    if not copies and not (segments and devices.is_graph_device(grad)):  # on XLA every rank masks: one graph
        return local_tensor(grad).float(), True
    keep = torch.ones(grad.shape[layout.dim], dtype=torch.float32)
    for segment in copies:
        keep[segment.start : segment.start + segment.length] = 0
    shape = [1] * grad.dim()
    shape[layout.dim] = -1
    mask = keep.view(shape).to(grad.device)
    if is_dtensor(grad):
        from torch.distributed.tensor import DTensor, Replicate  # loaded already: `grad` is a DTensor

        mask = DTensor.from_local(mask, grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return local_tensor(grad.float() * mask), True
