"""Which distinct shards a checkpoint holds, who writes each, and what a new layout's shards are.

Pure functions on layouts: the same code plans a parallel save (from what every rank holds) and a
reshard (from the index alone), so both produce the same kind of checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from ..tensor_parallel.layout import ShardLayout, split_units
from .errors import CheckpointError
from .metadata import Shard, TensorEntry

FileName = Callable[[int, int], str]  # (pp stage, tp rank) -> file name


def _layout(spec: Mapping) -> ShardLayout | None:
    if spec["dim"] is None:
        return None
    ranges = tuple((int(s), int(e)) for s, e in spec["ranges"])
    return ShardLayout(tuple(spec["global_shape"]), spec["dim"], ranges, spec["replicas"])


def classify_split(name: str, layouts: list[ShardLayout | None], units: int | None) -> tuple[str, int | None]:
    """('replicated' | 'units' | 'rows' | 'custom', units) for the layouts of tp ranks 0..tp-1."""
    first = layouts[0]
    if first is None:
        return "replicated", None
    tp = len(layouts)
    if units is None and first.replicas > 1:  # a replicated head: each replica group holds exactly one unit
        units = first.global_shape[first.dim] // sum(e - s for s, e in first.ranges)
    candidates = [("units", units)] if units is not None else []
    candidates.append(("rows", None))
    for split, n in candidates:
        try:
            if all(split_units(first.global_shape, first.dim, t, tp, n) == layouts[t] for t in range(tp)):
                return split, n
        except ValueError:
            continue
    return "custom", None


def _shards(layouts: list[ShardLayout | None], key: str, stage: int, file_name: FileName) -> list[Shard]:
    """Distinct shards (identical layouts held by several ranks are stored once, by the lowest rank)."""
    groups: dict[object, list[int]] = {}
    for t, layout in enumerate(layouts):
        groups.setdefault(None if layout is None else layout.ranges, []).append(t)
    shards = []
    for ranges, ranks in groups.items():
        shard_ranges = [] if ranges is None else [list(r) for r in ranges]
        shards.append(Shard(file=file_name(stage, ranks[0]), key=key, tp_ranks=ranks, ranges=shard_ranges))
    return shards


def entries_from_specs(
    specs: Mapping[tuple[int, int], Mapping[str, Mapping]],
    tp: int,
    file_name: FileName,
    units: Mapping[str, int] | None = None,
    splits: Mapping[str, TensorEntry] | None = None,
) -> dict[str, TensorEntry]:
    """Index entries from what every (pp stage, tp rank) holds: {(pp, tp): {name: LocalTensor.spec()}}.

    `splits` gives, for optimizer state split like a parameter, the parameter's entry (its split and units).
    """
    holders: dict[str, dict[int, dict[int, Mapping]]] = {}
    for (stage, t), table in sorted(specs.items()):
        for name, spec in table.items():
            holders.setdefault(name, {}).setdefault(stage, {})[t] = spec
    entries = {}
    for name, stages in holders.items():
        stage = min(stages)
        per_rank = stages[stage]
        if sorted(per_rank) != list(range(tp)):
            raise ValueError(f"{name} is held by tp ranks {sorted(per_rank)} of stage {stage}, expected all {tp}")
        first = per_rank[0]
        for t, spec in per_rank.items():
            for key in ("dtype", "global_shape", "dim", "kind"):
                if spec[key] != first[key]:
                    raise ValueError(f"{name}: {key} is {first[key]} on tp rank 0 but {spec[key]} on tp rank {t}")
        layouts = [_layout(per_rank[t]) for t in range(tp)]
        if first["like_param"] and splits is not None and first["param"] in splits:
            owner = splits[first["param"]]
            split, n = owner.split, owner.units
        else:
            split, n = classify_split(name, layouts, (units or {}).get(name))
        entries[name] = TensorEntry(
            dtype=first["dtype"],
            global_shape=list(first["global_shape"]),
            dim=first["dim"],
            pp_stage=stage,
            shards=_shards(layouts, name, stage, file_name),
            kind=first["kind"],
            split=split,
            units=n,
            param=first["param"],
            like_param=first["like_param"],
        )
    return entries


def target_layout(name: str, entry: TensorEntry, tp_rank: int, tp: int) -> ShardLayout | None:
    """The layout tp rank `tp_rank` of `tp` holds of `entry`, as `parallelize` would split it."""
    if entry.dim is None:
        return None
    if entry.split not in ("units", "rows"):
        raise CheckpointError(
            f"{name}: its {entry.split!r} split (e.g. a fused layout) cannot be re-split; reshard supports row and "
            "head splits"
        )
    try:
        return split_units(tuple(entry.global_shape), entry.dim, tp_rank, tp, entry.units)
    except ValueError as err:
        raise CheckpointError(f"{name}: cannot be split over tp={tp}: {err}") from None


def resharded_entry(name: str, entry: TensorEntry, tp: int, stage: int, file_name: FileName) -> TensorEntry:
    """`entry` at tensor-parallel size `tp` on pipeline stage `stage` (no crc32 yet: set when written)."""
    layouts = [target_layout(name, entry, t, tp) for t in range(tp)]
    return TensorEntry(
        dtype=entry.dtype,
        global_shape=list(entry.global_shape),
        dim=entry.dim,
        pp_stage=stage,
        shards=_shards(layouts, name, stage, file_name),
        kind=entry.kind,
        split=entry.split,
        units=entry.units,
        param=entry.param,
        like_param=entry.like_param,
    )


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def assign_stages(names: Iterable[str], pp: int) -> dict[str, int]:
    """Pipeline stage of each parameter: decoder layers in `pp` even contiguous blocks, what comes before
    the layers on the first stage, what comes after (final norm, LM head) on the last."""
    names = list(names)
    if pp == 1:
        return dict.fromkeys(names, 0)
    layer_of = {n: int(m.group(1)) for n in names if (m := _LAYER.search(n))}
    if not layer_of:
        raise CheckpointError(f"cannot split into {pp} pipeline stages: no '.layers.N.' parameters found")
    num_layers = max(layer_of.values()) + 1
    if num_layers < pp:
        raise CheckpointError(f"cannot split {num_layers} layers into {pp} pipeline stages")
    seen_layers, stages = False, {}
    for name in names:
        if name in layer_of:
            seen_layers = True
            stages[name] = layer_of[name] * pp // num_layers
        else:
            stages[name] = pp - 1 if seen_layers else 0
    return stages
