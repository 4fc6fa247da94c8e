"""`lazy_load_for_parallelism`: transformers' `from_pretrained` / `from_config` build on the meta device.

transformers' own `from_pretrained` runs as usual (config, dtype, key renaming, tying, buffer init) except that
its weight-loading step only records where each weight lives (read with `safe_open`); the engine's
`materialize_lazy_model` then takes this rank's slice of every split parameter once the model is split.
`from_config` builds on meta too; its random init is replayed one module at a time. The transformers
internals touched here are named in `internals.py`.
"""

from __future__ import annotations

import copy
import functools
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from ...engine.materialize import INIT_ATTR, SOURCES_ATTR, meta_tensors
from ...io.stacked_experts import StackedExpertsSource
from ...mesh import check_positive_int
from ...tensor_parallel.spec import replace_tensor, split_layout
from .internals import transformers_internal


@dataclass
class _LazyInit:
    """Replays a lazy `from_config`'s weight init per module (in transformers' order, from the RNG state it
    had), keeping only this rank's slice of each weight: ranks agree, and no whole model is ever built."""

    rng_state: torch.Tensor
    # (name, original, init owner, {leaf: (whole shape, dtype)}): shapes recorded before any split (the parallel model
    # keeps the original parameter objects, holding shards)
    modules: list[tuple[str, nn.Module, nn.Module, dict]] = field(default_factory=list)

    def materialize(self, model: nn.Module, device: torch.device | str | None) -> None:
        live = {n: (m, leaf, t) for names, m, leaf, t in meta_tensors(model) for n in names}
        with (
            torch.random.fork_rng(devices=[]),
            transformers_internal("initialization.guard_torch_init_functions")(),
            torch.no_grad(),
        ):
            torch.set_rng_state(self.rng_state)
            for name, original, owner, shapes in self.modules:
                stand_in = copy.copy(original)  # same class and attributes, real full-size parameters
                stand_in._parameters = {
                    k: None
                    if k not in shapes
                    else nn.Parameter(torch.empty(shapes[k][0], dtype=shapes[k][1]), requires_grad=False)
                    for k in original._parameters
                }
                owner._init_weights(stand_in)
                for leaf, full in stand_in._parameters.items():
                    target = live.get(f"{name}.{leaf}" if name else leaf)
                    if full is None or target is None or not target[2].is_meta:
                        continue  # tied to (and initialised as) an earlier weight
                    module, attr, tensor = target
                    layout = split_layout(tensor)
                    value = (layout.slice(full) if layout is not None else full).clone()
                    replace_tensor(module, attr, value.to(device=device or "cpu"))


def _record_init(model: nn.Module) -> None:
    """Remember, in transformers' init order (children first), each module that owns parameters."""
    from transformers import PreTrainedModel

    order: list[tuple[str, nn.Module, nn.Module, dict]] = []

    def visit(name: str, module: nn.Module, owner: nn.Module) -> None:
        for child_name, child in module.named_children():
            child_owner = child if isinstance(child, PreTrainedModel) else owner
            visit(f"{name}.{child_name}" if name else child_name, child, child_owner)
        shapes = {k: (tuple(p.shape), p.dtype) for k, p in module._parameters.items() if p is not None}
        if shapes:
            order.append((name, module, owner, shapes))

    visit("", model, model)
    model.__dict__[INIT_ATTR] = _LazyInit(torch.get_rng_state(), order)


class _PerExpertTensors:
    """The per-expert tensors of a checkpoint that transformers stacks at load (`MergeModulelist(dim=0)`, then for
    gate and up `Concatenate(dim=1)`): collected by target, then recorded as one `StackedExpertsSource` each. Any
    other weight conversion is refused: lazy loading reads tensors as stored."""

    def __init__(self) -> None:
        self.found: dict[str, dict[int, dict[int, tuple[str, str, tuple[int, ...]]]]] = {}  # target -> part -> expert

    def add(self, file, key: str, target: str, pattern: str, converters, shape: tuple[int, ...]) -> None:
        MergeModulelist = transformers_internal("core_model_loading.MergeModulelist")  # noqa: N806 - classes
        Concatenate = transformers_internal("core_model_loading.Concatenate")  # noqa: N806
        converter = next(c for c in converters if pattern in c.source_patterns)
        kinds = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
        stacking = kinds[:1] == [(MergeModulelist, 0)] and kinds[1:] in ([], [(Concatenate, 1)])
        expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key) if stacking else None
        if expert is None:
            raise NotImplementedError(
                f"{file}: {key} needs the weight conversion {pattern!r} to become {target}; lazy loading reads "
                "tensors as stored or stacks per-expert tensors, nothing else (convert the checkpoint once with "
                "save_pretrained)"
            )
        part = converter.source_patterns.index(pattern)
        self.found.setdefault(target, {}).setdefault(part, {})[int(expert.group(1))] = (str(file), key, shape)

    def sources(self, expected: dict) -> dict[str, StackedExpertsSource]:
        out = {}
        for target, parts in self.found.items():
            count = expected[target].shape[0]
            for part, per_expert in parts.items():
                if sorted(per_expert) != list(range(count)):
                    raise ValueError(f"{target}: part {part} has experts {sorted(per_expert)}, expected 0..{count - 1}")
            ordered = [parts[p] for p in sorted(parts)]
            rows = tuple(part[0][2][0] for part in ordered)
            stacked = (count, sum(rows), *ordered[0][0][2][1:]) if len(rows) > 1 else (count, *ordered[0][0][2])
            if stacked != tuple(expected[target].shape):
                raise ValueError(
                    f"{target}: the per-expert tensors stack to {list(stacked)}, the model expects "
                    f"{list(expected[target].shape)}"
                )
            parts_files = tuple(tuple((f, k) for f, k, _ in (part[e] for e in range(count))) for part in ordered)
            out[target] = StackedExpertsSource(parts_files, rows)
        return out


class _DeferredConversions:
    """Stands in for the conversion mapping transformers builds before loading (`get_model_conversion_mapping`
    compiles the renaming and conversion patterns of every model type on first use: ~0.08 s of a ~0.3 s lazy
    load): built only where a checkpoint key is not a model key as stored."""

    def __init__(self, build, args, kwargs) -> None:
        self._build, self._args, self._kwargs = build, args, kwargs

    def build(self) -> list:
        return self._build(*self._args, **self._kwargs) or []


def _deferred_conversion_mapping(build):
    @functools.wraps(build)  # its signature is transformers' (checked by transformers_internal)
    def deferred(*args, **kwargs):
        return _DeferredConversions(build, args, kwargs)

    return deferred


def _checkpoint_shapes(checkpoint_files) -> dict[str, dict[str, tuple[int, ...]]]:
    """{file: {key: shape}} from the safetensors headers."""
    shapes = {}
    for file in checkpoint_files:
        with safe_open(file, framework="pt") as f:
            shapes[str(file)] = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    return shapes


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
    expected = model.state_dict()
    shapes = _checkpoint_shapes(checkpoint_files)
    mapping = load_config.weight_mapping
    if isinstance(mapping, _DeferredConversions):
        # every key a model key as stored: no conversion applies, as transformers then records (none used)
        as_stored = all(key in expected for keys in shapes.values() for key in keys)
        mapping = [] if as_stored else mapping.build()
        model._weight_conversions = [] if as_stored else None
    renamings = [m for m in mapping or [] if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping or [] if isinstance(m, WeightConverter)]
    sources: dict[str, object] = {}
    experts = _PerExpertTensors()
    unexpected = set()
    for file, keys in shapes.items():
        for key, shape in keys.items():
            target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
            if target not in expected and key in expected:
                target, pattern = key, None
            if target not in expected:
                unexpected.add(key)
                continue
            if pattern is not None:
                experts.add(file, key, target, pattern, converters, shape)
                continue
            if shape != tuple(expected[target].shape):
                raise ValueError(
                    f"{file}: {key} has shape {list(shape)}, the model expects {target} {list(expected[target].shape)}"
                )
            sources[target] = (file, key)
            model.get_parameter_or_buffer(target)._is_hf_initialized = True  # transformers' "loaded" flag
    for target, source in experts.sources(expected).items():
        sources[target] = source
        model.get_parameter_or_buffer(target)._is_hf_initialized = True
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
        from accelerate import init_empty_weights  # here, not at import: accelerate costs ~0.1 s to import

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
    with _patched_transformers():
        yield


_PATCH_LOCK = threading.Lock()
_patch_depth = 0  # contexts open in this process (threads: one rank per thread on XLA devices)
_originals: dict[str, object] = {}


@contextmanager
def _patched_transformers() -> Iterator[None]:
    """transformers' loading patched while any lazy context is open: the first to enter patches, the last to leave
    restores (two threads entering at once must not save each other's patches as the originals)."""
    global _patch_depth
    from transformers import PreTrainedModel

    for name in (
        "PreTrainedModel._load_pretrained_model",
        "PreTrainedModel._from_config",
        "PreTrainedModel._init_weights",
        "modeling_utils.get_model_conversion_mapping",
    ):
        transformers_internal(name)  # fail loudly here, not halfway through from_pretrained
    import transformers.modeling_utils as modeling_utils

    with _PATCH_LOCK:
        if _patch_depth == 0:
            _originals.update(
                {name: PreTrainedModel.__dict__[name] for name in ("_load_pretrained_model", "_from_config")}
            )
            _originals["conversions"] = modeling_utils.get_model_conversion_mapping
            PreTrainedModel._load_pretrained_model = staticmethod(_record_instead_of_loading)
            PreTrainedModel._from_config = _lazy_from_config(_originals["_from_config"])
            modeling_utils.get_model_conversion_mapping = _deferred_conversion_mapping(_originals["conversions"])
        _patch_depth += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _patch_depth -= 1
            if _patch_depth == 0:
                for name in ("_load_pretrained_model", "_from_config"):
                    setattr(PreTrainedModel, name, _originals[name])
                modeling_utils.get_model_conversion_mapping = _originals["conversions"]
                _originals.clear()
