"""Collective load of a sharded checkpoint into a parallel model (and its optimizer), every byte checked.

Each rank reads only its own shards (straight into the parameters' memory); the mesh, every
layout, every tensor's dtype/shape and crc32 are checked against the index, and a failure on any
rank raises on all of them, so no rank runs on with wrong weights or waits for a dead peer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..expert_parallel import expert_range
from ..io.errors import CheckpointError
from ..io.file_mapping import is_file_mapping
from ..mesh import device as devices
from ..mesh import ranks
from ..mesh.timeouts import long_running_call
from ..tensor_parallel.spec import ShardLayout, replace_tensor
from .async_save import wait_for_pending_copy
from .collect import is_dtensor, optimizer_class, parameter_names, source_param_groups
from .metadata import INDEX_NAME, CheckpointIndex, TensorEntry, read_index
from .optimizer_groups import saved_hyper_parameters
from .rank_info import RankInfo, current_rank
from .reading import ShardFiles
from .rng_files import restore_rng


def _check_mesh(index: CheckpointIndex, rank: RankInfo, directory: Path) -> None:
    saved = {d: index.mesh.get(d, 1) for d in ("tp", "pp", "ep")}
    running = {d: rank.sizes.get(d, 1) for d in ("tp", "pp", "ep")}
    if saved != running:
        dims = ("tp", "pp", "ep") if saved["ep"] > 1 or running["ep"] > 1 else ("tp", "pp")
        had = ", ".join(f"{d}={saved[d]}" for d in dims)
        has = ", ".join(f"{d}={running[d]}" for d in dims)
        options = " ".join(f"--{d} {running[d]}" for d in dims)
        raise CheckpointError(
            f"{directory / INDEX_NAME}: saved at {had}, but the running mesh has {has}; convert it first: "
            f"optimum-parallel reshard {directory} OUT {options}"
        )


def _live_tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """{name: (owner module, attribute, tensor)} of every parameter (tied ones once) and persistent buffer."""
    live = {}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        live[name] = (model.get_submodule(owner), leaf, param)
    for module_name, module in model.named_modules():
        for leaf, buffer in module._buffers.items():
            if buffer is not None and leaf not in module._non_persistent_buffers_set:
                live.setdefault(f"{module_name}.{leaf}" if module_name else leaf, (module, leaf, buffer))
    return live


def _cut(layout: ShardLayout | None) -> ShardLayout | None:
    """`layout`, None when it holds the whole tensor (tp=1 with a plan, or none: the same tensor)."""
    if layout is None or layout.dim is None or layout.local_shape == layout.global_shape:
        return None
    return layout


def _check_layout(where: str, name: str, entry: TensorEntry, shard, tensor: torch.Tensor) -> None:
    expected = _cut(entry.layout(shard))
    held = _cut(getattr(tensor, "shard_layout", None))
    stored_experts = tuple(shard.experts) if entry.experts else None
    held_experts = expert_range(tensor) or ((0, tensor.shape[0]) if entry.experts else None)
    if expected != held or tuple(tensor.shape) != entry.local_shape(shard) or stored_experts != held_experts:

        def experts(block):
            return "" if block is None else f" of experts [{block[0]}, {block[1]})"

        raise CheckpointError(
            f"{where}: {name} is stored as {expected or f'replicated {entry.global_shape}'}{experts(stored_experts)}, "
            f"but this rank's model holds {held or f'replicated {list(tensor.shape)}'}{experts(held_experts)} "
            "(a different parallel layout or model)"
        )


def _dp_shard(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` (this tp rank's whole tensor) as the FSDP2 DTensor `like` holds it: this dp rank's part, cut
    locally (every dp rank read the whole tensor)."""
    from torch.distributed.tensor import distribute_tensor  # loaded already: `like` is a DTensor

    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def _read_into(files: ShardFiles, name: str, entry: TensorEntry, shard, module: nn.Module, leaf: str, tensor) -> None:
    if is_dtensor(tensor):
        local = _dp_shard(files.read_shard(name, entry, shard).to(tensor.dtype), tensor).to_local()
        tensor.to_local().copy_(local)
    elif tensor.is_meta:
        replace_tensor(module, leaf, files.read_shard(name, entry, shard).to(tensor.dtype))
    elif isinstance(tensor, nn.Parameter) and is_file_mapping(tensor) and str(tensor.dtype) == f"torch.{entry.dtype}":
        tensor.data = files.mapped_shard(entry, shard)  # a lazily loaded weight: mapped in turn, no page copied
    elif devices.is_host(tensor) and tensor.is_contiguous() and str(tensor.dtype) == f"torch.{entry.dtype}":
        files.read_shard(name, entry, shard, out=tensor.data)
    else:
        tensor.data.copy_(files.read_shard(name, entry, shard))


def _load_model(model: nn.Module, index: CheckpointIndex, files: ShardFiles, rank: RankInfo) -> None:
    where = str(files.directory / INDEX_NAME)
    live = _live_tensors(model)
    if index.extra.get("trainable_only"):  # adapters only: the frozen base comes from the model's own weights
        live = {n: held for n, held in live.items() if isinstance(held[2], nn.Parameter) and held[2].requires_grad}
    used, missing = set(), []
    for name in live:
        stored = name if name in index.tensors else index.tied.get(name)
        (used.add(stored) if stored in index.tensors else missing.append(name))
    used |= {n for n, _ in model.named_parameters(remove_duplicate=False)}  # tied aliases stored separately
    # under pp each rank holds part of the model, and stages need not match the files' pp ranks
    unexpected = [n for n in index.tensors if n not in used] if rank.sizes["pp"] == 1 else []
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: does not fit {type(model).__name__}: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    with torch.no_grad():
        for name, (module, leaf, tensor) in live.items():
            stored = name if name in index.tensors else index.tied[name]
            entry = index.tensors[stored]
            shard = entry.shard_for(rank.tp, f"{where}: {stored}", rank.ep)
            _check_layout(str(files.directory / shard.file), name, entry, shard, tensor)
            _read_into(files, stored, entry, shard, module, leaf, tensor)


def _load_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, index: CheckpointIndex, files: ShardFiles, rank: RankInfo
) -> None:
    where = str(files.directory / INDEX_NAME)
    saved = index.optimizer
    if saved is None:
        raise CheckpointError(f"{where}: holds no optimizer state (saved without optimizer=)")
    cls = optimizer_class(optimizer)
    if saved["class"] != f"{cls.__module__}.{cls.__qualname__}":
        raise CheckpointError(f"{where}: holds {saved['class']} state, not {cls.__module__}.{cls.__qualname__}")
    source = source_param_groups(optimizer)  # as the caller built them, whatever the sharding level
    names = parameter_names(model)
    params_of = [[names.get(id(p), "<not a model parameter>") for p in group["params"]] for group in source]
    # groups are matched by their parameters' names: a reshard may merge, empty or drop them (optimizer_groups.py)
    hypers = saved_hyper_parameters(where, saved["param_groups"].get(str(rank.pp)) or [], params_of)
    states: dict[str, dict[str, TensorEntry]] = {}
    for key, entry in index.optimizer_tensors.items():
        states.setdefault(entry.param, {})[key.rpartition("/")[2]] = entry
    state, groups, position = {}, [], 0
    for group, params, hyper in zip(source, params_of, hypers, strict=True):
        ids = []
        for param, name in zip(group["params"], params, strict=True):
            values = {}
            stored = name if name in states or name in saved["scalars"] else index.tied.get(name, name)
            for key, entry in states.get(stored, {}).items():
                shard = entry.shard_for(rank.tp, f"{where}: {name}/{key}", rank.ep)
                if entry.like_param:
                    _check_layout(str(files.directory / shard.file), f"{name}/{key}", entry, shard, param)
                value = files.read_shard(f"{stored}/{key}", entry, shard)
                shaped_like = is_dtensor(param) and tuple(value.shape) == tuple(param.shape)
                values[key] = _dp_shard(value, param) if shaped_like else value
            values.update(saved["scalars"].get(stored, {}))
            if values:
                state[position] = values
            ids.append(position)
            position += 1
        hyper = {k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in (hyper or {}).items()}
        groups.append({**group, **hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})  # ZeRO-1 (each part) keeps its own share


@long_running_call("checkpoint load")  # the init timeout: one rank may read for minutes (mesh/timeouts.py)
def load_model_checkpoint(
    model: nn.Module, load_dir: str | Path, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load this rank's shards of the sharded checkpoint `load_dir` into the parallelized `model` (in place),
    and the optimizer state into `optimizer` when given (its param groups matched to the saved ones by their
    parameters' names; each takes the saved hyper-parameters).
    Call it on every rank; meta (lazy) parameters are materialised from the checkpoint. An async save's snapshot
    still being copied from these tensors is completed first."""
    from .save import check_expert_checkpoint

    wait_for_pending_copy()  # the tensors are read into in place
    check_expert_checkpoint(model, optimizer, "load_model_checkpoint")
    rank = current_rank()
    directory = Path(load_dir)

    def load() -> None:
        index = read_index(directory)
        _check_mesh(index, rank, directory)
        with ShardFiles(directory, index) as files:
            _load_model(model, index, files, rank)
            if optimizer is not None:
                _load_optimizer(optimizer, model, index, files, rank)

    rank.run(load, f"loading {directory}")
    restore_rng(directory, ranks.global_rank(), ranks.world_size() if rank.distributed else 1)
