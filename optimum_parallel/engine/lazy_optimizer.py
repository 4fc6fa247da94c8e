"""A lazy optimizer constructor: arguments checked on meta placeholders, built over the parallel ones."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LAZY_OPTIMIZER_ATTR = "_op_lazy_optimizer"


@dataclass
class _LazyOptimizerSpec:
    cls: type[torch.optim.Optimizer]
    params: list[list[nn.Parameter]]  # the original parameters, per param group
    args: tuple
    kwargs: dict[str, Any]


def make_optimizer_constructor_lazy(optimizer_cls: type[torch.optim.Optimizer]):
    """A constructor with `optimizer_cls`'s signature that builds a placeholder optimizer over meta copies of
    the parameters (arguments validated, no real memory touched) and remembers its arguments;
    `Parallelizer.optimizer_for_mp` then builds the real one over the parallel parameters."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"make_optimizer_constructor_lazy expects an optimizer class, got {optimizer_cls!r}")

    def constructor(params, *args, **kwargs) -> torch.optim.Optimizer:
        params = list(params)
        groups = params if params and isinstance(params[0], Mapping) else [{"params": params}]
        originals, placeholder_groups = [], []
        for group in groups:
            members = group["params"]
            members = [members] if isinstance(members, torch.Tensor) else list(members)
            originals.append(members)
            meta = [nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for p in members]
            placeholder_groups.append({**group, "params": meta})
        optimizer = optimizer_cls(placeholder_groups, *args, **kwargs)
        setattr(optimizer, LAZY_OPTIMIZER_ATTR, _LazyOptimizerSpec(optimizer_cls, originals, args, kwargs))
        return optimizer

    constructor.__name__ = constructor.__qualname__ = f"lazy_{optimizer_cls.__name__}"
    constructor.__doc__ = f"Lazy {optimizer_cls.__name__}: built for real by Parallelizer.optimizer_for_mp."
    constructor.__signature__ = inspect.signature(optimizer_cls)
    return constructor


def is_lazy_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return hasattr(optimizer, LAZY_OPTIMIZER_ATTR)


def build_lazy_optimizer(
    optimizer: torch.optim.Optimizer, orig_param_to_parallel_param: Mapping[int, nn.Parameter]
) -> torch.optim.Optimizer:
    """The real optimizer for a placeholder from `make_optimizer_constructor_lazy`: same class, arguments,
    param groups and (current) hyper-parameters, over the parallel parameters (groups left empty on this
    pipeline stage are dropped, as `optimizer_for_mp` does for a regular optimizer)."""
    spec: _LazyOptimizerSpec = getattr(optimizer, LAZY_OPTIMIZER_ATTR)
    groups = []
    for group, originals in zip(optimizer.param_groups, spec.params, strict=True):
        params = [orig_param_to_parallel_param.get(id(p), p) for p in originals]
        params = [p for p in params if p is not None]  # None: the parameter lives on another pipeline stage
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return spec.cls(groups, *spec.args, **spec.kwargs)
