"""The pipeline schedules by name and every check of a pipeline request: light to import (torch's
`torch.distributed.pipelining`, which pulls in `torch._dynamo`, loads only when a pipeline is built)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from torch import nn

from .decoder import DecoderRoles, decoder_roles
from .split import SplitPoint, find_layer_list, stage_layers

# name -> (stages per rank, placement: "loop" = r, r+pp, ...; "v" = r, 2pp-1-r)
SCHEDULES = {
    "gpipe": (1, "loop"),
    "1f1b": (1, "loop"),
    "interleaved_1f1b": (2, "loop"),
    "interleaved_zb": (2, "loop"),
    "zbv": (2, "v"),
}
_CLASSES = {  # torch.distributed.pipelining's class for each name
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}

# schedules that run the input and the weight gradients as separate passes (zero bubble)
SPLIT_BACKWARD = {"interleaved_zb", "zbv"}


def schedule_class(name: str) -> type:
    """torch's schedule class for `name` (imported now, not when the package is)."""
    return getattr(importlib.import_module("torch.distributed.pipelining"), _CLASSES[name])


def stage_indices(rank: int, pp: int, per_rank: int, placement: str) -> list[int]:
    """The stages pp position `rank` holds."""
    if placement == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


def stage_owner(index: int, pp: int, placement: str) -> int:
    """The pp position holding stage `index`."""
    if placement == "v":
        return index if index < pp else 2 * pp - 1 - index
    return index % pp


def check_schedule(schedule: object, key: str = "pipeline_parallel_schedule") -> None:
    """`schedule` names one of `SCHEDULES`; the error names `key` (the caller's name for it) and the allowed ones."""
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"{key}={schedule!r} is not allowed; allowed: {', '.join(SCHEDULES)}")


def decoder_parts(
    model: nn.Module, split_spec: str | Mapping[str, SplitPoint]
) -> tuple[str, nn.ModuleList, DecoderRoles]:
    """(the layer list's prefix, the layer list, the roles of the base model's parts: embedding, final norm, head)."""
    prefix = split_spec if isinstance(split_spec, str) else next(iter(split_spec), "").rpartition(".")[0]
    layers = find_layer_list(model, prefix)
    base_name, _, layers_name = prefix.rpartition(".")
    roles = decoder_roles(model, model.get_submodule(base_name), layers_name)
    missing = roles.missing()
    if missing:
        raise NotImplementedError(
            f"pipeline parallelism needs a decoder with a token embedding, a layer list, a final norm and an LM head; "
            f"{type(model).__name__} has no {' and no '.join(missing)} found (allowed: causal LMs whose base model "
            "holds the input embeddings, the layers and one final norm, and whose output embeddings are the head)"
        )
    if roles.unplaced or roles.outside:
        where = ", ".join([*(f"{base_name}.{name}" if base_name else name for name in roles.unplaced), *roles.outside])
        raise NotImplementedError(
            f"pipeline parallelism (pp > 1) is not supported for {type(model).__name__}: {where} holds parameters "
            "outside the decoder layers, the token embedding and the final norm, which no stage can place (allowed "
            "for this model: pp=1)"
        )
    return prefix, layers, roles


def check_pipeline(
    model: nn.Module,
    pp: int,
    split_spec: str | Mapping[str, SplitPoint],
    num_microbatches: int,
    schedule: str,
    *,
    schedule_key: str = "pipeline_parallel_schedule",
    microbatches_key: str = "pipeline_parallel_num_microbatches",
) -> list[range]:
    """Everything `apply_pipeline` needs of its request, checked before anything changes; returns the stages'
    layer ranges. The errors name the caller's keys (`schedule_key`, `microbatches_key`) and the allowed values."""
    check_schedule(schedule, schedule_key)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < pp:
        raise ValueError(f"{microbatches_key}={num_microbatches!r} is not allowed; it must be an int >= pp={pp}")
    prefix, layers, roles = decoder_parts(model, split_spec)
    per_rank, placement = SCHEDULES[schedule]
    ranges = stage_layers(len(layers), pp * per_rank, split_spec, prefix)
    head = getattr(getattr(model, roles.head), "weight", None)
    if placement == "v" and head is not None and head is getattr(getattr(roles.base, roles.embedding), "weight", None):
        # measured: the split weight-gradient pass miscounts the shared weight
        raise NotImplementedError(
            f"{schedule_key}={schedule!r} puts the first and last stage on one rank, which tied embeddings do not "
            "support yet; untie them (tie_word_embeddings=False) or use another schedule; allowed with tied "
            f"embeddings: {', '.join(name for name, (_, where) in SCHEDULES.items() if where != 'v')}"
        )
    return ranges
