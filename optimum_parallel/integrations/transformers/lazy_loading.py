"""`lazy_load_for_parallelism`: transformers' `from_pretrained` / `from_config` build on the meta device.

transformers' own `from_pretrained` runs as usual (config, dtype, key renaming, tying, buffer init) except that
its weight-loading step only records where each weight lives (read with `safe_open`); the engine's
`materialize_lazy_model` then takes this rank's slice of every split parameter once the model is split.
`from_config` builds on meta too; its random init is replayed one module at a time. The transformers
internals touched here are named in `internals.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn

from ...engine.materialize import INIT_ATTR, SOURCES_ATTR, meta_tensors
from ...mesh import check_positive_int
from ...tensor_parallel.spec import replace_tensor, split_layout
from .internals import transformers_internal


@dataclass
class _LazyInit:
    """Replays a lazy `from_config`'s weight init per module (in transformers' order, from the RNG state it
    had), keeping only this rank's slice of each weight: ranks agree, and no whole model is ever built."""

    rng_state: torch.Tensor
    modules: list[tuple[str, nn.Module, nn.Module]] = field(default_factory=list)  # (name, original, init owner)

    def materialize(self, model: nn.Module, device: torch.device | str | None) -> None:
        live = {n: (m, leaf, t) for names, m, leaf, t in meta_tensors(model) for n in names}
        with (
            torch.random.fork_rng(devices=[]),
            transformers_internal("initialization.guard_torch_init_functions")(),
            torch.no_grad(),
        ):
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
                    layout = split_layout(tensor)
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


def _record_instead_of_loading(model, state_dict, checkpoint_files, load_config, expected_keys=None):
    """Stands in for `PreTrainedModel._load_pretrained_model`: map every checkpoint key to its model key,
    exactly as transformers renames them, and leave the weights on the meta device."""
    WeightConverter = transformers_internal("core_model_loading.WeightConverter")  # noqa: N806 - classes
    WeightRenaming = transformers_internal("core_model_loading.WeightRenaming")  # noqa: N806
    rename_source_key = transformers_internal("core_model_loading.rename_source_key")
    LoadStateDictInfo = transformers_internal("loading_report.LoadStateDictInfo")  # noqa: N806

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


@contextmanager
def lazy_load_for_parallelism(
    tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, expert_parallel_size: int = 1
) -> Iterator[None]:
    """Context manager: `from_pretrained` / `from_config` build the model on the meta device and record where
    each weight lives; `Parallelizer.parallelize` then reads only this rank's slices (of its experts, under ep).
    A no-op when every size is 1.
    """
    check_positive_int("tensor_parallel_size", tensor_parallel_size)
    check_positive_int("pipeline_parallel_size", pipeline_parallel_size)
    check_positive_int("expert_parallel_size", expert_parallel_size)
    if tensor_parallel_size == 1 and pipeline_parallel_size == 1 and expert_parallel_size == 1:
        yield
        return
    from transformers import PreTrainedModel

    for name in (
        "PreTrainedModel._load_pretrained_model",
        "PreTrainedModel._from_config",
        "PreTrainedModel._init_weights",
    ):
        transformers_internal(name)  # fail loudly here, not halfway through from_pretrained
    saved = {name: PreTrainedModel.__dict__[name] for name in ("_load_pretrained_model", "_from_config")}
    PreTrainedModel._load_pretrained_model = staticmethod(_record_instead_of_loading)
    PreTrainedModel._from_config = _lazy_from_config(saved["_from_config"])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(PreTrainedModel, name, value)
