"""Collective save of a parallel model (and optimizer) as a sharded checkpoint, atomically.

Every rank tells the others what it holds; one copy of each distinct shard is written by the
lowest tp rank holding it on data-parallel replica 0 (dp rank 0 and cp rank 0) -- for expert tensors under expert
parallelism, on the first replica of each expert group (dp x cp ranks 0..ep-1, which hold every expert once), each
into its own `-epNN` file -- into a temporary sibling
directory (FSDP2 shards are all-gathered over dp x cp one tensor at a time, so the files are the same at every
sharding level and every cp); rank 0 then writes config, index and completion marker and swaps the directory
into place.
Assumes the output directory is on a filesystem every rank sees.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..io.safetensors_io import SafetensorsWriter, dtype_from_name
from ..mesh.loaded import is_dtensor
from .atomic import partial_dir, publish
from .collect import LocalTensor, is_zero1, model_tensors, optimizer_tensors
from .consolidate import DEFAULT_MAX_SHARD_SIZE, write_hf_checkpoint
from .crash import crash_point
from .metadata import CheckpointIndex, TensorEntry, model_file, optimizer_file, write_index
from .ranks import current_rank
from .sharding import entries_from_specs


def _stored_here(file: str, entries: Mapping[str, TensorEntry]) -> list[tuple[str, TensorEntry, object]]:
    """(name, entry, shard) of every shard stored in `file`, in a fixed order (the same on every dp rank)."""
    return [(n, e, s) for n, e in entries.items() for s in e.shards if s.file == file]


def _write_rank_file(
    path: Path, entries: Mapping[str, TensorEntry], local: Mapping[str, LocalTensor], coords: dict
) -> dict:
    """Write the shards this rank stores into `path`: {"size", "sha256", "crc32": {key: crc}}."""
    mine = _stored_here(path.name, entries)
    specs = [(s.key, dtype_from_name(e.dtype), e.local_shape(s)) for n, e, s in mine]
    layouts = {
        s.key: {
            "global_shape": e.global_shape,
            "dim": e.dim,
            "ranges": s.ranges,
            **({"experts": s.experts} if e.experts else {}),
        }
        for n, e, s in mine
    }
    metadata = {"format": "pt", "optimum_parallel": json.dumps({**coords, "layouts": layouts})}
    writer = SafetensorsWriter(path, specs, metadata)
    crcs = {}
    try:
        for name, _, shard in mine:
            crcs[shard.key] = writer.write(shard.key, local[name].value())
            crash_point("tensor")
    except BaseException:
        writer.abort()
        raise
    size, sha = writer.close()
    crash_point("file")
    return {"size": size, "sha256": sha, "crc32": crcs}


def _join_gathers(file: str, entries: Mapping[str, TensorEntry], local: Mapping[str, LocalTensor]) -> None:
    """On a replica other than the first (dp or cp rank > 0): take part in the all-gathers of the FSDP2 shards that
    the first replica writes into `file`."""
    for name, _, _ in _stored_here(file, entries):
        held = local.get(name)  # ZeRO-1 state: consolidated on dp rank 0 already, none here
        if held is not None and held.sharded_over_dp:
            held.value()


def _merge_optimizer_meta(described: list[dict]) -> dict:
    """One optimizer description from the tp-rank-0 ranks of every pipeline rank: param groups per pp rank
    (each stage's optimizer holds its own parameters), scalars merged."""
    first = described[0]["optimizer"]
    return {
        "class": first["class"],
        "param_groups": {str(d["coords"][1]): d["optimizer"]["param_groups"] for d in described},
        "scalars": {n: v for d in described for n, v in d["optimizer"]["scalars"].items()},
        "unsaved": sorted({k for d in described for k in d["optimizer"]["unsaved"]}),
    }


def _model_class_name(model: nn.Module) -> str:
    """The model's own class, not the one data parallelism swapped in (`FSDPLlamaForCausalLM`, `DDP...`): the
    index is the same at every sharding level and every dp x cp."""
    return next(c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed")).__name__


def _save_configs(model: nn.Module, directory: Path) -> None:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no `config`: sharded checkpoints are for transformers models")
    config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        try:
            generation_config.save_pretrained(directory)
        except Exception as err:  # an invalid generation config must not lose the checkpoint
            warnings.warn(f"generation_config.json not saved: {err}", stacklevel=3)


def check_expert_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, what: str) -> None:
    """Checkpoints of an expert-parallel model are written and read at sharding level 0 (DDP semantics) only, for
    now: refuse ZeRO-1 state and FSDP2 shards with ep > 1 before anything is written or read."""
    if not any(getattr(p, "expert_layout", None) is not None for p in model.parameters()):
        return
    if any(is_dtensor(p) for p in model.parameters()):
        level = "2 or 3 (FSDP2)"
    elif optimizer is not None and is_zero1(optimizer):
        level = "1 (ZeRO-1)"
    else:
        return
    raise NotImplementedError(
        f"{what} of an expert-parallel model (ep > 1) at sharding_level={level} is not supported yet; "
        "allowed with ep > 1: sharding_level=0"
    )


def save_model_checkpoint(
    model: nn.Module,
    output_dir: str | Path,
    as_regular: bool = False,
    as_sharded: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    trainable_only: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = False,
) -> Path:
    """Save `model` (and `optimizer` state) from every rank into `output_dir`; call it on every rank.

    as_sharded: per-rank safetensors + self-describing index (reload with `load_model_checkpoint`).
    as_regular: also a consolidated Hugging Face checkpoint in the same directory (`from_pretrained` loads it).
    trainable_only: only the parameters that require a gradient (LoRA adapters over a frozen base the model was
    built from): a small checkpoint that `load_model_checkpoint` loads into the same kind of model.
    Every split parameter carries its ShardSpec (head counts included), so resharding needs nothing else.
    """
    if not (as_sharded or as_regular):
        raise ValueError("nothing to save: as_sharded and as_regular are both False")
    check_expert_checkpoint(model, optimizer, "save_model_checkpoint")
    rank = current_rank()
    final = Path(output_dir).absolute()
    tmp = partial_dir(final)
    coords = {"dp_rank": rank.dp, "pp_rank": rank.pp, "tp_rank": rank.tp, "mesh": rank.sizes}

    local: dict = {}

    def describe() -> dict:
        local["model"], tied = model_tensors(model, trainable_only)
        local["state"], meta = ({}, None) if optimizer is None else optimizer_tensors(optimizer, model, local["model"])
        specs = {kind: {n: t.spec() for n, t in local[kind].items()} for kind in ("model", "state")}
        here = (rank.dp, rank.pp, rank.tp)
        writes = {"writes": rank.writes_replica, "writes_experts": rank.writes_experts, "ep": rank.ep}
        return {"coords": here, **writes, "specs": specs, "tied": tied, "optimizer": meta}

    described = rank.run(describe, "describing the checkpoint")
    replica0 = [d for d in described if d["writes"]]
    writers = [d for d in described if d["writes_experts"]]  # replica 0, and the rest of its expert group
    tp = rank.sizes["tp"]
    tied = {alias: name for d in described for alias, name in d["tied"].items()}
    model_specs = {(*d["coords"][1:], d["ep"]): d["specs"]["model"] for d in writers}
    entries = entries_from_specs(model_specs, tp, model_file)
    aliases = {alias for alias, name in tied.items() if alias in entries and name in entries}
    entries = {n: e for n, e in entries.items() if n not in aliases}  # a tie across pp stages: stored once
    state_entries, optimizer_meta = {}, None
    if optimizer is not None:
        state_specs = {(*d["coords"][1:], d["ep"]): d["specs"]["state"] for d in writers}
        state_entries = entries_from_specs(state_specs, tp, optimizer_file, owners=entries)
        state_entries = {k: e for k, e in state_entries.items() if e.param not in aliases}
        optimizer_meta = _merge_optimizer_meta([d for d in replica0 if d["coords"][2] == 0])

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        crash_point("prepare")

    rank.run(prepare, f"preparing {tmp}", only_main=True)

    def write() -> dict:
        written = {}
        for name, kind, table in ((model_file, "model", entries), (optimizer_file, "state", state_entries)):
            if kind == "model" or optimizer is not None:
                file = name(rank.pp, rank.tp, rank.ep)
                if rank.writes_experts:
                    written[file] = _write_rank_file(tmp / file, table, local[kind], coords)
                else:
                    _join_gathers(file, table, local[kind])
        return written

    def finish() -> None:
        files = {}
        for description, result in zip(described, results, strict=True):
            _, pp_rank, tp_rank = description["coords"]
            for name, info in result.items():
                kind = "model" if name.startswith("model-") else "optimizer"
                files[name] = {"size": info["size"], "sha256": info["sha256"], "kind": kind}
                files[name].update(pp_rank=pp_rank, tp_rank=tp_rank)
                if description["ep"]:
                    files[name]["ep_rank"] = description["ep"]
                for entry in (entries if kind == "model" else state_entries).values():
                    for shard in entry.shards:
                        if shard.file == name:
                            shard.crc32 = info["crc32"][shard.key]
        index = CheckpointIndex(
            mesh=dict(rank.sizes),
            model_class=_model_class_name(model),
            tensors=entries,
            tied=tied,
            files=files,
            optimizer=optimizer_meta,
            optimizer_tensors=state_entries,
            extra={"trainable_only": True} if trainable_only else {},
        )
        _save_configs(model, tmp)
        crash_point("config")
        if as_regular:
            write_hf_checkpoint(index, tmp, tmp, max_shard_size, progress)
        if as_sharded:
            write_index(tmp, index)
        else:
            for name in files:
                (tmp / name).unlink()
        publish(tmp, final)

    try:
        results = rank.run(write, f"writing shards into {tmp}")
        rank.run(finish, f"publishing {final}", only_main=True)
    except BaseException:
        if rank.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
