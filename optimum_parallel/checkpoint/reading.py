"""Reading a checkpoint's shards: every file checked against the index (size, tensor dtype/shape, crc32)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..io.errors import CheckpointError
from ..io.file_mapping import can_map
from ..io.safetensors_io import SafetensorsReader, dtype_from_name, nbytes
from .metadata import CheckpointIndex, Shard, TensorEntry


class ShardFiles:
    """The files of one checkpoint, opened on first use; use as a context manager."""

    def __init__(self, directory: str | Path, index: CheckpointIndex) -> None:
        self.directory = Path(directory)
        self.index = index
        self._readers: dict[str, SafetensorsReader] = {}

    def reader(self, file: str) -> SafetensorsReader:
        if file not in self._readers:
            info = self.index.files.get(file)
            if info is None:
                raise CheckpointError(f"{self.directory / file}: not listed in the checkpoint index")
            self._readers[file] = SafetensorsReader(self.directory / file, expected_size=info["size"])
        return self._readers[file]

    def _checked_reader(self, entry: TensorEntry, shard: Shard) -> SafetensorsReader:
        """The reader of `shard`'s file, once its tensor's dtype and shape are the index's."""
        reader = self.reader(shard.file)
        dtype, shape = reader.info(shard.key)
        expected = (dtype_from_name(entry.dtype), entry.local_shape(shard))
        if (dtype, shape) != expected:
            raise CheckpointError(
                f"{reader.path}: tensor {shard.key!r} is {dtype} {list(shape)}, the index expects "
                f"{expected[0]} {list(expected[1])} (altered file?)"
            )
        return reader

    def read_shard(self, name: str, entry: TensorEntry, shard: Shard, out: torch.Tensor | None = None) -> torch.Tensor:
        """One shard of `entry` as stored (its local shape), checked against the index."""
        return self._checked_reader(entry, shard).read(shard.key, out=out, crc32=shard.crc32)

    def _verified_reader(self, entry: TensorEntry, shard: Shard) -> SafetensorsReader:
        """The reader of `shard`'s file, once its tensor is checked against the index (dtype, shape, crc32)
        without reading it into memory."""
        reader = self._checked_reader(entry, shard)
        if shard.crc32 is not None and reader.checksum(shard.key) != shard.crc32:
            raise CheckpointError(f"{reader.path}: tensor {shard.key!r} does not match its checksum (file altered)")
        return reader

    def verify(self, entry: TensorEntry) -> None:
        """Every shard of `entry` checked against the index (dtype, shape, crc32) without reading it into memory."""
        for shard in entry.shards:
            self._verified_reader(entry, shard)

    def mapped_shard(self, entry: TensorEntry, shard: Shard) -> torch.Tensor:
        """One shard of `entry` as stored, checked, as a copy-on-write mapping of its bytes where the OS has them
        (no copy into fresh memory: pages of the page cache), else read."""
        reader = self._verified_reader(entry, shard)
        if not can_map():
            return reader.read(shard.key)
        _, shape = reader.info(shard.key)
        return reader.map_rows(shard.key, 0, shape[0]) if shape else reader.read(shard.key)

    def assemble(self, name: str, entry: TensorEntry, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The whole (global) tensor, from one copy of each distinct shard; in `buffer` (flat uint8, reused from
        tensor to tensor by streaming conversions: fresh memory costs a page fault per 4 KiB) when it is big enough.
        An expert tensor is assembled block of experts by block (each ep rank's, itself cut over tp)."""
        dtype = dtype_from_name(entry.dtype)
        size = nbytes(entry.global_shape, dtype)
        if buffer is not None and buffer.numel() >= size:
            full = buffer[:size].view(dtype).view(entry.global_shape)
        else:
            full = torch.empty(entry.global_shape, dtype=dtype)
        if not entry.experts:
            return self._fill(name, entry, full)
        position = 0
        for start, end, block in entry.expert_blocks():
            if start != position:
                break
            self._fill(name, block, full.narrow(0, start, end - start))
            position = end
        if position != entry.global_shape[0]:
            raise CheckpointError(
                f"{self.directory}: the expert blocks of {name!r} cover "
                f"{[(s, e) for s, e, _ in entry.expert_blocks()]} of [0, {entry.global_shape[0]}), not all of it "
                "without overlaps"
            )
        return full

    def _fill(self, name: str, entry: TensorEntry, full: torch.Tensor) -> torch.Tensor:
        """`full` (the entry's global shape) filled from one copy of each distinct shard."""
        if entry.dim is None:
            return self.read_shard(name, entry, entry.shards[0], out=full)
        dim = entry.dim
        covered: set[tuple[int, int]] = set()  # a replicated packed part (a kv head) is in several shards
        for shard in entry.shards:
            ranges = [(int(s), int(e)) for s, e in shard.ranges]
            if len(ranges) == 1 and all(s == 1 for s in entry.global_shape[:dim]):
                start, end = ranges[0]  # a contiguous block of `full`: read straight into it
                self.read_shard(name, entry, shard, out=full.narrow(dim, start, end - start))
            else:
                local, offset = self.mapped_shard(entry, shard), 0
                for start, end in ranges:
                    if (start, end) not in covered:
                        full.narrow(dim, start, end - start).copy_(local.narrow(dim, offset, end - start))
                    offset += end - start
            covered.update(ranges)
        position = 0
        for start, end in sorted(covered):
            if start != position:
                break
            position = end
        if position != entry.global_shape[dim]:
            raise CheckpointError(
                f"{self.directory}: the shards of {name!r} cover {sorted(covered)} of [0, {entry.global_shape[dim]}) "
                f"along dim {dim}, not all of it without overlaps"
            )
        return full

    def byte_runs(self, entry: TensorEntry) -> list[tuple[int, int, int]] | None:
        """The global tensor as runs of bytes already laid out, in order, in the shard files: (file descriptor,
        offset, length) each; None where the shards interleave in it (a cut after a dim of size > 1, expert blocks)
        or do not cover it once. Copy from them only once `verify` (or `assemble`) checked the shards."""
        if entry.experts or (entry.dim is not None and any(s != 1 for s in entry.global_shape[: entry.dim])):
            return None
        dtype = dtype_from_name(entry.dtype)
        if entry.dim is None:
            reader = self.reader(entry.shards[0].file)
            begin, end = reader.byte_range(entry.shards[0].key)
            return [(reader.fileno(), begin, end - begin)]
        row = nbytes(entry.global_shape[entry.dim + 1 :], dtype)
        pieces: dict[int, tuple[int, int, int]] = {}  # start -> (end, fd, offset); replicated parts kept once
        for shard in entry.shards:
            reader = self.reader(shard.file)
            offset, _ = reader.byte_range(shard.key)
            for start, end in ((int(s), int(e)) for s, e in shard.ranges):
                pieces.setdefault(start, (end, reader.fileno(), offset))
                offset += (end - start) * row
        runs, position = [], 0
        for start in sorted(pieces):
            end, fd, offset = pieces[start]
            if start != position:
                return None
            runs.append((fd, offset, (end - start) * row))
            position = end
        return runs if position == entry.global_shape[entry.dim] else None

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
