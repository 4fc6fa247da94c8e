"""Sequence-parallel styles (Megatron-style SP; Paddle's names), for activations laid out [batch, seq, hidden]:
`SequenceParallelBegin`, `SequenceParallelEnd`, `SequenceParallelEnable`, `SequenceParallelDisable` and
`SequenceParallelSplitArgument`. Inside the region every rank holds a slice of the sequence; these styles add the
hooks, and the layers' part is decided with the plan (`plan/wiring.py`).
"""

from __future__ import annotations

import inspect

import torch

from ..comm.autograd_collectives import (
    SEQ_DIM,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from ..comm.tp_entry import SequenceRegion
from ..tensor_parallel.replicated import sum_parameter_gradients
from .base import ParallelStyle, PlanContext


def _map_first(value, fn):
    """Apply `fn` to a module's main tensor: the tensor itself or the first element of a tuple."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, tuple) and value and torch.is_tensor(value[0]):
        return (fn(value[0]), *value[1:])
    raise TypeError(f"sequence parallelism expects a tensor or a tuple starting with one, got {type(value).__name__}")


def _first_input_hook(fn):
    def hook(module, args, kwargs):
        if args:
            return (_map_first(args[0], fn), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        raise TypeError(f"{type(module).__name__}: no positional input or hidden_states keyword to (un)split")

    return hook


def _output_hook(fn):
    return lambda module, args, output: _map_first(output, fn)


def enter_sequence_region_at(module, region: SequenceRegion, on: str = "input") -> None:
    """Split the sequence at `module`'s first input (or its output): the region's entry (a pipeline stage's first
    layer is one too, its input arriving whole from the previous stage)."""
    if on == "input":
        module.register_forward_pre_hook(_first_input_hook(region.enter), with_kwargs=True)
    else:
        module.register_forward_hook(_output_hook(region.enter))


class SequenceParallelBegin(ParallelStyle):
    """Enter the region: split the module's output (or, with on="input", its first input) along the sequence."""

    def __init__(self, need_transpose: bool = True, on: str = "output") -> None:
        if on not in ("input", "output"):
            raise ValueError(f"SequenceParallelBegin(on={on!r}): allowed values are 'input' and 'output'")
        self.need_transpose, self.on = need_transpose, on

    def apply(self, module, name, ctx: PlanContext):
        enter_sequence_region_at(module, ctx.sequence, self.on)
        return module


class SequenceParallelEnd(ParallelStyle):
    """Leave the region before the module: a column-parallel layer all-gathers its input itself (its mode, decided
    with the plan; reduce-scatter backward); any other module gets the whole sequence (split backward)."""

    def __init__(self, need_transpose: bool = True) -> None:
        self.need_transpose = need_transpose

    def apply(self, module, name, ctx: PlanContext):
        if name not in ctx.wirings:  # not a parallel layer: gather before it
            module.register_forward_pre_hook(_first_input_hook(ctx.sequence.gather), with_kwargs=True)
        return module


class SequenceParallelEnable(ParallelStyle):
    """Run the module on the local sequence slice (norms, dropout); its parameters' gradients are summed over tp."""

    def apply(self, module, name, ctx: PlanContext):
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            region = ctx.sequence
            sum_parameter_gradients(module, ctx.mesh.tp_group, when=lambda: region.split)
        return module


class SequenceParallelDisable(ParallelStyle):
    """Run the module on the whole sequence: its input is all-gathered at the module boundary (HF attention
    reads the sequence length from its input). Column-parallel layers inside then skip their own entry
    (the gather's backward reduce-scatters their partial gradients) and row-parallel layers reduce-scatter
    their output (their modes, decided with the plan); a module without them is replicated work: gather in (split
    backward), split out. `replicate=True` makes any module replicated work, its column/row layers then plain
    tensor parallelism on the whole sequence (a MoE block whose shared expert sits beside the routed experts' own tp
    region: both must produce whole-sequence outputs to be added)."""

    def __init__(self, need_transpose: bool = True, replicate: bool = False) -> None:
        self.need_transpose = need_transpose
        self.replicate = replicate

    def apply(self, module, name, ctx: PlanContext):
        group, region = ctx.mesh.tp_group, ctx.sequence
        if name in ctx.gathering_blocks:

            def enter(x):  # the whole sequence enters the region; a forward that kept it whole: the plain entry
                if region.split:
                    return gather_from_sequence_parallel_region(x, group, dim=SEQ_DIM)
                return copy_to_tensor_parallel_region(x, group)

            module.register_forward_pre_hook(_first_input_hook(enter), with_kwargs=True)
        else:
            module.register_forward_pre_hook(_first_input_hook(region.gather), with_kwargs=True)
            module.register_forward_hook(_output_hook(region.scatter))
        return module


class SequenceParallelSplitArgument(ParallelStyle):
    """Split the module's `argument` (batch-first, one entry per token) along the sequence as the region splits the
    hidden states: an input computed whole beside the residual stream, before the region (Gemma 4's per-layer inputs),
    read by a layer on this rank's slice. Every tp rank computed all of it; the split's backward gathers its gradient,
    whole on every rank, as the work before it had it on one device."""

    def __init__(self, argument: str) -> None:
        self.argument = argument

    def check(self, module, name, ctx: PlanContext) -> None:
        if self.argument not in inspect.signature(type(module).forward).parameters:
            raise ValueError(
                f"SequenceParallelSplitArgument({self.argument!r}) on {name} ({type(module).__name__}): its forward "
                f"takes no such argument; allowed: {', '.join(inspect.signature(type(module).forward).parameters)}"
            )

    def apply(self, module, name, ctx: PlanContext):
        region, group = ctx.sequence, ctx.mesh.tp_group
        index = list(inspect.signature(type(module).forward).parameters).index(self.argument) - 1  # after self

        def split(x):  # the rule the region's entry applies to the hidden states of the same forward
            if not torch.is_tensor(x) or not region.splits(x.shape[SEQ_DIM]):
                return x
            return scatter_to_sequence_parallel_region(x, group, dim=SEQ_DIM)

        def hook(module, args, kwargs):
            if len(args) > index:
                return (*args[:index], split(args[index]), *args[index + 1 :]), kwargs
            if self.argument in kwargs:
                return args, {**kwargs, self.argument: split(kwargs[self.argument])}
            return None

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module
