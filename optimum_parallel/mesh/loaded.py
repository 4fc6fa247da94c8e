"""Type checks against torch.distributed's heavy modules without importing them: a DTensor or a ZeRO optimizer can
only exist once its module was imported, so a module absent from `sys.modules` answers "no" for free (importing
`torch.distributed.tensor` costs ~0.5 s, which `import optimum_parallel` should not pay)."""

from __future__ import annotations

import sys

import torch


def _loaded(module: str, name: str) -> type | None:
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def is_dtensor(tensor: object) -> bool:
    """Whether `tensor` is a DTensor (FSDP2's sharded parameters, gradients and optimizer states)."""
    cls = _loaded("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(tensor, cls)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local part of a DTensor, else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_zero_optimizer(optimizer: object) -> bool:
    """Whether `optimizer` is torch's `ZeroRedundancyOptimizer` (sharding level 1)."""
    cls = _loaded("torch.distributed.optim.zero_redundancy_optimizer", "ZeroRedundancyOptimizer")
    return cls is not None and isinstance(optimizer, cls)
