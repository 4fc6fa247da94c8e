"""Pipeline stages built by hand from a Hugging Face decoder (tracing fails on HF models). `DecoderStage` is one stage:
it runs the model's own forward over its layers, with the carrier (carrier.py) travelling beside the hidden states.
`prune_to_stages` drops the modules this rank's stages do not use; the other layers become parameter-less
placeholders, so parameter names and checkpoints do not change. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..comm.tp_entry import SequenceRegion
from ..styles.sequence_parallel import enter_sequence_region_at
from .carrier import LANGUAGE_INPUTS, MASK, ROWS, LanguageInputs, StepCarrier, decode_positions
from .decoder import DecoderRoles
from .per_layer import PER_LAYER, PerLayerInputs


class _Placeholder(nn.Identity):
    """Stands in for a decoder layer that lives on another pipeline rank."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this decoder layer lives on another pipeline stage")


class _PassThrough(nn.Module):
    """Stands in, during a stage's forward, for a decoder layer another stage runs: the hidden states go on as they
    came, in the form the base model reads a layer's output (a transformers 5 base model takes the hidden states
    themselves; a few still index `[0]` of a tuple, as Falcon-H1's, or unpack one, as Bamba's `hidden_states,
    attn_weights = decoder_layer(...)`)."""

    def __init__(self, width: int | None) -> None:
        super().__init__()
        self.width = width  # None: the hidden states alone; else a tuple of this many, the rest None

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        return hidden if self.width is None else (hidden, *([None] * (self.width - 1)))


_INDEXES_LAYER_OUTPUT = re.compile(r"layer_outputs\[0\]|decoder_layer\((?:[^()]|\([^()]*\))*\)\s*\[0\]")
_UNPACKS_LAYER_OUTPUT = re.compile(r"((?:\w+\s*,\s*)+\w+)\s*=\s*decoder_layer\(")


def _pass_through_for(base: nn.Module) -> _PassThrough:
    """The stand-in for `base`'s layers: a tuple where its forward indexes or unpacks a layer's output, the hidden
    states themselves otherwise (layers' return annotations are not to be trusted: Glm4's says tuple)."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        source = ""
    unpacked = _UNPACKS_LAYER_OUTPUT.search(source)
    if unpacked:
        return _PassThrough(unpacked.group(1).count(",") + 1)
    return _PassThrough(1 if _INDEXES_LAYER_OUTPUT.search(source) else None)


class DecoderStage(nn.Module):
    """One pipeline stage of a decoder-only HF model (or of a vision-language model's language model, its first stage
    with the vision tower and projector). Its parameters are exactly the stage's ones.

    first stage:  (input_ids, *carrier) -> (hidden_states, *carrier)
    middle:       (hidden_states, *carrier) -> (hidden_states, *carrier)
    last stage:   (hidden_states, *carrier) -> logits (a sequence classifier's: every position's scores)

    The carrier's names are the running step's (`StepCarrier`, set by the pipeline before each step)."""

    def __init__(
        self,
        model: nn.Module,
        roles: DecoderRoles,
        layers: range,
        stage_index: int,
        num_stages: int,
        inputs: Callable[[torch.Tensor], dict] | None = None,
        sequence: SequenceRegion | None = None,
        language: LanguageInputs | None = None,
        per_layer: PerLayerInputs | None = None,
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
        view = [every_layer[i] if i in layers else stand_in for i in range(len(every_layer))]
        if sequence is not None and not is_first:  # the whole sequence arrives: split it again where the view begins
            view[0] = _PassThrough(stand_in.width)  # (work between the layers before this stage's, a VLM's
            enter_sequence_region_at(view[0], sequence)  # deepstack additions, then sees split hidden states too)
        object.__setattr__(self, "_layer_view", nn.ModuleList(view))  # not registered: the parameters are `layers`
        self.embed_tokens = getattr(base, roles.embedding) if is_first else None
        self.norm = getattr(base, roles.final_norm) if is_last else None
        self.lm_head = getattr(model, roles.head) if is_last else None
        # a vision-language model's vision tower and projector, run by the entry on the first stage
        self.encoders = nn.ModuleDict({n: getattr(p, n) for p, n in roles.first_stage}) if is_first else None
        # what computes the per-layer inputs (Gemma 4's) runs on the first stage too; they travel from there
        self.per_layer_modules = nn.ModuleDict({n: getattr(base, n) for n in roles.per_layer}) if is_first else None
        self.per_layer = per_layer if roles.per_layer else None
        self.is_first, self.is_last = is_first, is_last
        # the layers' mask (and position) arguments from the padding mask that travels with the activations
        self.inputs = inputs or (lambda attention_mask: {"attention_mask": attention_mask})
        self.sequence = sequence  # under sequence parallelism: stages exchange whole sequences (stage 0's first layer
        # splits already: SequenceParallelBegin)
        self.language = language if roles.entry is not None else None
        self.carrier = StepCarrier()

    def names_in(self) -> tuple[str, ...]:
        """The names of the carrier this stage receives after its first input."""
        if self.is_first:
            return self.carrier.first_names()
        names = self.carrier.names_after(self.language, self.stage_index - 1)
        return (*names, *(self.per_layer.names_after(self.stage_index - 1) if self.per_layer is not None else ()))

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

    @contextmanager
    def _language_inputs(self, received: dict) -> Iterator[dict]:
        """Around a vision-language stage's forward: the language model's inputs the entry computed (first stage:
        recorded), or those that travelled here (later stages: given), each stage's layers taking their own share."""
        captured: dict = {}
        if self.language is None:
            yield captured
            return

        def hand_over(module, args, kwargs):
            if self.is_first:
                captured.update({name: kwargs.get(name) for name in LANGUAGE_INPUTS})
                kwargs = self.language.first_stage(self.stage_index, captured, kwargs)
            else:
                kwargs = self.language.later_stage(self.stage_index, received, kwargs)
            return args, {**kwargs, "use_cache": False}

        # first: a hook splitting the features for sequence or context parallelism must see what this one gives
        handle = self._base.register_forward_pre_hook(hand_over, with_kwargs=True, prepend=True)
        try:
            yield captured
        finally:
            handle.remove()

    @contextmanager
    def _per_layer_inputs(self, received: torch.Tensor | None, inputs: dict) -> Iterator[dict]:
        """Around a stage's forward of a model with per-layer inputs: recorded on the first stage, given on the
        later ones (`per_layer.PerLayerInputs`)."""
        if self.per_layer is None:
            yield {}
            return
        with self.per_layer.around(self._base, self.stage_index, received, inputs) as captured:
            yield captured

    def forward(self, x: torch.Tensor, *carried: torch.Tensor):
        given = dict(zip(self.names_in(), carried, strict=True))
        travelling = given.pop(MASK)
        rows = given.pop(ROWS, None)
        per_layer_received = given.pop(PER_LAYER, None)
        received = {name: given.pop(name) for name in LANGUAGE_INPUTS if name in given}
        inputs = dict(given)  # the batch's row-aligned model inputs, sent on as they came
        if self.is_first:
            inputs["input_ids"] = x
            if rows is not None:
                inputs.update(self.carrier.images.for_rows(rows))
        else:
            inputs["inputs_embeds"] = x
            positions = decode_positions(received.get("position_ids"))
            if positions is not None:  # the entry takes them as given (a Qwen entry would compute them again)
                inputs["position_ids"] = positions
        if self.language is None:
            inputs["use_cache"] = False
        masks = self.inputs(travelling)
        with (
            self._stage_view(),
            self._language_inputs(received) as captured,
            self._per_layer_inputs(per_layer_received, inputs) as per_layer,
        ):
            if self.is_last and not self._roles.classifier:  # the model's own head code (soft-capping...), no loss
                return type(self._model).forward(self._model, **masks, **inputs).logits
            hidden = self._roles.caller(**masks, **inputs).last_hidden_state
        if self.is_last:  # a sequence classifier: every position's scores, pooled by the caller (it holds the ids)
            return self.lm_head(hidden)
        if self.sequence is not None:  # the next stage derives positions from the length
            hidden = self.sequence.gather(hidden)
        out = (hidden, travelling, *given.values())
        if self.per_layer is not None:  # a text model's (a composite model's entry computes them: refused)
            return (*out, *self.per_layer.send(self.stage_index, per_layer, per_layer_received))
        if self.language is None:
            return out
        if self.is_first:
            return (*out, *self.language.send_first(self.stage_index, captured, x, hidden))
        return (*out, *self.language.send_later(self.stage_index, received))


def prune_to_stages(model: nn.Module, roles: DecoderRoles, keep: set[int], first: bool, last: bool) -> None:
    """Drop every module this rank's stages do not use (layers become placeholders; names stay)."""
    layers = getattr(roles.base, roles.layers)
    for index in range(len(layers)):
        if index not in keep:
            layers[index] = _Placeholder()
    if not first:
        setattr(roles.base, roles.embedding, None)
        for name in roles.per_layer:  # per-layer inputs are computed on the first stage
            setattr(roles.base, name, None)
        for parent, name in roles.first_stage:  # the vision tower and projector live on the first stage
            setattr(parent, name, None)
    if not last:
        setattr(roles.base, roles.final_norm, None)
        setattr(model, roles.head, None)
