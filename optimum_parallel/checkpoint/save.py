"""Collective save of a parallel model (and optimizer) as a sharded checkpoint, atomically.

Every rank tells the others what it holds; one copy of each distinct shard is written by the
lowest tp rank holding it on data-parallel replica 0 (dp rank 0 and cp rank 0) -- for expert tensors under expert
parallelism, on the first replica of each expert group (dp x cp ranks 0..ep-1, which hold every expert once), each
into its own `-epNN` file -- into a temporary sibling
directory (FSDP2 shards are all-gathered one tensor at a time, over dp x cp or, for experts, over their replica
group; ZeRO-1 state is consolidated on the writing ranks; so the files are the same at every sharding level and
every cp); rank 0 then writes config, index and completion marker and swaps the directory into place.
Assumes the output directory is on a filesystem every rank sees.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..io.safetensors_io import SafetensorsWriter, dtype_from_name
from ..mesh import get_mesh, ranks
from ..mesh.loaded import is_dtensor
from ..mesh.timeouts import long_running_call
from .async_save import (
    AsyncCheckpoint,
    background_group,
    check_async_supported,
    start_async_save,
    wait_for_pending_save,
)
from .atomic import partial_dir, publish
from .collect import LocalTensor, is_zero1, model_tensors, optimizer_parts, optimizer_tensors
from .consolidate import DEFAULT_MAX_SHARD_SIZE, write_hf_checkpoint
from .crash import crash_point
from .metadata import CheckpointIndex, TensorEntry, model_file, optimizer_file, write_index
from .rank_info import RankInfo, current_rank
from .rng_files import rng_bytes, rng_file
from .sharding import entries_from_specs


def _stored_here(file: str, entries: Mapping[str, TensorEntry]) -> list[tuple[str, TensorEntry, object]]:
    """(name, entry, shard) of every shard stored in `file`, in a fixed order (the same on every dp rank)."""
    return [(n, e, s) for n, e in entries.items() for s in e.shards if s.file == file]


def _in_order(
    entries: Mapping[str, TensorEntry], local: Mapping[str, LocalTensor], file: str, dense_file: str, writes: bool
) -> Iterator[tuple[object, LocalTensor, torch.Tensor]]:
    """(shard, held tensor, value) of every shard stored in `file` (this rank's: its experts' block, and at ep rank 0
    the dense tensors), in the index order, when this rank `writes` it; on the way, this rank's part of every
    all-gather of the FSDP2 shards that its replica writes: the dense tensors of `dense_file` (gathered over dp x cp)
    and its experts' (gathered over their replica group). Every rank walks the same index in the same order, so each
    all-gather has all its ranks and no two ranks wait on each other in different groups."""
    for name, entry in entries.items():
        target = file if entry.experts else dense_file
        shard = next((s for s in entry.shards if s.file == target), None)
        held = local.get(name)  # ZeRO-1 state: consolidated on the writing rank already, none here
        if shard is None or held is None:
            continue
        if writes and target == file:
            yield shard, held, held.value()
        elif held.sharded_over_dp:
            held.value()


def _write_rank_file(
    path: Path, entries: Mapping[str, TensorEntry], values: Iterable[tuple[object, torch.Tensor]], coords: dict
) -> dict:
    """Write the shards this rank stores into `path` from `values` ((shard, tensor) in the index order: the live
    tensors of a blocking save, or an async save's snapshot of them): {"size", "sha256", "crc32": {key: crc}}."""
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
        for shard, value in values:
            crcs[shard.key] = writer.write(shard.key, value)
            crash_point("tensor")
    except BaseException:
        writer.abort()
        raise
    size, sha = writer.close()
    crash_point("file")
    return {"size": size, "sha256": sha, "crc32": crcs}


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
    """Expert tensors sharded over data-parallel ranks are checkpointed when they are sharded over the ranks holding
    the same experts (their replica group), as `parallelize` shards them at every level: refuse FSDP2 shards or a
    ZeRO-1 optimizer over other ranks (a rank there holds other experts under the same names) before anything is
    written or read."""
    experts = {id(p): p for p in model.parameters() if getattr(p, "expert_layout", None) is not None}
    if not experts or not dist.is_initialized():
        return

    def ranks_of(group: dist.ProcessGroup) -> list[int]:
        return sorted(dist.get_process_group_ranks(group))

    replicas = ranks_of(get_mesh().expert_replica_group)
    wrong = []
    for param in experts.values():
        if is_dtensor(param) and ranks_of(param.device_mesh.get_group()) != replicas:
            wrong.append(f"FSDP2 shards over ranks {ranks_of(param.device_mesh.get_group())}")
            break
    zeros = [] if optimizer is None else optimizer_parts(optimizer) or [optimizer]
    for zero in zeros:
        holds = any(id(p) in experts for group in zero.param_groups for p in group["params"])
        if is_zero1(zero) and holds and ranks_of(zero.process_group) != replicas:
            wrong.append(f"ZeRO-1 state over ranks {ranks_of(zero.process_group)}")
    if wrong:
        raise NotImplementedError(
            f"{what} of an expert-parallel model (ep > 1) with its experts' {wrong[0]}, which hold other experts: "
            f"allowed: experts sharded over the ranks holding the same experts ({replicas}), as "
            "parallelize(..., {'dp_config': {'sharding_level': 0..3}}) shards them"
        )


@dataclass
class PlannedSave:
    """One save, planned on every rank (what each file holds, this rank's tensors, the temporary directory made):
    `write` writes this rank's files, from the live tensors or from a snapshot of them, and `publish` (rank 0)
    writes the configs and the index and renames the directory into place. A blocking save runs them in a row;
    an async one (`async_save.py`) snapshots in the step and runs them in the background: the same code, the same
    bytes."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    rank: RankInfo
    final: Path
    tmp: Path
    local: dict
    entries: dict
    state_entries: dict
    optimizer_meta: dict | None
    tied: dict
    described: list
    as_regular: bool
    as_sharded: bool
    trainable_only: bool
    max_shard_size: int | str
    progress: bool
    extra_files: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def coords(self) -> dict:
        rank = self.rank
        return {"dp_rank": rank.dp, "pp_rank": rank.pp, "tp_rank": rank.tp, "mesh": rank.sizes}

    def files(self) -> list[tuple[str, dict, dict, str]]:
        """(file name, index entries, this rank's tensors, its dense file) of every file this rank's shards go to
        (it writes them if `rank.writes_experts`), model first, in the same order on every rank."""
        rank, out = self.rank, []
        for name, kind, table in ((model_file, "model", self.entries), (optimizer_file, "state", self.state_entries)):
            if kind == "model" or self.optimizer is not None:
                out.append((name(rank.pp, rank.tp, rank.ep), table, self.local[kind], name(rank.pp, rank.tp)))
        return out

    def shapes(self, file: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(key, dtype, shape) of every shard stored in `file`, in the file's order."""
        table = self.entries if file.startswith("model-") else self.state_entries
        return [(s.key, dtype_from_name(e.dtype), e.local_shape(s)) for _, e, s in _stored_here(file, table)]

    def file_bytes(self) -> dict[str, int]:
        """{file: bytes of its tensors} of every file of the checkpoint (what each writing rank holds in a snapshot)."""
        sizes: dict[str, int] = {}
        for table in (self.entries, self.state_entries):
            for entry in table.values():
                for shard in entry.shards:
                    size = math.prod(entry.local_shape(shard)) * dtype_from_name(entry.dtype).itemsize
                    sizes[shard.file] = sizes.get(shard.file, 0) + size
        return sizes

    def live_values(self, file: str) -> Iterator[tuple[object, torch.Tensor]]:
        """(shard, tensor) of every shard of `file` this rank writes, straight from the model and optimizer (and
        its part of the FSDP2 all-gathers: a collective walk, the same on every rank)."""
        return ((shard, value) for shard, _, value in self.snapshot_values(file))

    def snapshot_values(self, file: str) -> Iterator[tuple[object, LocalTensor, torch.Tensor]]:
        """`live_values` with the `LocalTensor` each value comes from (an async save decides from it when to copy
        the value: an FSDP2 all-gather's output is already a copy, a parameter is the live tensor)."""
        name, table, local, dense = next(f for f in self.files() if f[0] == file)
        return _in_order(table, local, name, dense, writes=self.rank.writes_experts)

    def write(self, values: Callable[[str], Iterable[tuple[object, torch.Tensor]]]) -> dict:
        """Write this rank's files from `values(file)` and its extra files: {file: {"size", "sha256", "crc32"}}."""
        written = {}
        for file, table, _, _ in self.files():
            if self.rank.writes_experts:
                written[file] = _write_rank_file(self.tmp / file, table, values(file), self.coords)
            else:
                for _ in values(file):  # the collectives of the FSDP2 shards its replica writes
                    pass
        for name, data in self.extra_files.items():
            _write_extra_file(self.tmp / name, data)
        return written

    def publish(self, results: list[dict]) -> None:
        """Rank 0, once every rank wrote its files (`results`, in rank order): configs, index, marker, rename."""
        files = {}
        for description, result in zip(self.described, results, strict=True):
            _, pp_rank, tp_rank = description["coords"]
            for name, info in result.items():
                kind = "model" if name.startswith("model-") else "optimizer"
                files[name] = {"size": info["size"], "sha256": info["sha256"], "kind": kind}
                files[name].update(pp_rank=pp_rank, tp_rank=tp_rank)
                if description["ep"]:
                    files[name]["ep_rank"] = description["ep"]
                for entry in (self.entries if kind == "model" else self.state_entries).values():
                    for shard in entry.shards:
                        if shard.file == name:
                            shard.crc32 = info["crc32"][shard.key]
        index = CheckpointIndex(
            mesh=dict(self.rank.sizes),
            model_class=_model_class_name(self.model),
            tensors=self.entries,
            tied=self.tied,
            files=files,
            optimizer=self.optimizer_meta,
            optimizer_tensors=self.state_entries,
            extra={"trainable_only": True} if self.trainable_only else {},
        )
        _save_configs(self.model, self.tmp)
        crash_point("config")
        if self.as_regular:
            write_hf_checkpoint(index, self.tmp, self.tmp, self.max_shard_size, self.progress)
        if self.as_sharded:
            write_index(self.tmp, index)
        else:
            for name in files:
                (self.tmp / name).unlink()
        publish(self.tmp, self.final)

    def abandon(self) -> None:
        """After a failure: rank 0 removes the temporary directory (the previous checkpoint is untouched)."""
        if self.rank.is_main:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _write_extra_file(path: Path, data: bytes) -> None:
    """A small file the caller adds to the checkpoint (the Trainer's RNG, scheduler and state), synced like the rest."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    crash_point("extra")


def plan_save(
    model: nn.Module,
    output_dir: str | Path,
    as_regular: bool = False,
    as_sharded: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    trainable_only: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = False,
    extra_files: Mapping[str, bytes] | None = None,
) -> PlannedSave:
    """Every rank says what it holds, every rank plans the same files, rank 0 makes the temporary directory
    (collective: call on every rank)."""
    if not (as_sharded or as_regular):
        raise ValueError("nothing to save: as_sharded and as_regular are both False")
    check_expert_checkpoint(model, optimizer, "save_model_checkpoint")
    rank = current_rank()
    final = Path(output_dir).absolute()
    tmp = partial_dir(final)

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
    extra = dict(extra_files or {})
    if as_sharded:  # every rank's generator states, taken now (a resume with dropout draws the same masks)
        extra[rng_file(ranks.global_rank())] = rng_bytes()
    return PlannedSave(
        model, optimizer, rank, final, tmp, local, entries, state_entries, optimizer_meta, tied, described,
        as_regular, as_sharded, trainable_only, max_shard_size, progress, extra,
    )  # fmt: skip


@long_running_call("checkpoint save")  # the init timeout: one rank may write for minutes (mesh/timeouts.py)
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
    async_save: bool = False,
    extra_files: Mapping[str, bytes] | None = None,
    step_optimizer: torch.optim.Optimizer | None = None,
) -> Path | AsyncCheckpoint:
    """Save `model` (and `optimizer` state) from every rank into `output_dir`; call it on every rank.

    as_sharded: per-rank safetensors + self-describing index (reload with `load_model_checkpoint`).
    as_regular: also a consolidated Hugging Face checkpoint in the same directory (`from_pretrained` loads it).
    trainable_only: only the parameters that require a gradient (LoRA adapters over a frozen base the model was
    built from): a small checkpoint that `load_model_checkpoint` loads into the same kind of model.
    async_save: snapshot this rank's shards in host memory and write them in the background; returns an
    `AsyncCheckpoint` whose `.wait()` returns the path once the checkpoint is in place (see `async_save.py`). The
    weights and optimizer state are copied in the background too, before the next `step()` of `step_optimizer`
    (default: `optimizer`), which waits for the copy; without an optimizer to wait in, they are copied in the call.
    Change the weights by hand before that step only after `handle.wait_for_copy()`.
    extra_files: {name: bytes} this rank adds to the checkpoint directory before it is renamed into place.
    step_optimizer: the optimizer that steps `model`, where it is not `optimizer` (a save without the optimizer's
    state: the Trainer's `save_only_model`); only an async save uses it.
    Every split parameter carries its ShardSpec (head counts included), so resharding needs nothing else.
    A save, blocking or not, first waits for the async save still in flight (and raises its error).
    """
    wait_for_pending_save()
    options = dict(trainable_only=trainable_only, max_shard_size=max_shard_size, progress=progress)
    if async_save:
        check_async_supported()
        group = background_group()  # made before the plan: a collective of the default group
        save = plan_save(model, output_dir, as_regular, as_sharded, optimizer, **options, extra_files=extra_files)
        return start_async_save(save, group, optimizer if step_optimizer is None else step_optimizer)
    save = plan_save(model, output_dir, as_regular, as_sharded, optimizer, **options, extra_files=extra_files)
    try:
        results = save.rank.run(lambda: save.write(save.live_values), f"writing shards into {save.tmp}")
        save.rank.run(lambda: save.publish(results), f"publishing {save.final}", only_main=True)
    except BaseException:
        save.abandon()
        raise
    return save.final
