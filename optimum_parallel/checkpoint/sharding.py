"""Which distinct shards a checkpoint holds, who writes each, and what a new layout's shards are.

Pure functions on layouts: the same code plans a parallel save (from what every rank holds) and a
reshard (from the index alone), so both produce the same kind of checkpoint. A split tensor is
described as packed parts along its dim (one part for a plain split; q|k|v or gate|up for fused
weights), each split in whole heads (replicated when there are fewer heads than ranks) or in rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from ..tensor_parallel.layout import ShardLayout, split_units
from .errors import CheckpointError
from .metadata import Shard, TensorEntry

FileName = Callable[[int, int], str]  # (pp rank, tp rank) -> file name


def parts_layout(
    global_shape: Sequence[int], dim: int, parts: Sequence[Sequence], rank: int, world: int
) -> ShardLayout:
    """The layout of `rank` when `dim` packs `parts` [[size, heads or None], ...], each split on its own
    (mirrors tensor_parallel.fused.packed_layout; one part is exactly `split_units`)."""
    ranges, replicas, offset = [], set(), 0
    for size, units in parts:
        part = split_units((size,), 0, rank, world, units)
        ((start, end),) = part.ranges
        ranges.append((offset + start, offset + end))
        replicas.add(part.replicas)
        offset += size
    return ShardLayout(tuple(global_shape), dim, tuple(ranges), replicas.pop() if len(replicas) == 1 else 1)


def _part_units(size: int, relative: list[tuple[int, int]], planned: int | None, tp: int) -> tuple[bool, int | None]:
    """(found, heads) reproducing the per-rank `relative` ranges of one part of `size` rows."""
    candidates = [planned] if planned is not None else []
    lengths = {end - start for start, end in relative}
    if len(lengths) == 1 and len(set(relative)) < tp:  # replicated heads: every replica group holds one unit
        length = lengths.pop()
        if length and size % length == 0:
            candidates.append(size // length)
    candidates.append(None)
    for units in candidates:
        try:
            if all(split_units((size,), 0, t, tp, units).ranges == (relative[t],) for t in range(tp)):
                return True, units
        except ValueError:
            continue
    return False, None


def classify_split(layouts: list[ShardLayout | None], planned: int | Sequence | None) -> tuple[str, list]:
    """('replicated' | 'parts' | 'custom', parts) describing the layouts of tp ranks 0..tp-1."""
    first, tp = layouts[0], len(layouts)
    if first is None:
        return "replicated", []
    count = len(first.ranges)
    if any(layout is None or layout.dim != first.dim or len(layout.ranges) != count for layout in layouts):
        return "custom", []
    lows = [min(layout.ranges[i][0] for layout in layouts) for i in range(count)]
    highs = [max(layout.ranges[i][1] for layout in layouts) for i in range(count)]
    if lows[0] != 0 or highs[-1] != first.global_shape[first.dim] or lows[1:] != highs[:-1]:
        return "custom", []
    plan = list(planned) if isinstance(planned, Sequence) else [planned] * count
    if len(plan) != count:
        plan = [None] * count
    parts = []
    for i in range(count):
        relative = [(layout.ranges[i][0] - lows[i], layout.ranges[i][1] - lows[i]) for layout in layouts]
        found, units = _part_units(highs[i] - lows[i], relative, plan[i], tp)
        if not found:
            return "custom", []
        parts.append([highs[i] - lows[i], units])
    if any(parts_layout(first.global_shape, first.dim, parts, t, tp) != layouts[t] for t in range(tp)):
        return "custom", []
    return "parts", parts


def _shards(layouts: list[ShardLayout | None], key: str, pp_rank: int, file_name: FileName) -> list[Shard]:
    """Distinct shards (identical layouts held by several ranks are stored once, by the lowest rank)."""
    groups: dict[object, list[int]] = {}
    for t, layout in enumerate(layouts):
        groups.setdefault(None if layout is None else (layout.ranges, layout.replicas), []).append(t)
    shards = []
    for held, ranks in groups.items():
        ranges, replicas = ([], 1) if held is None else ([list(r) for r in held[0]], held[1])
        shards.append(Shard(file_name(pp_rank, ranks[0]), key, ranks, ranges, replicas))
    return shards


def _layout(spec: Mapping) -> ShardLayout | None:
    if spec["dim"] is None:
        return None
    ranges = tuple((int(s), int(e)) for s, e in spec["ranges"])
    return ShardLayout(tuple(spec["global_shape"]), spec["dim"], ranges, spec["replicas"])


def entries_from_specs(
    specs: Mapping[tuple[int, int], Mapping[str, Mapping]],
    tp: int,
    file_name: FileName,
    units: Mapping[str, int | Sequence] | None = None,
    owners: Mapping[str, TensorEntry] | None = None,
) -> dict[str, TensorEntry]:
    """Index entries from what every (pp rank, tp rank) holds: {(pp, tp): {name: LocalTensor.spec()}}.

    `units` gives planned head counts; `owners`, for optimizer state split like a parameter, the
    parameter's entry (whose split it shares). A tensor on several pp ranks is stored by the first.
    """
    holders: dict[str, dict[int, dict[int, Mapping]]] = {}
    for (pp_rank, t), table in sorted(specs.items()):
        for name, spec in table.items():
            holders.setdefault(name, {}).setdefault(pp_rank, {})[t] = spec
    entries = {}
    for name, by_pp in holders.items():
        pp_rank = min(by_pp)
        per_rank = by_pp[pp_rank]
        if sorted(per_rank) != list(range(tp)):
            raise ValueError(f"{name} is held by tp ranks {sorted(per_rank)} of pp rank {pp_rank}, expected all {tp}")
        first = per_rank[0]
        for t, spec in per_rank.items():
            for key in ("dtype", "global_shape", "dim", "kind"):
                if spec[key] != first[key]:
                    raise ValueError(f"{name}: {key} is {first[key]} on tp rank 0 but {spec[key]} on tp rank {t}")
        layouts = [_layout(per_rank[t]) for t in range(tp)]
        owner = (owners or {}).get(first["param"]) if first["like_param"] else None
        split, parts = (owner.split, owner.parts) if owner else classify_split(layouts, (units or {}).get(name))
        entries[name] = TensorEntry(
            dtype=first["dtype"],
            global_shape=list(first["global_shape"]),
            dim=first["dim"],
            pp_rank=pp_rank,
            shards=_shards(layouts, name, pp_rank, file_name),
            kind=first["kind"],
            split=split,
            parts=parts,
            param=first["param"],
            like_param=first["like_param"],
        )
    return entries


def target_layout(name: str, entry: TensorEntry, tp_rank: int, tp: int) -> ShardLayout | None:
    """The layout tp rank `tp_rank` of `tp` holds of `entry`, as `parallelize` would split it."""
    if entry.dim is None:
        return None
    if entry.split != "parts":
        raise CheckpointError(f"{name}: saved with a {entry.split!r} layout that resharding cannot re-split")
    try:
        return parts_layout(entry.global_shape, entry.dim, entry.parts, tp_rank, tp)
    except ValueError as err:
        raise CheckpointError(f"{name}: cannot be split over tp={tp}: {err}") from None


def resharded_entry(name: str, entry: TensorEntry, tp: int, pp_rank: int, file_name: FileName) -> TensorEntry:
    """`entry` at tensor-parallel size `tp` held by pipeline rank `pp_rank` (crc32 set when written)."""
    layouts = [target_layout(name, entry, t, tp) for t in range(tp)]
    return TensorEntry(
        dtype=entry.dtype,
        global_shape=list(entry.global_shape),
        dim=entry.dim,
        pp_rank=pp_rank,
        shards=_shards(layouts, name, pp_rank, file_name),
        kind=entry.kind,
        split=entry.split,
        parts=entry.parts,
        param=entry.param,
        like_param=entry.like_param,
    )


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for before, after in zip(parts, parts[1:], strict=False):
        if before == "layers" and after.isdigit():
            return int(after)
    return None


def assign_pp_ranks(names: Iterable[str], pp: int) -> dict[str, int]:
    """Pipeline rank of each tensor, one stage per rank: the decoder layers split as `pipeline.split.stage_layers`
    splits them (even blocks, the first stages one larger), what comes before the layers on the first rank,
    what comes after (final norm, LM head) on the last."""
    names = list(names)
    if pp == 1:
        return dict.fromkeys(names, 0)
    layer_of = {n: i for n in names if (i := _layer_index(n)) is not None}
    if not layer_of:
        raise CheckpointError(f"cannot split into {pp} pipeline stages: no 'layers.N' parameters found")
    num_layers = max(layer_of.values()) + 1
    if num_layers < pp:
        raise CheckpointError(f"cannot split {num_layers} layers into {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    stage_of_layer = []
    for stage in range(pp):
        stage_of_layer += [stage] * (base + (1 if stage < extra else 0))
    seen_layers, ranks = False, {}
    for name in names:
        if name in layer_of:
            seen_layers = True
            ranks[name] = stage_of_layer[layer_of[name]]
        else:
            ranks[name] = pp - 1 if seen_layers else 0
    return ranks
