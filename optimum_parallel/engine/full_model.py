"""The whole model from a parallel one: `save_pretrained` that writes what one device would, and `full_state_dict`.

Every rank saves its shards as a sharded checkpoint does; rank 0 consolidates them into a standard Hugging Face
checkpoint that `from_pretrained` loads on one device. Every rank must call it (a rank left waiting
`EVERY_RANK_TIMEOUT` seconds raises before anything is written). Details: docs/module_notes.md,
"engine/full_model.py".
"""

from __future__ import annotations

import shutil
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from ..checkpoint import save_model_checkpoint
from ..mesh import ranks
from ..mesh.timeouts import long_running_call

EVERY_RANK_TIMEOUT = 30.0  # seconds a rank waits for the others to call save_pretrained
_CALLS: dict[str, int] = {}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _every_rank(what: str, timeout: float = EVERY_RANK_TIMEOUT) -> None:
    """Return once every rank has called `what` (its n-th call on each rank); raise on a rank that waited `timeout`
    seconds for the others, before it writes anything."""
    if not dist.is_initialized() or ranks.world_size() == 1:
        return
    count = _CALLS[what] = _CALLS.get(what, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    key = f"optimum_parallel/{what}/{count}"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout
    world = ranks.world_size()
    while arrived < world:
        if time.monotonic() > deadline:
            store.add(key, -1)  # as if this call never came: the next one meets the other ranks' first
            _CALLS[what] = count - 1
            raise RuntimeError(
                f"{what} was called on {arrived} of {world} ranks: a parallel model's {what} gathers its shards from "
                f"every rank, so call it on every rank (rank 0 writes the files), e.g. not under `if rank == 0:`"
            )
        time.sleep(0.01)
        arrived = store.add(key, 0)


@long_running_call("save_pretrained")  # the init timeout: one rank may write for minutes (mesh/timeouts.py)
def save_pretrained(
    model: nn.Module,
    save_directory: str | Path,
    *args,
    max_shard_size: int | str = "5GB",
    state_dict: dict | None = None,
    safe_serialization: bool = True,
    **kwargs,
) -> None:
    """`model.save_pretrained(save_directory)` for a parallel model: a standard Hugging Face checkpoint of the whole
    model (docs/module_notes.md). Call it on every rank."""
    if state_dict is not None or not safe_serialization:
        raise ValueError(
            "save_pretrained of a parallel model takes neither state_dict= nor safe_serialization=False; allowed: "
            "save_pretrained(directory, max_shard_size=...), which gathers the whole model into safetensors"
        )
    _every_rank("save_pretrained")
    target = Path(save_directory).absolute()
    staging = target.parent / f".{target.name}.save_pretrained"
    save_model_checkpoint(model, staging, as_regular=True, as_sharded=False, max_shard_size=max_shard_size)
    if ranks.global_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
        for old in target.iterdir():  # weights of an earlier save (other shard counts) would be read with the new ones
            if old.name in WEIGHT_FILES or (old.name.startswith("model-") and old.suffix == ".safetensors"):
                old.unlink()
        for path in staging.iterdir():
            if not path.name.startswith("."):
                shutil.move(str(path), target / path.name)
        shutil.rmtree(staging, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def full_state_dict(model: nn.Module, directory: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict (the names and tensors one device's `state_dict()` would give), on every rank:
    saved as by `save_pretrained` into `directory` (default: a temporary one beside the current directory, which every
    rank must see) and read back. Call it on every rank."""
    base = Path(directory) if directory is not None else Path.cwd() / ".op_full_state_dict"
    path = [str(base / f"{int(time.time() * 1e6)}")]
    if dist.is_initialized():
        dist.broadcast_object_list(path, src=0)
    save_pretrained(model, path[0])
    try:
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path[0]).glob("*.safetensors")):
            tensors.update(load_file(file))
        return tensors
    finally:
        if dist.is_initialized():
            dist.barrier()
        if ranks.global_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def install_save_pretrained(model: nn.Module) -> None:
    """A transformers model's `save_pretrained` becomes the whole-model one (an instance attribute over the class's)."""
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = types.MethodType(save_pretrained, model)
