"""Regional compilation: each decoder block's forward through torch.compile, the last step of the composition.

The unit is one block (the classes in the model's `_no_split_modules`): every block runs the same code, so dynamo
keeps one graph for all of them. Only the block's `forward` is compiled; the hooks on it and everything outside the
blocks run eagerly. Details: docs/module_notes.md, "engine/compile.py".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.compiled import merge_entries
from ..mesh import device as devices

COMPILED_MARK = "_optimum_parallel_compiled"  # in a compiled block's __dict__: its CompileConfig


@dataclass(frozen=True)
class CompileConfig:
    """How to compile the blocks: `backend` (a name torch._dynamo knows), `mode` (inductor's: "default",
    "reduce-overhead", "max-autotune", ...; None: the default), `dynamic` (torch.compile's: None decides by itself
    on the second shape seen)."""

    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None


def compile_config(value: object, key: str = "compile") -> CompileConfig | None:
    """The caller's `compile=` value as a CompileConfig: False/None (off), True (inductor), a backend name, a dict of
    CompileConfig's fields or a CompileConfig (static shapes by default for TorchNeuron's backend). The error names
    `key` and what is allowed."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileConfig()
    if isinstance(value, CompileConfig):
        return value
    if isinstance(value, str) and value:
        return CompileConfig(backend=value, dynamic=devices.compile_dynamic(value))
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"backend", "mode", "dynamic"})
        if unknown:
            raise ValueError(f"{key} has unknown keys {unknown}; allowed: backend, mode, dynamic")
        return CompileConfig(**{"dynamic": devices.compile_dynamic(value.get("backend", "inductor")), **value})
    raise ValueError(
        f"{key}={value!r} is not allowed; allowed: True, False, a backend name (e.g. 'inductor', 'neuron') or a dict "
        "with backend, mode, dynamic"
    )


def check_compile_config(config: CompileConfig, key: str = "compile") -> None:
    """The backend is one torch knows and `mode` one of inductor's (raised naming `key`)."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if config.backend not in known:
        hint = devices.missing_compiler_hint(config.backend)
        raise ValueError(f"{key}: backend {config.backend!r} is not known to torch{hint}; allowed: {', '.join(known)}")
    if config.mode is not None:
        if config.backend != "inductor":
            raise ValueError(f"{key}: mode={config.mode!r} is inductor's; the backend is {config.backend!r}")
        modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        if config.mode not in modes:
            raise ValueError(f"{key}: mode={config.mode!r} is not allowed; allowed: {', '.join(modes)}")


@functools.cache
def block_backend(name: str = "inductor", mode: str | None = None) -> Callable:
    """The backend every block is compiled with: the entries of one tensor folded into one, then `name`'s backend.
    One object per (name, mode), so the blocks share dynamo's cache entries."""

    def backend(gm, example_inputs):
        if merge_entries(gm.graph):
            gm.recompile()
        if name == "inductor" and mode is not None:
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches=list_mode_options(mode))
        return torch._dynamo.lookup_backend(name)(gm, example_inputs)

    backend.__name__ = f"optimum_parallel_{name}"
    return backend


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's decoder blocks: its modules of the classes its transformers models name in `_no_split_modules`
    (outermost first; a block inside a block is not listed)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if any(cls.__name__ in names for cls in type(module).__mro__):  # FSDP2 subclasses the block's class
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    return blocks


def compile_blocks(model: nn.Module, config: CompileConfig | None) -> list[nn.Module]:
    """Compile every decoder block's forward of `model` (once: a block compiled already is left alone); the blocks.
    A training forward of `model` then runs without a key/value cache (see `_no_cache_in_training`). None: eager,
    nothing compiled."""
    if config is None:
        return []
    backend = block_backend(config.backend, config.mode)
    blocks = decoder_blocks(model)
    for block in blocks:
        if block.__dict__.get(COMPILED_MARK):
            continue
        block.forward = torch.compile(block.forward, backend=backend, dynamic=config.dynamic)
        block.__dict__[COMPILED_MARK] = config
    if blocks and not model.__dict__.get(COMPILED_MARK) and hasattr(getattr(model, "config", None), "use_cache"):
        model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
        model.__dict__[COMPILED_MARK] = True
    return blocks


def _no_cache_in_training(model: nn.Module, args: tuple, kwargs: dict):
    """`use_cache=False` for a training forward that did not ask for a cache, as transformers does under gradient
    checkpointing: nothing reads a training step's cache, and each layer's cache entry is a guard of its own
    (`layer_idx`), which would compile one graph per layer."""
    if model.training and "use_cache" not in kwargs and kwargs.get("past_key_values") is None:
        return args, {**kwargs, "use_cache": False}
    return None
