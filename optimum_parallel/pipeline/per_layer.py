"""Per-layer inputs (Gemma 4's and 3n's): the base model computes, before its layers, one input per token and layer
(`get_per_layer_inputs` from the token ids, `project_per_layer_inputs` from the input embeddings, batch-first
[batch, seq, layers, width]) and hands layer i its slice `per_layer_inputs[:, :, i, :]` as `per_layer_input`.

Under pipeline parallelism the first stage computes them (it holds the modules that do) and they travel with the
hidden states while a later stage holds a layer that reads them (`PerLayerInputs`); the gradient of every stage's
layers flows back through them to the first stage's embedding and projection. A later stage hands its base model the
inputs it received (its own layers' and those after; zeros for the layers before it, which other stages ran), the
base's own projection skipped: they are projected already.
"""

from __future__ import annotations

import inspect
import re
from contextlib import contextmanager

import torch
from torch import nn

PER_LAYER = "per_layer_inputs"
LAYER_ARGUMENT = "per_layer_input"  # a decoder layer's name for its slice
_METHODS = ("get_per_layer_inputs", "project_per_layer_inputs")


def per_layer_modules(base: nn.Module, layers: nn.Module) -> tuple[str, ...]:
    """The names of `base`'s parameter-holding children its per-layer input methods read (empty: it computes none,
    or its layers take none, or a method's source cannot be read)."""
    if PER_LAYER not in inspect.signature(type(base).forward).parameters or not getattr(
        getattr(base, "config", None), "hidden_size_per_layer_input", 0
    ):
        return ()
    if not isinstance(layers, nn.ModuleList) or not all(takes_per_layer_input(layer) for layer in layers):
        return ()
    read: set[str] = set()
    for method in _METHODS:
        function = getattr(type(base), method, None)
        try:
            read.update(re.findall(r"self\.(\w+)", inspect.getsource(function)))
        except (OSError, TypeError):
            return ()
    return tuple(n for n, c in base.named_children() if n in read and next(c.parameters(), None) is not None)


def takes_per_layer_input(layer: nn.Module) -> bool:
    return LAYER_ARGUMENT in inspect.signature(type(layer).forward).parameters


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose gradient is made contiguous: a received tensor's gradient is sent back as it is, and the sender
    receives it into a buffer of the standard strides (gloo refuses anything else); a slice of a concatenation's
    gradient is not."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class PerLayerInputs:
    """How each stage of a pipeline over `stage_layers` (every stage's layer range, in order) gets its per-layer
    inputs; `captured` holds the first stage's, computed by its base model during the running forward."""

    def __init__(self, stage_layers: list[range]) -> None:
        self.stage_layers = stage_layers
        self.layers = stage_layers[-1].stop

    def names_after(self, stage_index: int) -> tuple[str, ...]:
        """What stage `stage_index` sends after the hidden states: the inputs of the layers after its own."""
        return (PER_LAYER,) if self.stage_layers[stage_index].stop < self.layers else ()

    @contextmanager
    def around(self, base: nn.Module, stage_index: int, received: torch.Tensor | None, inputs: dict):
        """Around a stage's forward: the first stage records what its base computes; a later one gives its base the
        received inputs (in `inputs`, padded to every layer) and skips the base's projection of them."""
        captured: dict = {}
        if received is None:
            project = base.project_per_layer_inputs

            def recording(*args, **kwargs):
                captured[PER_LAYER] = project(*args, **kwargs)
                return captured[PER_LAYER]

            replacement = recording
        else:
            start = self.stage_layers[stage_index].start
            before = received.new_zeros(*received.shape[:2], start, received.shape[-1])
            inputs[PER_LAYER] = torch.cat([before, _ContiguousGradient.apply(received)], dim=2)

            def replacement(_inputs_embeds, per_layer_inputs=None):  # projected on the first stage already
                return per_layer_inputs

        base.project_per_layer_inputs = replacement  # an instance attribute over the method, for this forward only
        try:
            yield captured
        finally:
            del base.project_per_layer_inputs

    def send(self, stage_index: int, captured: dict, received: torch.Tensor | None) -> tuple:
        """The inputs of the layers after stage `stage_index`'s: a copy in the standard strides (not a view: sent, then
        detached; its gradient's receive buffer takes its strides, which gloo wants contiguous)."""
        if not self.names_after(stage_index):
            return ()
        if received is None:
            after = captured[PER_LAYER][:, :, self.stage_layers[stage_index].stop :]
        else:
            after = received[:, :, len(self.stage_layers[stage_index]) :]
        return (after.clone(memory_format=torch.contiguous_format),)
