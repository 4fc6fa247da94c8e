"""Which decoder layers each pipeline stage owns, from Paddle's `split_spec`."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from torch import nn


class SplitPoint(enum.Enum):
    """Where a pipeline stage boundary sits relative to the named layer (Paddle's names)."""

    BEGINNING = "beginning"
    END = "end"


def find_layer_list(model: nn.Module, prefix: str) -> nn.ModuleList:
    try:
        layers = model.get_submodule(prefix)
    except AttributeError:
        raise ValueError(
            f"pp_config['split_spec'] prefix {prefix!r} names no module of {type(model).__name__}"
        ) from None
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"pp_config['split_spec'] prefix {prefix!r} is a {type(layers).__name__}, not a list of layers"
        )
    return layers


def stage_layers(
    num_layers: int, num_stages: int, split_spec: str | Mapping[str, SplitPoint], prefix: str
) -> list[range]:
    """The layer indices of every stage: an even split (the last stages take the smaller shares, since they
    also run the head and the loss), or exactly at the points of a {"prefix.N": SplitPoint} spec."""
    if num_layers < num_stages:
        raise ValueError(
            f"{num_layers} layers cannot be split into {num_stages} pipeline stages (pp x the schedule's stages per "
            f"rank); allowed: at most {num_layers} stages"
        )
    if isinstance(split_spec, str):
        base, extra = divmod(num_layers, num_stages)
        bounds = [0]
        for stage in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
        return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    cuts = set()
    for name, point in split_spec.items():
        head, _, index = name.rpartition(".")
        if head != prefix or not index.isdigit() or not 0 <= int(index) < num_layers:
            raise ValueError(
                f"pp_config['split_spec'] key {name!r} is not one of {prefix}.0 ... {prefix}.{num_layers - 1}"
            )
        cuts.add(int(index) + 1 if point is SplitPoint.END else int(index))
    cuts.discard(0)
    cuts.discard(num_layers)
    if len(cuts) != num_stages - 1:
        raise ValueError(
            f"pp_config['split_spec'] gives {len(cuts)} distinct split points; {num_stages} stages need exactly "
            f"{num_stages - 1}"
        )
    bounds = [0, *sorted(cuts), num_layers]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
