"""Materialising a lazily built model: every meta tensor gets this rank's slice of the checkpoint or of a fresh init.

The lazy front end (`integrations.transformers.lazy_loading`) records, on the model, where each weight lives
(`SOURCES_ATTR`) or how to replay its init (`INIT_ATTR`); this step, run once the model is split, reads only
this rank's slices (under expert parallelism, of its own experts only).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..expert_parallel import expert_range
from ..io.safetensors_io import SLICE_BUFFER, SafetensorsReader
from ..io.slices import read_slice
from ..io.stacked_experts import StackedExpertsSource, read_stacked_experts
from ..mesh import device as devices
from ..mesh import ranks
from ..tensor_parallel.spec import replace_tensor, split_layout

SOURCES_ATTR = "_op_lazy_sources"  # {parameter name: (safetensors file, key) or a StackedExpertsSource}
INIT_ATTR = "_op_lazy_init"  # an object whose .materialize(model, device) replays a lazy from_config's init


def meta_tensors(model: nn.Module) -> Iterator[tuple[list[str], nn.Module, str, torch.Tensor]]:
    """(every name, owner module, attribute, tensor) of each distinct parameter/buffer still on the meta device."""
    names: dict[int, list[str]] = {}
    found: dict[int, tuple[nn.Module, str, torch.Tensor]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for leaf, tensor in table.items():
                if tensor is None or not tensor.is_meta:
                    continue
                names.setdefault(id(tensor), []).append(f"{module_name}.{leaf}" if module_name else leaf)
                found.setdefault(id(tensor), (module, leaf, tensor))
    for key, (module, leaf, tensor) in found.items():
        yield names[key], module, leaf, tensor


def _show_progress() -> bool | None:
    main = not dist.is_initialized() or ranks.global_rank() == 0
    return None if main else True  # tqdm: None = only on a terminal


def materialize_lazy_model(
    model: nn.Module, device: torch.device | str | None = None, read_checkpoint: bool = True
) -> None:
    """Give every meta parameter/buffer of a (parallelized) `model` its real values: this rank's slice of
    the checkpoint (lazy `from_pretrained`) or of a fresh init (lazy `from_config`). No-op for other models.
    `read_checkpoint=False` only allocates what the HF checkpoint would fill (a sharded checkpoint is about
    to overwrite all of it: no double read)."""
    sources: dict[str, object] | None = model.__dict__.get(SOURCES_ATTR)
    init = model.__dict__.pop(INIT_ATTR, None)
    if init is not None:
        init.materialize(model, device)
    pending = list(meta_tensors(model))
    if not pending:
        return
    if sources is None:
        raise ValueError(
            f"{pending[0][0][0]} is on the meta device but no checkpoint source was recorded for it; "
            "build the model under lazy_load_for_parallelism(...)"
        )
    readers: dict[str, SafetensorsReader] = {}

    def opened(file: str) -> SafetensorsReader:
        if file not in readers:
            readers[file] = SafetensorsReader(file)
        return readers[file]

    scratch = torch.empty(SLICE_BUFFER if read_checkpoint else 0, dtype=torch.uint8)  # reused by strided reads
    try:
        for names, module, leaf, tensor in tqdm(pending, desc="lazy load", unit="tensor", disable=_show_progress()):
            source = next((sources[n] for n in names if n in sources), None)
            if source is None:
                raise ValueError(f"{names[0]} is on the meta device and was not found in the checkpoint files")
            if not read_checkpoint:
                replace_tensor(module, leaf, torch.empty(tensor.shape, dtype=tensor.dtype, device=device or "cpu"))
                continue
            if isinstance(source, StackedExpertsSource):  # one tensor per expert on disk
                value = read_stacked_experts(source, opened, split_layout(tensor), expert_range(tensor), scratch)
            else:
                file, key = source
                value = read_slice(opened(file), key, split_layout(tensor), scratch, expert_range(tensor))
            replace_tensor(module, leaf, value.to(device=device or "cpu", dtype=tensor.dtype))
    finally:
        for reader in readers.values():
            reader.close()  # the weights keep their mappings
    model.__dict__.pop(SOURCES_ATTR, None)


def move_to_device(model: nn.Module, device: torch.device | str | None) -> None:
    """`model.to(device)`, keeping every Parameter object, and so the parameter map, tied weights and the layout
    each shard carries: torch's `Module.to` makes new Parameters where the device's tensors are of another kind
    than the CPU's (XLA, and PrivateUse1 devices: Neuron, Ascend; `devices.module_to_keeps_parameters`). None:
    the model stays where it is."""
    if device is None:
        return
    device = torch.device(device)
    if devices.module_to_keeps_parameters(device):
        model.to(device)
        return
    moved: dict[int, torch.Tensor] = {}  # buffers shared between modules move once
    for module in model.modules():
        for leaf, tensor in list(module._parameters.items()):
            if tensor is not None and tensor.device.type != device.type:
                replace_tensor(module, leaf, tensor.detach().to(device))  # in place: every holder sees it
        for leaf, tensor in list(module._buffers.items()):
            if tensor is not None and tensor.device.type != device.type:
                if id(tensor) not in moved:
                    moved[id(tensor)] = tensor.to(device)
                module._buffers[leaf] = moved[id(tensor)]
