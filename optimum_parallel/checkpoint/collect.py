"""What one rank holds: its named model tensors and optimizer state, each with the layout it is split by (and, for
the tensors of a stacked-experts module, the experts it holds: a block of dim 0 under expert parallelism, all of
them otherwise, so a checkpoint saved at any ep can be re-split at another)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..expert_parallel import expert_count, expert_range, expert_tensors, find_experts
from ..io.safetensors_io import dtype_name
from ..mesh import ranks
from ..mesh.loaded import is_dtensor, is_zero_optimizer
from ..tensor_parallel.spec import ShardLayout, ShardSpec, split_layout


@dataclass
class LocalTensor:
    """One checkpoint tensor as held by this rank (for FSDP2, by this rank's data-parallel group)."""

    tensor: torch.Tensor
    kind: str  # "param" | "buffer" | "state"
    layout: ShardLayout | None  # None: replicated (the whole tensor)
    param: str | None = None
    like_param: bool = False
    experts: tuple[int, int, int] | None = None  # expert tensors: (start, end, count) of the experts held on dim 0

    @property
    def sharded_over_dp(self) -> bool:
        return is_dtensor(self.tensor)

    def value(self) -> torch.Tensor:
        """The tensor to store: an FSDP2 shard is all-gathered over dp first (a collective: every rank of the
        dp group must ask for the same tensors in the same order)."""
        return self.tensor.full_tensor() if self.sharded_over_dp else self.tensor

    def spec(self) -> dict:
        """What the other ranks need to know about this tensor to plan the files (picklable, no data)."""
        layout = self.layout
        if layout is not None and layout.spec is None:
            raise ValueError(
                f"a tensor split by {layout} carries no ShardSpec: build split parameters with ShardSpec.local"
            )
        if layout is None:  # replicated over tp: the whole tensor (all its experts)
            shape = tuple(self.tensor.shape)
            layout = ShardSpec(shape if self.experts is None else (self.experts[2], *shape[1:])).local(0, 1)
        return {
            "dtype": dtype_name(self.tensor.dtype),
            **layout.to_json(),
            "kind": self.kind,
            "param": self.param,
            "like_param": self.like_param,
            "experts": None if self.experts is None else list(self.experts[:2]),
        }


def _check_materialised(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_meta:
        raise ValueError(f"{name} is still on the meta device: parallelize (materialise) the model before saving it")


def held_experts(model: nn.Module) -> dict[int, tuple[int, int, int]]:
    """{id(expert tensor): (start, end, count)}: the experts each expert tensor of `model` holds along dim 0."""
    held = {}
    for _, module in find_experts(model):
        count = getattr(module, "global_num_experts", None) or expert_count(module)
        for _, param in expert_tensors(module):
            start, end = expert_range(param) or (0, count)
            held[id(param)] = (start, end, count)
    return held


def model_tensors(model: nn.Module, trainable_only: bool = False) -> tuple[dict[str, LocalTensor], dict[str, str]]:
    """({name: tensor} for every parameter (tied ones once) and persistent buffer, {tied alias: canonical name});
    with `trainable_only`, the parameters that require a gradient and nothing else (adapters over a frozen base)."""
    tensors: dict[str, LocalTensor] = {}
    experts = held_experts(model)
    canonical: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in canonical:
            tied[name] = canonical[id(param)]
            continue
        canonical[id(param)] = name
        if trainable_only and not param.requires_grad:
            continue
        _check_materialised(name, param)
        tensors[name] = LocalTensor(param.detach(), "param", split_layout(param), experts=experts.get(id(param)))
    if trainable_only:
        return tensors, {alias: name for alias, name in tied.items() if name in tensors}
    for module_name, module in model.named_modules():
        for leaf, buffer in module._buffers.items():
            if buffer is None or leaf in module._non_persistent_buffers_set:
                continue
            name = f"{module_name}.{leaf}" if module_name else leaf
            if name not in tensors:
                _check_materialised(name, buffer)
                tensors[name] = LocalTensor(buffer.detach(), "buffer", split_layout(buffer))
    # transformers' own tie map also names ties split over pipeline stages (each stage holds one side)
    for alias, canonical in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if canonical not in tied:
            tied.setdefault(alias, canonical)
    return tensors, tied


def parameter_names(model: nn.Module) -> dict[int, str]:
    """{id(parameter): canonical name}."""
    return {id(p): n for n, p in model.named_parameters()}


def _jsonable(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    return False


def is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    return is_zero_optimizer(optimizer)


def optimizer_parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer] | None:
    """The optimizers whose states together make `optimizer`'s (the engine's `ExpertSplitOptimizer` at sharding
    level 1 under ep: a ZeRO-1 optimizer for the dense parameters, one for the experts), None for a single one."""
    return getattr(optimizer, "parts", None)


def source_param_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param groups as the caller built them (an optimizer made of parts regroups them per part): checkpoints
    record these, so the files do not depend on the sharding level."""
    groups = getattr(optimizer, "source_param_groups", None)
    return optimizer.param_groups if groups is None else groups


def optimizer_class(optimizer: torch.optim.Optimizer) -> type:
    """The optimizer the state belongs to (for ZeRO-1, the one it wraps): checkpoints do not depend on the level."""
    parts = optimizer_parts(optimizer)
    if parts:
        return optimizer_class(parts[0])
    return type(optimizer.optim) if is_zero1(optimizer) else type(optimizer)


def _state_by_param(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """{id(param): its state}. ZeRO-1 state is spread over the dp ranks: torch's `consolidate_state_dict`
    gathers it on dp rank 0 (a collective of the dp group; the whole state of this stage/tp shard transiently
    in that rank's memory), the only rank that writes; the other dp ranks hold none. An optimizer made of parts
    gives the union of theirs (under ep: the dense state on dp x cp rank 0, each expert block's on the first rank
    of its replica group, the ranks that write them)."""
    parts = optimizer_parts(optimizer)
    if parts is not None:
        return {k: v for part in parts for k, v in _state_by_param(part).items()}
    if not is_zero1(optimizer):
        return {id(p): optimizer.state.get(p, {}) for group in optimizer.param_groups for p in group["params"]}
    optimizer.consolidate_state_dict(to=0)
    if ranks.rank(optimizer.process_group) != 0:
        return {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(params[i]): state for i, state in optimizer.state_dict()["state"].items() if state}


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, model: nn.Module, params: dict[str, LocalTensor]
) -> tuple[dict[str, LocalTensor], dict]:
    """({"param/state_key": state tensor}, {"class", "param_groups" (params by name), "scalars"}).

    State tensors shaped like a split parameter are split like it; other state tensors (AdamW's `step`)
    must be the same on every tp rank. Hyper-parameters that JSON cannot hold are left out (listed in `unsaved`).
    Call it on every rank (ZeRO-1 state is gathered over dp).
    """
    held = _state_by_param(optimizer)
    names = parameter_names(model)
    groups, unsaved = [], set()
    for i, group in enumerate(source_param_groups(optimizer)):
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"optimizer param group {i} holds {len(missing)} tensors that are not parameters of the model "
                f"(shapes {[tuple(p.shape) for p in missing[:3]]}); build the optimizer with optimizer_for_mp"
            )
        hyper = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params" and _jsonable(v)}
        unsaved |= {k for k, v in group.items() if k != "params" and not _jsonable(v)}
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
    state: dict[str, LocalTensor] = {}
    scalars: dict[str, dict] = {}
    for group in source_param_groups(optimizer):
        for param in group["params"]:
            name = names[id(param)]
            layout, experts = params[name].layout, params[name].experts
            for key, value in held.get(id(param), {}).items():
                if not torch.is_tensor(value):
                    if not _jsonable(value):
                        raise NotImplementedError(f"optimizer state {name}/{key} of type {type(value).__name__}")
                    scalars.setdefault(name, {})[key] = value
                    continue
                _check_materialised(f"optimizer state {name}/{key}", value)
                split = layout is not None or experts is not None
                like_param = split and tuple(value.shape) == tuple(param.shape)
                if split and not like_param and value.numel() > 1:
                    raise NotImplementedError(
                        f"optimizer state {name}/{key} has shape {tuple(value.shape)}, neither the parameter shard's "
                        f"{tuple(param.shape)} nor a scalar: its split over tensor-parallel ranks is unknown"
                    )
                state[f"{name}/{key}"] = LocalTensor(
                    value.detach(),
                    "state",
                    layout if like_param else None,
                    param=name,
                    like_param=like_param,
                    experts=experts if like_param else None,
                )
    cls = optimizer_class(optimizer)
    meta = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "param_groups": groups,
        "scalars": scalars,
        "unsaved": sorted(unsaved),
    }
    return state, meta
