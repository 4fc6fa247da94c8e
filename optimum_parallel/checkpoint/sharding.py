"""Which distinct shards a checkpoint holds, who writes each, and what a new layout's shards are.

Pure functions on shard specs: the same code plans a parallel save (from the specs every rank's tensors
carry) and a reshard (from the index alone), so both produce the same kind of checkpoint. A split tensor
is described by its `ShardSpec`: packed parts along its dim (one part for a plain split; q|k|v or gate|up
for fused weights), each split in whole heads (replicated when there are fewer heads than ranks) or in rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from ..io.errors import CheckpointError
from ..pipeline.split import stage_layers
from ..tensor_parallel.spec import ShardLayout
from .metadata import Shard, TensorEntry

FileName = Callable[[int, int], str]  # (pp rank, tp rank) -> file name


def _shards(layouts: list[ShardLayout | None], key: str, pp_rank: int, file_name: FileName) -> list[Shard]:
    """Distinct shards (identical layouts held by several ranks are stored once, by the lowest rank)."""
    groups: dict[object, tuple[ShardLayout | None, list[int]]] = {}
    for t, layout in enumerate(layouts):
        groups.setdefault(None if layout is None else (layout.ranges, layout.replicas), (layout, []))[1].append(t)
    shards = []
    for layout, ranks in groups.values():
        held = {"ranges": [], "replicas": 1} if layout is None else layout.to_json()
        shards.append(Shard(file_name(pp_rank, ranks[0]), key, ranks, held["ranges"], held["replicas"]))
    return shards


def _layout(spec: Mapping) -> ShardLayout | None:
    return None if spec["dim"] is None else ShardLayout.from_json(spec)


def entries_from_specs(
    specs: Mapping[tuple[int, int], Mapping[str, Mapping]],
    tp: int,
    file_name: FileName,
    owners: Mapping[str, TensorEntry] | None = None,
) -> dict[str, TensorEntry]:
    """Index entries from what every (pp rank, tp rank) holds: {(pp, tp): {name: LocalTensor.spec()}} (a
    `ShardLayout.to_json` dict with the tensor's dtype, kind, param and like_param).

    `owners`, for optimizer state split like a parameter, gives the parameter's entry (whose split it
    shares). A tensor on several pp ranks is stored by the first.
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
            for key in ("dtype", "global_shape", "dim", "parts", "kind"):
                if spec[key] != first[key]:
                    raise ValueError(f"{name}: {key} is {first[key]} on tp rank 0 but {spec[key]} on tp rank {t}")
        layouts = [_layout(per_rank[t]) for t in range(tp)]
        owner = (owners or {}).get(first["param"]) if first["like_param"] else None
        shared = {"split": owner.split, "parts": owner.parts} if owner else {}
        entries[name] = TensorEntry.of(
            first,
            dtype=first["dtype"],
            pp_rank=pp_rank,
            shards=_shards(layouts, name, pp_rank, file_name),
            kind=first["kind"],
            param=first["param"],
            like_param=first["like_param"],
            **shared,
        )
    return entries


def target_layout(name: str, entry: TensorEntry, tp_rank: int, tp: int) -> ShardLayout | None:
    """The layout tp rank `tp_rank` of `tp` holds of `entry`, as `parallelize` would split it."""
    if entry.dim is None:
        return None
    if entry.split != "parts":
        raise CheckpointError(f"{name}: saved with a {entry.split!r} layout that resharding cannot re-split")
    try:
        return entry.spec.local(tp_rank, tp)
    except ValueError as err:
        raise CheckpointError(f"{name}: cannot be split over tp={tp}: {err}") from None


def resharded_entry(name: str, entry: TensorEntry, tp: int, pp_rank: int, file_name: FileName) -> TensorEntry:
    """`entry` at tensor-parallel size `tp` held by pipeline rank `pp_rank` (crc32 set when written)."""
    layouts = [target_layout(name, entry, t, tp) for t in range(tp)]
    return replace(entry, pp_rank=pp_rank, shards=_shards(layouts, name, pp_rank, file_name))


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for before, after in zip(parts, parts[1:], strict=False):
        if before == "layers" and after.isdigit():
            return int(after)
    return None


def assign_pp_ranks(names: Iterable[str], pp: int) -> dict[str, int]:
    """Pipeline rank of each tensor, one stage per rank: the decoder layers split by `pipeline.split.stage_layers`
    (as `parallelize` splits them), what comes before the layers on the first rank,
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
    stage_of_layer = [
        stage for stage, layers in enumerate(stage_layers(num_layers, pp, "layers", "layers")) for _ in layers
    ]
    seen_layers, ranks = False, {}
    for name in names:
        if name in layer_of:
            seen_layers = True
            ranks[name] = stage_of_layer[layer_of[name]]
        else:
            ranks[name] = pp - 1 if seen_layers else 0
    return ranks
