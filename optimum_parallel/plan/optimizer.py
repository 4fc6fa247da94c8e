"""Rebuild an optimizer over new parameters (parallel shards, FSDP's DTensors) keeping everything else."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, old_to_new: Mapping[int, nn.Parameter]
) -> torch.optim.Optimizer:
    """The same optimizer class, param groups and hyper-parameters over the parameters `old_to_new` maps to
    ({id(old parameter): new parameter, or None to drop it, e.g. on another pipeline stage}; unmapped ones are
    kept). State already held for a split parameter is cut to its shard (`param.shard_layout`)."""
    groups = []
    for group in optimizer.param_groups:
        params = [old_to_new.get(id(p), p) for p in group["params"]]
        params = [p for p in params if p is not None]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    accepted = inspect.signature(type(optimizer)).parameters
    new = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    for old_param, state in optimizer.state.items():
        param = old_to_new.get(id(old_param), old_param)
        if param is not None:
            new.state[param] = shard_state(param, state)
    return new


def shard_state(param: nn.Parameter, state: dict) -> dict:
    """`state` (an optimizer's, for `param`) with every tensor held for the whole parameter cut to `param`'s shard
    (`param.shard_layout`): state an optimizer gathered before the parameter was split."""
    layout = getattr(param, "shard_layout", None)
    if layout is None:
        return state
    whole = tuple(layout.global_shape)
    return {
        k: layout.slice(v).clone() if torch.is_tensor(v) and tuple(v.shape) == whole != tuple(param.shape) else v
        for k, v in state.items()
    }


def shard_states_in_place(optimizer: torch.optim.Optimizer) -> None:
    """`shard_state` for every parameter of `optimizer` (its parameters were given their shards in place)."""
    for param, state in list(optimizer.state.items()):
        optimizer.state[param] = shard_state(param, state)
