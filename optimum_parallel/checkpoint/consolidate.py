"""Sharded checkpoint -> regular Hugging Face checkpoint, streaming one whole tensor at a time.

Our own loop rather than `torch.distributed.checkpoint`'s HF consolidation: that one reads DCP's
own sharding metadata, not our fused/replicated tp layouts, and loads whole files at once.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..io.errors import CheckpointError
from ..io.safetensors_io import SafetensorsWriter, dtype_from_name, nbytes
from .atomic import partial_dir, publish
from .metadata import CheckpointIndex, read_index
from .reading import ShardFiles

HF_INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
DEFAULT_MAX_SHARD_SIZE = "5GB"


def parse_size(size: int | str) -> int:
    """Bytes in '5GB', '500MiB', '2kB' or an int (as transformers' max_shard_size)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?", size.strip().lower())
    if not match:
        raise ValueError(f"size {size!r} is not understood; use e.g. 5GB, 500MiB or a number of bytes")
    value, prefix, binary = match.groups()
    return int(float(value) * (1024 if binary else 1000) ** " kmgt".index(prefix or " "))


def _plan_files(index: CheckpointIndex, max_bytes: int) -> list[list[str]]:
    """Tensor names per output file, in model order, each file at most `max_bytes` (or one tensor)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, entry in index.tensors.items():
        n = nbytes(entry.global_shape, dtype_from_name(entry.dtype))
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def write_hf_checkpoint(
    index: CheckpointIndex,
    checkpoint_dir: Path,
    output_dir: Path,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
) -> list[str]:
    """Write `model-0000i-of-0000n.safetensors` files and `model.safetensors.index.json`; returns the file names."""
    groups = _plan_files(index, parse_size(max_shard_size))
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    total = sum(nbytes(e.global_shape, dtype_from_name(e.dtype)) for e in index.tensors.values())
    weight_map = {}
    largest = max((nbytes(e.global_shape, dtype_from_name(e.dtype)) for e in index.tensors.values()), default=0)
    # two buffers: the next tensor is prepared (read and checked: pread, crc32, both drop the GIL) in a thread while
    # this one is written. A tensor whose bytes lie in order in the shards (replicated, cut along its first dim) is
    # only checked there (crc32 through a file mapping) and then copied inside the kernel from the shard files, as a
    # plain file copy does; the others are assembled in a buffer and written from it.
    buffers = [torch.empty(largest, dtype=torch.uint8) for _ in range(2)]
    order = [name for group in groups for name in group]
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="consolidate", disable=not progress)
    with ShardFiles(checkpoint_dir, index) as shards, ThreadPoolExecutor(1, "consolidate-read") as reads:

        def prepare(position: int) -> list[tuple[int, int, int]] | torch.Tensor:
            entry = index.tensors[order[position]]
            runs = shards.byte_runs(entry)
            if runs is None:
                return shards.assemble(order[position], entry, buffers[position % 2])
            shards.verify(entry)
            return runs

        pending = reads.submit(prepare, 0) if order else None
        position = 0
        for file, group in zip(names, groups, strict=True):
            specs = [(n, dtype_from_name(index.tensors[n].dtype), index.tensors[n].global_shape) for n in group]
            writer = SafetensorsWriter(output_dir / file, specs, {"format": "pt"}, sha256=False, crc32=False)
            try:
                for name in group:
                    prepared = pending.result()
                    position += 1
                    if position < len(order):
                        pending = reads.submit(prepare, position)
                    if isinstance(prepared, torch.Tensor):
                        writer.write(name, prepared)
                    elif not writer.copy(name, prepared):  # the OS cannot copy between these files
                        writer.write(name, shards.assemble(name, index.tensors[name]))
                    bar.update(nbytes(index.tensors[name].global_shape, dtype_from_name(index.tensors[name].dtype)))
                    weight_map[name] = file
                    del prepared
            except BaseException:
                writer.abort()
                raise
            writer.close()
    bar.close()
    hf_index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (output_dir / HF_INDEX).write_text(json.dumps(hf_index, indent=2) + "\n")
    return [*names, HF_INDEX]


def copy_configs(source: Path, destination: Path) -> None:
    for name in CONFIG_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, destination / name)


def consolidate_checkpoint(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
) -> Path:
    """Sharded checkpoint -> standard HF checkpoint (safetensors shards + index + config) that `from_pretrained`
    loads, bit-identical to the saved parallel weights. Streams tensor by tensor; written atomically."""
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir).absolute()
    index = read_index(checkpoint_dir)
    if output_dir.resolve() == checkpoint_dir.resolve():
        raise ValueError(f"output directory {output_dir} is the checkpoint itself; choose another one")
    if output_dir.exists() and not output_dir.is_dir():
        raise CheckpointError(f"{output_dir}: exists and is not a directory")
    tmp = partial_dir(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_hf_checkpoint(index, checkpoint_dir, tmp, max_shard_size, progress)
        copy_configs(checkpoint_dir, tmp)
        publish(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir
