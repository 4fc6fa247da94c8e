"""Replicated parameters applied to split work: their gradients are partial sums, summed over tp in the forward path."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.autograd_collectives import copy_to_tensor_parallel_region

_SYNCED_CLASSES: dict[type, type] = {}


def sum_parameter_gradients(module: nn.Module, group: ProcessGroup, when: Callable[[], bool] | None = None) -> None:
    """Sum the gradients of `module`'s own parameters over `group` (they saw part of the work on each rank);
    `when`, if given, is asked at each forward whether the work is split this time (else nothing is summed).

    The parameters reach the module's forward through an identity op whose backward all-reduces, so
    the gradient is whole before it reaches the parameter: this composes with DDP and FSDP2 (which
    replace or hook parameters) and with gradient accumulation, and keeps state_dict keys.
    """
    cls = type(module)
    if cls not in _SYNCED_CLASSES and cls not in _SYNCED_CLASSES.values():

        def forward(self, *args, **kwargs):
            originals = dict(self._parameters)
            when = self._grad_sum_when
            try:
                if when is not None and not when():
                    return cls.forward(self, *args, **kwargs)
                for name, param in originals.items():
                    if param is not None and param.requires_grad and torch.is_grad_enabled():
                        self._parameters[name] = copy_to_tensor_parallel_region(param, self._grad_sum_group)
                return cls.forward(self, *args, **kwargs)
            finally:
                self._parameters.update(originals)

        _SYNCED_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    module.__class__ = _SYNCED_CLASSES.get(cls, cls)
    module._grad_sum_group = group
    module._grad_sum_when = when
