"""Lazy loading for parallelism: build on the meta device, read each rank's slice from safetensors.

Under `lazy_load_for_parallelism`, transformers' own `from_pretrained` runs as usual (config,
dtype, key renaming, tying, buffer init) except that its weight-loading step only records where
each weight lives (read with `safe_open`); `Parallelizer.parallelize` then calls
`materialize_lazy_model`, which takes this rank's slice of every split parameter (a copy-on-write
mapping of its bytes where they are contiguous on disk, a pread otherwise; see `read_slice`) and
replicated weights in full. `from_config` builds on meta too; its random init then runs one module at
a time.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from .checkpoint.collect import replace_tensor
from .checkpoint.file_mapping import can_map
from .checkpoint.safetensors_io import SLICE_BUFFER, SafetensorsReader
from .tensor_parallel.layout import ShardLayout

SOURCES_ATTR = "_op_lazy_sources"
INIT_ATTR = "_op_lazy_init"
LAZY_OPTIMIZER_ATTR = "_op_lazy_optimizer"


# --------------------------------------------------------------------------------------------- materialising


def read_slice(
    reader: SafetensorsReader, key: str, layout: ShardLayout | None, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's slice of tensor `key` of a safetensors file (all of it when `layout` is None).

    Where the slice is one run of bytes on disk (a replicated weight, the rows of a dim-0 split) it is, as in
    transformers' own loading, a copy-on-write mapping of the file: nothing is copied at load, a page is read
    when first touched, writing a weight copies its page and never the file. Unlike `safe_open`, only the
    slice's own bytes are mapped (`file_mapping`). Any other slice is read with pread into its own memory
    (through `scratch`, see `SafetensorsReader.read_slice`).
    Our own saves write new files and rename them, so they never change the bytes under a loaded model;
    rewriting the HF files in place while the model lives would.
    """
    _, shape = reader.info(key)
    if layout is not None and shape != tuple(layout.global_shape):
        raise ValueError(f"{reader.path}: {key} has shape {list(shape)}, the model expects {list(layout.global_shape)}")
    if layout is None or (layout.dim == 0 and len(layout.ranges) == 1):
        if not can_map():
            return reader.read(key) if layout is None else reader.read_slice(key, 0, layout.ranges, scratch)
        start, stop = layout.ranges[0] if layout is not None else (0, shape[0] if shape else 0)
        return reader.map_rows(key, start, stop)
    return reader.read_slice(key, layout.dim, layout.ranges, scratch)


def _owners(model: nn.Module, meta_only: bool) -> Iterator[tuple[list[str], nn.Module, str, torch.Tensor]]:
    """(every name, owner module, attribute, tensor) of each distinct parameter/buffer, meta ones if asked."""
    names: dict[int, list[str]] = {}
    found: dict[int, tuple[nn.Module, str, torch.Tensor]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for leaf, tensor in table.items():
                if tensor is None or (meta_only and tensor.device.type != "meta"):
                    continue
                names.setdefault(id(tensor), []).append(f"{module_name}.{leaf}" if module_name else leaf)
                found.setdefault(id(tensor), (module, leaf, tensor))
    for key, (module, leaf, tensor) in found.items():
        yield names[key], module, leaf, tensor


def _split(tensor: torch.Tensor) -> ShardLayout | None:
    layout = getattr(tensor, "shard_layout", None)
    return layout if layout is not None and layout.dim is not None else None


def _show_progress() -> bool | None:
    main = not dist.is_initialized() or dist.get_rank() == 0
    return None if main else True  # tqdm: None = only on a terminal


def materialize_lazy_model(
    model: nn.Module, device: torch.device | str | None = None, read_checkpoint: bool = True
) -> None:
    """Give every meta parameter/buffer of a (parallelized) `model` its real values: this rank's slice of
    the checkpoint (lazy `from_pretrained`) or of a fresh init (lazy `from_config`). No-op for other models.
    `read_checkpoint=False` only allocates what the HF checkpoint would fill (a sharded checkpoint is about
    to overwrite all of it: no double read)."""
    sources: dict[str, tuple[str, str]] | None = model.__dict__.get(SOURCES_ATTR)
    init: _LazyInit | None = model.__dict__.pop(INIT_ATTR, None)
    if init is not None:
        init.materialize(model, device)
    pending = list(_owners(model, meta_only=True))
    if not pending:
        return
    if sources is None:
        raise ValueError(
            f"{pending[0][0][0]} is on the meta device but no checkpoint source was recorded for it; "
            "build the model under lazy_load_for_parallelism(...)"
        )
    readers: dict[str, SafetensorsReader] = {}
    scratch = torch.empty(SLICE_BUFFER if read_checkpoint else 0, dtype=torch.uint8)  # reused by strided reads
    try:
        for names, module, leaf, tensor in tqdm(pending, desc="lazy load", unit="tensor", disable=_show_progress()):
            source = next((sources[n] for n in names if n in sources), None)
            if source is None:
                raise ValueError(f"{names[0]} is on the meta device and was not found in the checkpoint files")
            file, key = source
            if not read_checkpoint:
                replace_tensor(module, leaf, torch.empty(tensor.shape, dtype=tensor.dtype, device=device or "cpu"))
                continue
            if file not in readers:
                readers[file] = SafetensorsReader(file)
            value = read_slice(readers[file], key, _split(tensor), scratch)
            replace_tensor(module, leaf, value.to(device=device or "cpu", dtype=tensor.dtype))
    finally:
        for reader in readers.values():
            reader.close()  # the weights keep their mappings
    model.__dict__.pop(SOURCES_ATTR, None)


@dataclass
class _LazyInit:
    """Replays a lazy `from_config`'s weight init per module (in transformers' order, from the RNG state it
    had), keeping only this rank's slice of each weight: ranks agree, and no whole model is ever built."""

    rng_state: torch.Tensor
    modules: list[tuple[str, nn.Module, nn.Module]] = field(default_factory=list)  # (name, original, init owner)

    def materialize(self, model: nn.Module, device: torch.device | str | None) -> None:
        from transformers import initialization

        live = {n: (m, leaf, t) for names, m, leaf, t in _owners(model, meta_only=True) for n in names}
        with torch.random.fork_rng(devices=[]), initialization.guard_torch_init_functions(), torch.no_grad():
            torch.set_rng_state(self.rng_state)
            for name, original, owner in self.modules:
                stand_in = copy.copy(original)  # same class and attributes, real full-size parameters
                stand_in._parameters = {
                    k: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
                    for k, p in original._parameters.items()
                }
                owner._init_weights(stand_in)
                for leaf, full in stand_in._parameters.items():
                    target = live.get(f"{name}.{leaf}" if name else leaf)
                    if full is None or target is None or target[2].device.type != "meta":
                        continue  # tied to (and initialised as) an earlier weight
                    module, attr, tensor = target
                    layout = _split(tensor)
                    value = (layout.slice(full) if layout is not None else full).clone()
                    replace_tensor(module, attr, value.to(device=device or "cpu"))


def _record_init(model: nn.Module) -> None:
    """Remember, in transformers' init order (children first), each module that owns parameters."""
    from transformers import PreTrainedModel

    order: list[tuple[str, nn.Module, nn.Module]] = []

    def visit(name: str, module: nn.Module, owner: nn.Module) -> None:
        for child_name, child in module.named_children():
            child_owner = child if isinstance(child, PreTrainedModel) else owner
            visit(f"{name}.{child_name}" if name else child_name, child, child_owner)
        if any(p is not None for p in module._parameters.values()):
            order.append((name, module, owner))

    visit("", model, model)
    model.__dict__[INIT_ATTR] = _LazyInit(torch.get_rng_state(), order)


# --------------------------------------------------------------------------------------------- from_pretrained


def _record_instead_of_loading(model, state_dict, checkpoint_files, load_config, expected_keys=None):
    """Stands in for `PreTrainedModel._load_pretrained_model`: map every checkpoint key to its model key,
    exactly as transformers renames them, and leave the weights on the meta device."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    if state_dict is not None or not checkpoint_files:
        raise ValueError("lazy_load_for_parallelism loads from safetensors files, not from_pretrained(state_dict=...)")
    for file in checkpoint_files:
        if not str(file).endswith(".safetensors"):
            raise ValueError(
                f"{file}: lazy loading reads slices of safetensors files, not .bin/.pt checkpoints; convert it once "
                "outside lazy_load_for_parallelism with AutoModel.from_pretrained(path).save_pretrained(new_path)"
            )
    if load_config.hf_quantizer is not None:
        raise NotImplementedError("lazy_load_for_parallelism does not support quantized checkpoints")
    mapping = load_config.weight_mapping or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    expected = model.state_dict()
    sources: dict[str, tuple[str, str]] = {}
    unexpected = set()
    for file in checkpoint_files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
                if target not in expected and key in expected:
                    target, pattern = key, None
                if target not in expected:
                    unexpected.add(key)
                    continue
                if pattern is not None:
                    raise NotImplementedError(
                        f"{file}: {key} needs the weight conversion {pattern!r} to become {target}; lazy loading "
                        "reads tensors as stored (convert the checkpoint once with save_pretrained)"
                    )
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(expected[target].shape):
                    raise ValueError(
                        f"{file}: {key} has shape {list(shape)}, the model expects {target} "
                        f"{list(expected[target].shape)}"
                    )
                sources[target] = (str(file), key)
                model.get_parameter_or_buffer(target)._is_hf_initialized = True  # transformers' "loaded" flag
    missing = set(expected) - set(sources)  # tied aliases included, as transformers expects
    # tied weights are read from their source's tensor, also where only the alias survives (a pipeline's last stage)
    for alias, target in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in sources:
            sources.setdefault(alias, sources[target])
    model.__dict__[SOURCES_ATTR] = sources
    info = LoadStateDictInfo(
        missing_keys=missing,
        unexpected_keys=unexpected,
        mismatched_keys=set(),
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )
    return info, None


def _lazy_from_config(original):
    def from_config(cls, config, **kwargs):
        with init_empty_weights(include_buffers=False):  # real buffers (rotary inv_freq) computed as usual
            model = original.__func__(cls, config, **kwargs)
        _record_init(model)
        return model

    return classmethod(from_config)


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return value


@contextmanager
def lazy_load_for_parallelism(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> Iterator[None]:
    """Context manager: `from_pretrained` / `from_config` build the model on the meta device and record where
    each weight lives; `Parallelizer.parallelize` then reads only this rank's slices. A no-op when both sizes are 1.
    """
    _check_size("tensor_parallel_size", tensor_parallel_size)
    _check_size("pipeline_parallel_size", pipeline_parallel_size)
    if tensor_parallel_size == 1 and pipeline_parallel_size == 1:
        yield
        return
    from transformers import PreTrainedModel

    saved = {name: PreTrainedModel.__dict__[name] for name in ("_load_pretrained_model", "_from_config")}
    PreTrainedModel._load_pretrained_model = staticmethod(_record_instead_of_loading)
    PreTrainedModel._from_config = _lazy_from_config(saved["_from_config"])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(PreTrainedModel, name, value)


# --------------------------------------------------------------------------------------------- optimizer


@dataclass
class _LazyOptimizerSpec:
    cls: type[torch.optim.Optimizer]
    params: list[list[nn.Parameter]]  # the original parameters, per param group
    args: tuple
    kwargs: dict[str, Any]


def make_optimizer_constructor_lazy(optimizer_cls: type[torch.optim.Optimizer]):
    """A constructor with `optimizer_cls`'s signature that builds a placeholder optimizer over meta copies of
    the parameters (arguments validated, no real memory touched) and remembers its arguments;
    `Parallelizer.optimizer_for_mp` then builds the real one over the parallel parameters."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"make_optimizer_constructor_lazy expects an optimizer class, got {optimizer_cls!r}")

    def constructor(params, *args, **kwargs) -> torch.optim.Optimizer:
        params = list(params)
        groups = params if params and isinstance(params[0], Mapping) else [{"params": params}]
        originals, placeholder_groups = [], []
        for group in groups:
            members = group["params"]
            members = [members] if isinstance(members, torch.Tensor) else list(members)
            originals.append(members)
            meta = [nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for p in members]
            placeholder_groups.append({**group, "params": meta})
        optimizer = optimizer_cls(placeholder_groups, *args, **kwargs)
        setattr(optimizer, LAZY_OPTIMIZER_ATTR, _LazyOptimizerSpec(optimizer_cls, originals, args, kwargs))
        return optimizer

    constructor.__name__ = constructor.__qualname__ = f"lazy_{optimizer_cls.__name__}"
    constructor.__doc__ = f"Lazy {optimizer_cls.__name__}: built for real by Parallelizer.optimizer_for_mp."
    constructor.__signature__ = inspect.signature(optimizer_cls)
    return constructor


def is_lazy_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return hasattr(optimizer, LAZY_OPTIMIZER_ATTR)


def build_lazy_optimizer(
    optimizer: torch.optim.Optimizer, orig_param_to_parallel_param: Mapping[int, nn.Parameter]
) -> torch.optim.Optimizer:
    """The real optimizer for a placeholder from `make_optimizer_constructor_lazy`: same class, arguments,
    param groups and (current) hyper-parameters, over the parallel parameters (groups left empty on this
    pipeline stage are dropped, as `optimizer_for_mp` does for a regular optimizer)."""
    spec: _LazyOptimizerSpec = getattr(optimizer, LAZY_OPTIMIZER_ATTR)
    groups = []
    for group, originals in zip(optimizer.param_groups, spec.params, strict=True):
        params = [orig_param_to_parallel_param.get(id(p), p) for p in originals]
        params = [p for p in params if p is not None]  # None: the parameter lives on another pipeline stage
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return spec.cls(groups, *spec.args, **spec.kwargs)
