"""The self-describing index of a sharded checkpoint (`parallel_checkpoint.json`) and its completion marker.

A checkpoint directory holds the HF `config.json`, one model (and optimizer) safetensors file per
(pp stage, tp rank) -- and, under expert parallelism, per ep rank > 0 one more holding only that rank's experts
(`-epNN`) -- this index and a `COMPLETE` marker written last. For every tensor the index
records its global shape, dtype, split dim, split units (heads), pipeline stage and, per distinct
shard, the tp ranks holding it, its ranges, file and crc32; for every file its size and sha256.
Expert tensors (dim 0 one slice per expert) are marked `experts` and each of their shards names its ep rank and
its experts (a range along dim 0) besides its tp ranges, whatever ep they were saved at, so any ep re-splits them.
That is all consolidation and resharding need: they are pure functions of the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..io.errors import CheckpointError
from ..tensor_parallel.spec import ShardLayout, ShardSpec
from .crash import crash_point

FORMAT = "optimum-parallel/sharded-checkpoint"
VERSION = 1
INDEX_NAME = "parallel_checkpoint.json"
MARKER_NAME = "COMPLETE"


def _ep_suffix(ep: int) -> str:
    return f"-ep{ep:02d}" if ep else ""


def model_file(pp: int, tp: int, ep: int = 0) -> str:
    """The model file of (pp, tp) rank; ep rank 0's holds the dense tensors too, ep rank > 0's only its experts."""
    return f"model-pp{pp:02d}-tp{tp:02d}{_ep_suffix(ep)}.safetensors"


def optimizer_file(pp: int, tp: int, ep: int = 0) -> str:
    return f"optimizer-pp{pp:02d}-tp{tp:02d}{_ep_suffix(ep)}.safetensors"


@dataclass
class Shard:
    """One distinct piece of a tensor: the concatenation of `ranges` along the entry's dim (all of it when
    replicated), held identically by `tp_ranks`, stored once in `file` under `key`."""

    file: str
    key: str
    tp_ranks: list[int]
    ranges: list[list[int]] = field(default_factory=list)
    replicas: int = 1  # the holders' ShardLayout.replicas (how many tp ranks sum this shard's gradients)
    crc32: int | None = None
    ep_rank: int = 0  # expert tensors: the ep rank holding these experts (dense tensors: 0, every ep rank has them)
    experts: list[int] = field(default_factory=list)  # expert tensors: [start, end) along dim 0; empty: all of it

    def to_dict(self) -> dict:
        """Its fields, the expert ones only where set (an index without experts reads as before them)."""
        data = asdict(self)
        if not self.experts:
            del data["ep_rank"], data["experts"]
        return data


@dataclass
class TensorEntry:
    """A tensor of the checkpoint: a parameter, a persistent buffer, or a piece of optimizer state."""

    dtype: str
    global_shape: list[int]
    dim: int | None
    pp_rank: int  # the pipeline rank whose files hold it (its stage, or stages under interleaved schedules)
    shards: list[Shard]
    kind: str = "param"  # "param" | "buffer" | "state"
    split: str = "replicated"  # "replicated" | "parts" (see `parts`) | "custom" (older saves only; cannot be re-split)
    parts: list[list] = field(default_factory=list)  # [[size, heads or None (rows)], ...] packed along `dim`
    param: str | None = None  # optimizer state: the parameter it belongs to
    like_param: bool = False  # optimizer state shaped (and split) like its parameter
    experts: bool = False  # one slice per expert along dim 0 (shards name their ep rank and experts)

    def shard_for(self, tp_rank: int, where: str = "", ep_rank: int = 0) -> Shard:
        """The shard tp rank `tp_rank` (and, for an expert tensor, ep rank `ep_rank`) holds."""
        for shard in self.shards:
            if tp_rank in shard.tp_ranks and (not self.experts or shard.ep_rank == ep_rank):
                return shard
        held = f"tp rank {tp_rank}" + (f", ep rank {ep_rank}" if self.experts else "")
        raise CheckpointError(f"{where}: no shard of this tensor is held by {held}")

    def _spec_json(self) -> dict:
        """Its `ShardSpec.to_json` fields (an older "custom" split saved no parts: none then)."""
        data = {"global_shape": self.global_shape, "dim": self.dim}
        return data if self.split == "custom" else {**data, "parts": self.parts}

    @property
    def spec(self) -> ShardSpec | None:
        """The `ShardSpec` the tensor was cut by; None for an older "custom" split (its head counts were not saved)."""
        return None if self.split == "custom" else ShardSpec.from_json(self._spec_json())

    def layout(self, shard: Shard) -> ShardLayout | None:
        """The `ShardLayout` a parameter holding `shard` carries (None when replicated), with its spec."""
        if self.dim is None:
            return None
        return ShardLayout.from_json({**self._spec_json(), "ranges": shard.ranges, "replicas": shard.replicas})

    @classmethod
    def of(cls, spec: Mapping, **fields) -> TensorEntry:
        """An entry whose `global_shape`, `dim`, `split` and `parts` come from a `ShardSpec.to_json` (or
        `ShardLayout.to_json`) dict; `fields` gives the rest (an explicit `split`/`parts` wins: optimizer state
        shares its parameter's)."""
        shape = {"global_shape": list(spec["global_shape"]), "dim": spec["dim"]}
        split = {"split": "replicated", "parts": []}
        if spec["dim"] is not None:
            split = {"split": "parts", "parts": spec["parts"]}
        return cls(**{**shape, **split, **fields})

    def local_shape(self, shard: Shard) -> tuple[int, ...]:
        shape = list(self.global_shape)
        if self.dim is not None:
            shape[self.dim] = sum(e - s for s, e in shard.ranges)
        if shard.experts:
            shape[0] = shard.experts[1] - shard.experts[0]
        return tuple(shape)

    def cut(self, shard: Shard, full: torch.Tensor) -> torch.Tensor:
        """`shard`'s piece of the global tensor `full`: its experts (dim 0), then its tp cut."""
        if shard.experts:
            full = full.narrow(0, shard.experts[0], shard.experts[1] - shard.experts[0])
        layout = self.layout(shard)
        return full if layout is None else layout.slice(full)

    def expert_blocks(self) -> list[tuple[int, int, TensorEntry]]:
        """(start, end, entry) per block of experts an ep rank held: the entry of that block alone (its global
        shape the block's, no experts), whose shards are the tp shards of the block."""
        if not self.experts:
            return [(0, self.global_shape[0] if self.global_shape else 0, self)]
        blocks: dict[tuple[int, int], list[Shard]] = {}
        for shard in self.shards:
            blocks.setdefault(tuple(shard.experts) or (0, self.global_shape[0]), []).append(shard)
        out = []
        for (start, end), shards in sorted(blocks.items()):
            shape = [end - start, *self.global_shape[1:]]
            plain = [replace(s, experts=[], ep_rank=0) for s in shards]
            out.append((start, end, replace(self, global_shape=shape, shards=plain, experts=False)))
        return out

    def to_dict(self) -> dict:
        data = {**asdict(self), "shards": [s.to_dict() for s in self.shards]}
        if not self.experts:
            del data["experts"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> TensorEntry:
        shards = [Shard(**s) for s in data["shards"]]
        return cls(**{**data, "shards": shards})


@dataclass
class CheckpointIndex:
    mesh: dict[str, int]
    model_class: str
    tensors: dict[str, TensorEntry]
    tied: dict[str, str] = field(default_factory=dict)  # alias -> canonical name (stored once)
    files: dict[str, dict] = field(default_factory=dict)  # name -> {size, sha256, kind, pp_rank, tp_rank}
    optimizer: dict | None = None  # {"class", "param_groups" (params by name), "scalars"}
    optimizer_tensors: dict[str, TensorEntry] = field(default_factory=dict)  # "param/state_key" -> entry
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "mesh": self.mesh,
            "model_class": self.model_class,
            "tied": self.tied,
            "files": self.files,
            "tensors": {k: v.to_dict() for k, v in self.tensors.items()},
            "optimizer": self.optimizer,
            "optimizer_tensors": {k: v.to_dict() for k, v in self.optimizer_tensors.items()},
            "extra": self.extra,
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> CheckpointIndex:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise CheckpointError(f"{where}: not an optimum-parallel sharded checkpoint index")
            if data.get("version") != VERSION:
                raise CheckpointError(f"{where}: index version {data.get('version')}, this reader knows {VERSION}")
            return cls(
                mesh=data["mesh"],
                model_class=data["model_class"],
                tensors={k: TensorEntry.from_dict(v) for k, v in data["tensors"].items()},
                tied=data["tied"],
                files=data["files"],
                optimizer=data["optimizer"],
                optimizer_tensors={k: TensorEntry.from_dict(v) for k, v in data["optimizer_tensors"].items()},
                extra=data.get("extra", {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(f"{where}: malformed checkpoint index ({type(err).__name__}: {err})") from None


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_index(directory: Path, index: CheckpointIndex) -> None:
    """Write the index, then the completion marker holding the index's sha256 (so it is written last)."""
    text = index.to_json()
    _write_synced(directory / INDEX_NAME, text)
    crash_point("index")
    digest = hashlib.sha256(text.encode()).hexdigest()
    _write_synced(directory / MARKER_NAME, json.dumps({"index_sha256": digest}) + "\n")


def read_index(directory: str | Path) -> CheckpointIndex:
    """The index of a complete checkpoint; a clear CheckpointError for anything else."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    marker, index_path = directory / MARKER_NAME, directory / INDEX_NAME
    if not index_path.exists():
        if (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
            raise CheckpointError(
                f"{index_path}: missing; {directory} is a regular Hugging Face checkpoint, not a sharded one "
                "(load it with from_pretrained, lazily under lazy_load_for_parallelism)"
            )
        if any(directory.glob("model-pp*-tp*.safetensors")):
            raise CheckpointError(
                f"{index_path}: missing; the save into {directory} did not complete (interrupted?), refusing to load it"
            )
        raise CheckpointError(f"{index_path}: missing; {directory} is not a sharded checkpoint")
    if not marker.exists():
        raise CheckpointError(
            f"{marker}: missing; the save into {directory} did not complete (interrupted?), refusing to load it"
        )
    text = index_path.read_text()
    try:
        expected = json.loads(marker.read_text())["index_sha256"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{marker}: unreadable completion marker") from None
    if hashlib.sha256(text.encode()).hexdigest() != expected:
        raise CheckpointError(f"{index_path}: does not match the checksum in {marker} (altered or truncated)")
    return CheckpointIndex.from_json(text, str(index_path))
