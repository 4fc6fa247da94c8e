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
