"""Sharded checkpoint -> sharded checkpoint at another tp / pp / ep layout, optimizer state included.

Streams one whole tensor at a time (never the model): assemble it from its source shards, cut it
as `parallelize` would at the new size (whole heads, replicated kv heads, uneven vocab rows, whole experts per ep
rank), and append each piece to its target rank file.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..io.safetensors_io import SafetensorsWriter, dtype_from_name, nbytes
from .atomic import partial_dir, publish
from .consolidate import copy_configs
from .metadata import CheckpointIndex, TensorEntry, model_file, optimizer_file, read_index, write_index
from .optimizer_groups import regroup
from .reading import ShardFiles
from .sharding import assign_pp_ranks, resharded_entry


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return value


def _new_layout(
    index: CheckpointIndex, tp: int, pp: int, ep: int
) -> tuple[dict[str, TensorEntry], dict[str, TensorEntry]]:
    pp_ranks = assign_pp_ranks(index.tensors, pp)
    tensors = {n: resharded_entry(n, e, tp, pp_ranks[n], model_file, ep) for n, e in index.tensors.items()}
    state = {
        k: resharded_entry(k, e, tp, pp_ranks[e.param], optimizer_file, ep) for k, e in index.optimizer_tensors.items()
    }
    return tensors, state


def _check_ep(index: CheckpointIndex, ep: int | None) -> int:
    """The target ep: as saved when None; more than 1 only for a checkpoint with expert tensors."""
    if ep is None:
        return index.mesh.get("ep", 1)
    ep = _check_size("ep", ep)
    if ep > 1 and not any(e.experts for e in index.tensors.values()):
        raise ValueError(f"ep={ep}: the checkpoint holds no expert tensors to split over ep ranks; allowed: ep=1")
    return ep


def _file_info(file: str) -> dict:
    """pp_rank, tp_rank (and ep_rank) of a rank file name (see `metadata.model_file`)."""
    info = {"pp_rank": int(file.split("-pp")[1][:2]), "tp_rank": int(file.split("-tp")[1][:2])}
    if "-ep" in file:
        info["ep_rank"] = int(file.split("-ep")[1][:2])
    return info


def _regroup(index: CheckpointIndex, pp: int) -> dict:
    """The optimizer description at `pp` stages (as saved at the same number)."""
    if pp == index.mesh.get("pp", 1):
        return index.optimizer
    return {**index.optimizer, "param_groups": regroup(index, pp)}


def reshard_checkpoint(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    tp: int,
    pp: int = 1,
    progress: bool = True,
    ep: int | None = None,
) -> Path:
    """Write the sharded checkpoint `checkpoint_dir` at tensor-parallel size `tp`, `pp` pipeline stages and
    expert-parallel size `ep` (None: as saved) into `output_dir` (atomically); the result loads on a mesh with those
    sizes. Pure CPU, one tensor in memory."""
    tp, pp = _check_size("tp", tp), _check_size("pp", pp)
    source, output_dir = Path(checkpoint_dir), Path(output_dir).absolute()
    index = read_index(source)
    ep = _check_ep(index, ep)
    if output_dir.resolve() == source.resolve():
        raise ValueError(f"output directory {output_dir} is the checkpoint itself; choose another one")
    tensors, state = _new_layout(index, tp, pp, ep)
    tables = [(tensors, index.tensors, model_file)]
    if index.optimizer is not None:
        tables.append((state, index.optimizer_tensors, optimizer_file))
    tmp = partial_dir(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writers: dict[str, SafetensorsWriter] = {}
    try:
        for new, _, file_name in tables:
            for stage, rank, e in itertools.product(range(pp), range(tp), range(ep)):
                file = file_name(stage, rank, e)
                specs = [
                    (s.key, dtype_from_name(e.dtype), e.local_shape(s))
                    for e in new.values()
                    for s in e.shards
                    if s.file == file
                ]
                writers[file] = SafetensorsWriter(tmp / file, specs, {"format": "pt"})
        total = sum(nbytes(e.global_shape, dtype_from_name(e.dtype)) for _, old, _ in tables for e in old.values())
        with (
            ShardFiles(source, index) as files,
            tqdm(total=total, unit="B", unit_scale=True, desc="reshard", disable=not progress) as bar,
        ):
            largest = max((nbytes(e.global_shape, dtype_from_name(e.dtype)) for _, o, _ in tables for e in o.values()))
            buffer = torch.empty(largest, dtype=torch.uint8)  # one tensor at a time, in the same memory
            for new, old, _ in tables:
                for name, entry in new.items():
                    full = files.assemble(name, old[name], buffer)
                    for shard in entry.shards:
                        piece = entry.cut(shard, full)
                        shard.crc32 = writers[shard.file].write(shard.key, piece.contiguous())
                    bar.update(full.numel() * full.element_size())
                    del full
        infos = {}
        for file, writer in writers.items():
            size, sha = writer.close()
            kind = "model" if file.startswith("model-") else "optimizer"
            infos[file] = {"size": size, "sha256": sha, "kind": kind, **_file_info(file)}
        new_index = CheckpointIndex(
            mesh={"dp": index.mesh.get("dp", 1), "pp": pp, "tp": tp, **({"ep": ep} if ep > 1 else {})},
            model_class=index.model_class,
            tensors=tensors,
            tied=index.tied,
            files=infos,
            optimizer=_regroup(index, pp) if index.optimizer is not None else None,
            optimizer_tensors=state if index.optimizer is not None else {},
            extra={**index.extra, "resharded_from": index.mesh},
        )
        copy_configs(source, tmp)
        write_index(tmp, new_index)
        publish(tmp, output_dir)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir
