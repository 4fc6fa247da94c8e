"""TRL's processes as the mesh's batch replicas, for the trainers that count, gather and seed per process (GRPO, RLOO,
distillation): the tp / pp / cp ranks of one replica hold copies of its batch and act as one of TRL's processes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import set_seed
from trl.trainer import grpo_trainer as trl_grpo

from ...mesh import ParallelMesh
from ...tensor_parallel.random import share_rng_states
from ..transformers.internals import InternalsChanged, private_override

_trl_use_adapter = trl_grpo.use_adapter

TRL_MODULE_GLOBALS = ("gather", "gather_object", "create_model_from_path", "use_adapter")  # `swapped_globals`


def check_module_globals(module: ModuleType, trainer: str) -> None:
    """InternalsChanged unless TRL's trainer `module` still reaches each of `TRL_MODULE_GLOBALS` by that name."""
    for name in TRL_MODULE_GLOBALS:
        if not callable(getattr(module, name, None)):
            raise InternalsChanged(
                f"{module.__name__}.{name} no longer exists; {trainer} swaps it for one over the batch replicas "
                "(replicas.py). Install a TRL version this release supports."
            )


class ReplicaView:
    """accelerate's Accelerator as TRL's code asks it, with the batch replicas as the processes: gathers and
    reductions run over the mesh's `batch` group, `process_index` / `num_processes` are the replica's. Everything
    else (autocast, backward, sync_gradients, ...) is the Accelerator's own."""

    def __init__(self, accelerator, mesh: ParallelMesh) -> None:
        self._accelerator = accelerator
        self._group = mesh.group("batch")
        self.num_processes = mesh.size("batch")
        self.process_index = mesh.rank("batch")

    def __getattr__(self, name: str):
        return getattr(self._accelerator, name)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.num_processes == 1:
            return tensor
        flat = tensor if tensor.dim() else tensor[None]
        wire = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.contiguous()  # gloo gathers no bools
        parts = [torch.empty_like(wire) for _ in range(self.num_processes)]
        dist.all_gather(parts, wire, group=self._group)
        return torch.cat(parts).to(flat.dtype)

    gather_for_metrics = gather

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        out = tensor.clone() * scale
        if self.num_processes > 1:
            dist.all_reduce(out, group=self._group)
        return out / self.num_processes if reduction == "mean" else out

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
        if self.num_processes == 1:
            return tensor
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        longest = int(self.gather(size).max())
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.shape[dim]
        pad = tensor.new_full(shape, pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim=dim)

    def gather_object(self, obj: list) -> list:
        """accelerate's `gather_object` (lists concatenated in replica order) over the replicas."""
        if self.num_processes == 1:
            return obj
        parts: list = [None] * self.num_processes
        dist.all_gather_object(parts, obj, group=self._group)
        return [item for part in parts for item in part]


@contextlib.contextmanager
def swapped_globals(module: ModuleType, values: dict[str, Any]) -> Iterator[None]:
    """A TRL trainer module reaches a few accelerate/TRL functions by module-level name; swap them for a block."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def use_adapter_as_it_was(model: nn.Module, adapter_name: str | None) -> Iterator[None]:
    """TRL's `use_adapter` (the reference's adapter, or none, for the reference log-probs, computed without a graph)
    with every parameter's `requires_grad` kept: PEFT marks the adapter it activates trainable and the others frozen,
    and torch's composable DDP (data parallelism over dp x cp at levels 0-1) builds its reducer at the model's first
    forward over the parameters that require a gradient then: with the "ref" adapter active it would reduce the
    reference's parameters, not the policy's."""
    flags = [(param, param.requires_grad) for param in model.parameters()]
    with _trl_use_adapter(model, adapter_name):
        for param, flag in flags:
            param.requires_grad_(flag)
        yield
    for param, flag in flags:
        param.requires_grad_(flag)


@contextlib.contextmanager
def over_replicas(trainer, trl_module: ModuleType | None = None) -> Iterator[None]:
    """For the block, `trainer.accelerator` is a `ReplicaView` and `trl_module`'s module-level `gather`,
    `gather_object` and `use_adapter` are the view's and `use_adapter_as_it_was` (a block inside another: the outer
    one holds)."""
    accelerator = trainer.accelerator
    if isinstance(accelerator, ReplicaView):
        yield
        return
    view = trainer.accelerator = ReplicaView(accelerator, trainer.mesh)
    swapped = {"gather_object": view.gather_object, "gather": view.gather, "use_adapter": use_adapter_as_it_was}
    try:
        with swapped_globals(trl_module, swapped) if trl_module is not None else contextlib.nullcontext():
            yield
    finally:
        trainer.accelerator = accelerator


class ReplicaProcesses:
    """Trainer mixin (GRPO, RLOO, distillation): TRL's `_prepare_inputs` and `compute_loss` over the replicas."""

    trl_module: ModuleType | None = None  # the TRL module whose gathers `over_replicas` swaps, if any

    def _over_replicas(self):
        """TRL's gathers and reductions over the batch replicas for the block (`over_replicas`)."""
        return over_replicas(self, self.trl_module)

    @private_override
    def _prepare_inputs(self, generation_batch):
        """TRL's generation, scoring (GRPO, RLOO) and buffering, with the replicas as its processes."""
        with self._over_replicas():
            return super()._prepare_inputs(generation_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss and its metrics, with the replicas as its processes."""
        with self._over_replicas():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def seed_replicas(mesh: ParallelMesh, seed: int) -> None:
    """TRL's per-process seed (seed + process index) with the replicas as its processes; a replica's ranks share it."""
    set_seed(seed + mesh.rank("batch"))
    share_rng_states(mesh.group("peers"))


def mean_over_replicas(loss: torch.Tensor | None, mesh: ParallelMesh) -> torch.Tensor | None:
    """An evaluation loss made the mean of the batch replicas' (each the mean over its sequences), on every replica."""
    if loss is not None and mesh.size("batch") > 1:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=mesh.group("batch"))
        loss = loss / mesh.size("batch")
    return loss
