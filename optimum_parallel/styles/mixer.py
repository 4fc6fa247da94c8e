"""Small styles around head-split token mixers (Mamba, gated delta nets, short convolutions): the sizes a mixer's
forward reads from its own attributes, buffers packed like a split projection, and a whole output read by split work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import nn

from ..comm.autograd_collectives import copy_to_tensor_parallel_region
from ..tensor_parallel.replicated import sum_parameter_gradients
from ..tensor_parallel.spec import ShardSpec
from .base import ROW, ParallelStyle
from .linear import ColWiseParallel

Count = tuple[int, int]  # (heads or groups, size of one): a global size as held in whole units


def local_units(units: int, tp: int) -> int:
    """Units one rank holds: its share, or one replicated unit when there are fewer units than ranks."""
    return units // tp if units >= tp else 1


class LocalAttributes(ParallelStyle):
    """Set the module's integer attributes (dotted for a child's) to this rank's sizes after its children are split.

    attrs: {attribute: [(units, size of one unit), ...]}: the global value is sum(units * size) and the local one
    sum(local_units(units, tp) * size) (a count is (units, 1)). A mixer whose forward splits or reshapes with
    `self.intermediate_size`, `self.num_heads`, `self.conv_dim` then works on its local heads unchanged.
    """

    def __init__(self, attrs: Mapping[str, Sequence[Count]]) -> None:
        self.attrs = {name: tuple(tuple(c) for c in counts) for name, counts in attrs.items()}

    @staticmethod
    def _owner(module: nn.Module, dotted: str) -> tuple[object, str]:
        path, _, leaf = dotted.rpartition(".")
        return (module.get_submodule(path) if path else module), leaf

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        for attr, counts in self.attrs.items():
            owner, leaf = self._owner(module, attr)
            value = getattr(owner, leaf, None)
            expected = sum(units * size for units, size in counts)
            if value != expected:
                raise ValueError(f"{name}.{attr} is {value!r}, not the {expected} its split parts {counts} make")

    def apply(self, module, name, ctx):
        tp = ctx.mesh.tp_size
        for attr, counts in self.attrs.items():
            owner, leaf = self._owner(module, attr)
            setattr(owner, leaf, sum(local_units(units, tp) * size for units, size in counts))
        return module


class SplitBuffer(ParallelStyle):
    """Cut the module's buffer `buffer` along `dim` in packed parts (sizes, units per part), like the projection
    whose output it scales (Falcon-H1's `mup_vector` over its Mamba in_proj output)."""

    def __init__(self, buffer: str, dim: int, parts: Sequence[int], units: Sequence[int | None]) -> None:
        self.buffer, self.dim, self.parts, self.units = buffer, dim, tuple(parts), tuple(units)

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        value = module._buffers.get(self.buffer)
        if value is None or value.shape[self.dim] != sum(self.parts):
            raise ValueError(f"{name}.{self.buffer}: no buffer with {sum(self.parts)} entries on dim {self.dim}")

    def apply(self, module, name, ctx):
        rank, world = ctx.tp_rank_world
        value = module._buffers[self.buffer]
        dim = self.dim % value.dim()
        spec = ShardSpec.packed(value.shape, dim, self.parts, self.units)
        module._buffers[self.buffer] = spec.local(rank, world).slice(value).clone()
        return module


class AllReduceOutputGradient(ParallelStyle):
    """The module's (whole, all-reduced) output feeds work split over tp: its gradient is a partial sum on each rank,
    summed over tp on the way back (identity forward). For Mamba's x_proj after a row-parallel split: dt, B and C are
    whole on every rank but each rank's channels use them. A row layer styled so keeps its output whole inside a
    sequence-parallel block (all-reduced, not reduce-scattered: `plan/wiring.py`).

    A replicated module reading the input of a sequence-parallel block that gathers the sequence (latent attention's
    kv down-projection, Kimi's low-rank gates) sums its parameters' gradients over tp instead, in a forward that
    splits the sequence: the block's reduce-scatter already sums the input gradients of every path into it, so an
    input gradient summed here would be counted tp times."""

    keeps_output_whole = True

    def apply(self, module, name, ctx):
        group, sequence = ctx.mesh.tp_group, ctx.sequence
        gathered = (
            sequence is not None
            and ctx.kinds.get(name) != ROW
            and any(name.startswith(block + ".") for block in ctx.gathering_blocks)
        )
        if gathered:
            sum_parameter_gradients(module, group, when=lambda: sequence.split)

        def enter(value):
            if gathered and sequence.split:  # its parameters' gradients are summed instead (above)
                return value
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return copy_to_tensor_parallel_region(value, group)
            return value

        def hook(_module, _args, output):
            if isinstance(output, tuple):  # (states, mask) and the like: the tensors that carry gradients
                return tuple(enter(value) for value in output)
            return enter(output)

        module.register_forward_hook(hook)
        return module


class EnteredColWiseParallel(ColWiseParallel):
    """A column split whose input has already entered the tp region (no entry of its own: its input gradient stays
    this rank's partial sum). For latent attention's `kv_b_proj`: the whole latent it reads is made by a replicated
    projection that also feeds the shared rotary key, so the gradient is summed once, at that projection's output
    (`AllReduceOutputGradient`), for both paths."""

    def apply(self, module, name, ctx):
        ctx.wirings[name] = replace(ctx.wiring(name), entry=None)
        return super().apply(module, name, ctx)


class ConfigView:
    """The module's shared config with a few attributes replaced for this rank (everything else read from and written
    to the real config), for a forward that reshapes with `self.config.<count>`."""

    def __init__(self, config, **overrides) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str):
        if name in ("_config", "_overrides") or name.startswith("__"):
            raise AttributeError(name)
        overrides = object.__getattribute__(self, "_overrides")
        return overrides[name] if name in overrides else getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._overrides:
            self._overrides[name] = value
        else:
            setattr(self._config, name, value)


class LocalConfigAttributes(ParallelStyle):
    """Give the module a view of its `config` whose integer attributes `attrs` (as in `LocalAttributes`) are this
    rank's sizes; the shared config keeps the global ones."""

    def __init__(self, attrs: Mapping[str, Sequence[Count]]) -> None:
        self.attrs = {name: tuple(tuple(c) for c in counts) for name, counts in attrs.items()}

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        config = getattr(module, "config", None)
        for attr, counts in self.attrs.items():
            expected = sum(units * size for units, size in counts)
            if getattr(config, attr, None) != expected:
                raise ValueError(f"{name}.config.{attr} is not the {expected} its split parts {counts} make")

    def apply(self, module, name, ctx):
        tp = ctx.mesh.tp_size
        local = {a: sum(local_units(u, tp) * size for u, size in counts) for a, counts in self.attrs.items()}
        module.config = ConfigView(module.config, **local)
        return module
