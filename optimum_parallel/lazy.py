"""Lazy loading for parallelism: build on the meta device, read each rank's slice from safetensors.

(Stub: filled in by the lazy-loading work.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def materialize_lazy_model(model: nn.Module, device: torch.device | None = None) -> None:
    """Give every meta parameter/buffer of a parallelized `model` its real values (no-op if none)."""


def is_lazy_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return False


def build_lazy_optimizer(
    optimizer: torch.optim.Optimizer, orig_param_to_parallel_param: Mapping[int, nn.Parameter]
) -> torch.optim.Optimizer:
    raise NotImplementedError("lazy optimizers are not available yet")


def lazy_load_for_parallelism(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1):
    """Context manager: `from_pretrained` builds on the meta device and records where each weight lives."""
    raise NotImplementedError("lazy loading is not available yet")


def make_optimizer_constructor_lazy(optimizer_cls: type[torch.optim.Optimizer]):
    """A constructor that records its arguments; `optimizer_for_mp` builds the real optimizer."""
    raise NotImplementedError("lazy optimizers are not available yet")
