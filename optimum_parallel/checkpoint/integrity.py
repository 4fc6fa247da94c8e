"""Full verification of a sharded checkpoint: marker, index, every file's presence, size and sha256."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from ..io.errors import CheckpointError
from ..io.safetensors_io import SafetensorsReader, file_sha256
from .metadata import CheckpointIndex, read_index


def verify_checkpoint(checkpoint_dir: str | Path, full: bool = True, progress: bool = False) -> CheckpointIndex:
    """Raise CheckpointError naming the first bad file; `full` also re-hashes every byte (sha256)."""
    directory = Path(checkpoint_dir)
    index = read_index(directory)
    for name, info in tqdm(index.files.items(), desc="verify", disable=not progress):
        path = directory / name
        with SafetensorsReader(path, expected_size=info["size"]):
            pass
        if full and file_sha256(path) != info["sha256"]:
            raise CheckpointError(f"{path}: sha256 does not match the checkpoint index (altered file)")
    for table in (index.tensors, index.optimizer_tensors):
        for name, entry in table.items():
            for shard in entry.shards:
                if shard.file not in index.files:
                    raise CheckpointError(
                        f"{directory}: {name} is stored in {shard.file}, which the index does not list"
                    )
    return index
