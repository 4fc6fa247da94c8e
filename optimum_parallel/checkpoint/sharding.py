"""Which distinct shards a checkpoint holds, who writes each, and what a new layout's shards are.

Pure functions on shard specs: the same code plans a parallel save (from the specs every rank's tensors
carry) and a reshard (from the index alone), so both produce the same kind of checkpoint. A split tensor
is described by its `ShardSpec`: packed parts along its dim (one part for a plain split; q|k|v or gate|up
for fused weights), each split in whole heads (replicated when there are fewer heads than ranks) or in rows.
An expert tensor is moreover cut along dim 0 in whole experts over the ep ranks (each ep rank's block then split
over tp as above), and each block is stored by the first replica of its expert group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from ..io.errors import CheckpointError
from ..pipeline.split import stage_layers
from ..tensor_parallel.spec import ShardLayout
from .metadata import Shard, TensorEntry

FileName = Callable[..., str]  # (pp rank, tp rank[, ep rank]) -> file name


def _shards(
    layouts: list[ShardLayout | None],
    key: str,
    pp_rank: int,
    file_name: FileName,
    ep_rank: int = 0,
    experts: tuple[int, int] | None = None,
) -> list[Shard]:
    """Distinct shards (identical layouts held by several ranks are stored once, by the lowest rank); `experts`:
    the block of experts (dim 0 range) ep rank `ep_rank` holds of an expert tensor."""
    groups: dict[object, tuple[ShardLayout | None, list[int]]] = {}
    for t, layout in enumerate(layouts):
        groups.setdefault(None if layout is None else (layout.ranges, layout.replicas), (layout, []))[1].append(t)
    shards = []
    for layout, ranks in groups.values():
        held = {"ranges": [], "replicas": 1} if layout is None else layout.to_json()
        file = file_name(pp_rank, ranks[0], ep_rank) if experts else file_name(pp_rank, ranks[0])
        shard = Shard(file, key, ranks, held["ranges"], held["replicas"])
        if experts:
            shard.ep_rank, shard.experts = ep_rank, list(experts)
        shards.append(shard)
    return shards


def _layout(spec: Mapping) -> ShardLayout | None:
    return None if spec["dim"] is None else ShardLayout.from_json(spec)


def _tp_layouts(name: str, per_rank: Mapping[int, Mapping], tp: int, where: str) -> list[ShardLayout | None]:
    if sorted(per_rank) != list(range(tp)):
        raise ValueError(f"{name} is held by tp ranks {sorted(per_rank)} of {where}, expected all {tp}")
    first = per_rank[0]
    for t, spec in per_rank.items():
        for key in ("dtype", "global_shape", "dim", "parts", "kind", "experts"):
            if spec.get(key) != first.get(key):
                raise ValueError(f"{name}: {key} is {first.get(key)} on tp rank 0 but {spec.get(key)} on tp rank {t}")
    return [_layout(per_rank[t]) for t in range(tp)]


def _expert_blocks(name: str, by_ep: Mapping[int, Mapping[int, Mapping]]) -> list[tuple[int, tuple[int, int]]]:
    """(ep rank, its experts) of an expert tensor, checked to tile dim 0 in order."""
    blocks, position = [], 0
    for e in sorted(by_ep):
        start, end = by_ep[e][0]["experts"]
        if start != position:
            raise ValueError(
                f"{name}: ep rank {e} holds experts [{start}, {end}), expected them to start at {position}"
            )
        blocks.append((e, (start, end)))
        position = end
    total = by_ep[0][0]["global_shape"][0]
    if position != total:
        raise ValueError(f"{name}: the ep ranks hold experts [0, {position}) of {total}")
    return blocks


def entries_from_specs(
    specs: Mapping[tuple[int, ...], Mapping[str, Mapping]],
    tp: int,
    file_name: FileName,
    owners: Mapping[str, TensorEntry] | None = None,
) -> dict[str, TensorEntry]:
    """Index entries from what every (pp rank, tp rank[, ep rank]) holds: {(pp, tp[, ep]): {name:
    LocalTensor.spec()}} (a `ShardLayout.to_json` dict with the tensor's dtype, kind, param, like_param and, for
    an expert tensor, the `experts` it holds). Dense tensors come from ep rank 0, expert tensors from every ep rank.

    `owners`, for optimizer state split like a parameter, gives the parameter's entry (whose split it
    shares). A tensor on several pp ranks is stored by the first.
    """
    holders: dict[str, dict[int, dict[int, dict[int, Mapping]]]] = {}  # name -> pp -> ep -> tp -> spec
    for coords, table in sorted(specs.items()):
        pp_rank, t, e = (*coords, 0)[:3]
        for name, spec in table.items():
            if e == 0 or spec.get("experts") is not None:
                holders.setdefault(name, {}).setdefault(pp_rank, {}).setdefault(e, {})[t] = spec
    entries = {}
    for name, by_pp in holders.items():
        pp_rank = min(by_pp)
        by_ep = by_pp[pp_rank]
        first = by_ep[0][0]
        experts = first.get("experts") is not None
        blocks = _expert_blocks(name, by_ep) if experts else [(0, None)]
        shards = []
        for e, block in blocks:
            layouts = _tp_layouts(name, by_ep[e], tp, f"pp rank {pp_rank}" + (f", ep rank {e}" if experts else ""))
            shards += _shards(layouts, name, pp_rank, file_name, e, block)
        owner = (owners or {}).get(first["param"]) if first["like_param"] else None
        shared = {"split": owner.split, "parts": owner.parts} if owner else {}
        entries[name] = TensorEntry.of(
            first,
            dtype=first["dtype"],
            pp_rank=pp_rank,
            shards=shards,
            kind=first["kind"],
            param=first["param"],
            like_param=first["like_param"],
            experts=experts,
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


def expert_blocks(name: str, entry: TensorEntry, ep: int) -> list[tuple[int, int]]:
    """[start, end) of the experts each of `ep` ranks holds of an expert tensor, as expert parallelism splits them."""
    count = entry.global_shape[0]
    if count % ep:
        allowed = ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)
        raise CheckpointError(f"{name}: its {count} experts cannot be split over ep={ep}; allowed: {allowed}")
    per_rank = count // ep
    return [(e * per_rank, (e + 1) * per_rank) for e in range(ep)]


def resharded_entry(
    name: str, entry: TensorEntry, tp: int, pp_rank: int, file_name: FileName, ep: int = 1
) -> TensorEntry:
    """`entry` at tensor-parallel size `tp` (and, for an expert tensor, expert-parallel size `ep`) held by pipeline
    rank `pp_rank` (crc32 set when written)."""
    layouts = [target_layout(name, entry, t, tp) for t in range(tp)]
    if not entry.experts:
        return replace(entry, pp_rank=pp_rank, shards=_shards(layouts, name, pp_rank, file_name))
    shards = []
    for e, block in enumerate(expert_blocks(name, entry, ep)):
        shards += _shards(layouts, name, pp_rank, file_name, e, block)
    return replace(entry, pp_rank=pp_rank, shards=shards)


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
