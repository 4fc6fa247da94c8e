"""Pipeline stages built by hand from a Hugging Face decoder (tracing fails on HF models).

A rank keeps only its stages' modules: the other decoder layers become parameter-less placeholders, so
parameter names (and checkpoints) do not change. A stage runs the model's own forward over its layers:
positions, rotary embeddings and causal masks (the `global_spec` tensors) are recomputed on every
stage from the hidden states; the padding mask travels with the activations. Under sequence
parallelism a stage sends the whole sequence and the next one splits it again at its first layer.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from ..comm.tp_entry import SequenceRegion
from ..styles.sequence_parallel import enter_sequence_region_at
from .decoder import DecoderRoles


class _Placeholder(nn.Identity):
    """Stands in for a decoder layer that lives on another pipeline rank."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this decoder layer lives on another pipeline stage")


class _PassThrough(nn.Module):
    """Stands in, during a stage's forward, for a decoder layer another stage runs: the hidden states go on as they
    came, in the form the base model reads a layer's output (a transformers 5 base model takes the hidden states
    themselves; a few, Falcon-H1's, still index `[0]` of a tuple)."""

    def __init__(self, as_tuple: bool) -> None:
        super().__init__()
        self.as_tuple = as_tuple

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden,) if self.as_tuple else hidden


_PASS_THROUGH = {as_tuple: _PassThrough(as_tuple) for as_tuple in (False, True)}


_INDEXES_LAYER_OUTPUT = re.compile(r"layer_outputs\[0\]|decoder_layer\((?:[^()]|\([^()]*\))*\)\s*\[0\]")


def _pass_through_for(base: nn.Module) -> _PassThrough:
    """The stand-in for `base`'s layers: a tuple where its forward indexes a layer's output (`layer_outputs[0]`),
    the hidden states themselves otherwise (layers' return annotations are not to be trusted: Glm4's says tuple)."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        source = ""
    return _PASS_THROUGH[bool(_INDEXES_LAYER_OUTPUT.search(source))]


class DecoderStage(nn.Module):
    """One pipeline stage of a decoder-only HF model. Its parameters are exactly the stage's ones.

    first stage:  (input_ids, attention_mask) -> (hidden_states, attention_mask)
    middle:       (hidden_states, attention_mask) -> (hidden_states, attention_mask)
    last stage:   (hidden_states, attention_mask) -> logits
    """

    def __init__(
        self,
        model: nn.Module,
        roles: DecoderRoles,
        layers: range,
        stage_index: int,
        num_stages: int,
        inputs: Callable[[torch.Tensor], dict] | None = None,
        sequence: SequenceRegion | None = None,
    ) -> None:
        super().__init__()
        is_first, is_last = stage_index == 0, stage_index == num_stages - 1
        self.stage_index = stage_index
        object.__setattr__(self, "_model", model)  # not a submodule: a rank's stages share the model
        base = roles.base
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_roles", roles)
        every_layer = getattr(base, roles.layers)
        self.layers = nn.ModuleList(every_layer[i] for i in layers)
        # what the base model iterates: every position, the other stages' layers passing the hidden states through,
        # so a forward that reads per-layer data by position (config.layer_types[i], per-layer inputs) reads its own
        stand_in = _pass_through_for(base)
        view = nn.ModuleList(every_layer[i] if i in layers else stand_in for i in range(len(every_layer)))
        object.__setattr__(self, "_layer_view", view)  # not registered: the stage's parameters are `layers`
        self.embed_tokens = getattr(base, roles.embedding) if is_first else None
        self.norm = getattr(base, roles.final_norm) if is_last else None
        self.lm_head = getattr(model, roles.head) if is_last else None
        self.is_first, self.is_last = is_first, is_last
        # the layers' mask (and position) arguments from the padding mask that travels with the activations
        self.inputs = inputs or (lambda attention_mask: {"attention_mask": attention_mask})
        self.sequence = sequence  # under sequence parallelism: stages exchange whole sequences
        if sequence is not None and not is_first:  # stage 0's first layer splits already (SequenceParallelBegin)
            enter_sequence_region_at(self.layers[0], sequence)  # the whole sequence arrives: split it again

    @contextmanager
    def _stage_view(self):
        """The base model runs only this stage's layers, each at its own position (the others pass the hidden states
        through), and no final norm unless it is the last stage."""
        modules, roles = self._base._modules, self._roles
        saved = modules[roles.layers], modules[roles.final_norm]
        modules[roles.layers] = self._layer_view
        if not self.is_last:
            modules[roles.final_norm] = nn.Identity()
        try:
            yield
        finally:
            modules[roles.layers], modules[roles.final_norm] = saved

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor):
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        masks = self.inputs(attention_mask)
        with self._stage_view():
            if self.is_last:  # the model's own head code (soft-capping and the like), no loss
                return type(self._model).forward(self._model, use_cache=False, **masks, **inputs).logits
            hidden = self._base(use_cache=False, **masks, **inputs).last_hidden_state
        if self.sequence is not None:  # the next stage derives positions from the length
            hidden = self.sequence.gather(hidden)
        return hidden, attention_mask


def prune_to_stages(model: nn.Module, roles: DecoderRoles, keep: set[int], first: bool, last: bool) -> None:
    """Drop every module this rank's stages do not use (layers become placeholders; names stay)."""
    layers = getattr(roles.base, roles.layers)
    for index in range(len(layers)):
        if index not in keep:
            layers[index] = _Placeholder()
    if not first:
        setattr(roles.base, roles.embedding, None)
    if not last:
        setattr(roles.base, roles.final_norm, None)
        setattr(model, roles.head, None)
