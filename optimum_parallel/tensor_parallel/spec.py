"""Shard specs: how a global tensor is cut over tensor-parallel ranks, complete enough that any tp's ranges follow.

A `ShardSpec` is what a style decides for a parameter (global shape, split dim, the packed parts along it with
their sizes and head counts). `spec.local(rank, tp)` gives the `ShardLayout` a rank holds (its ranges and how many
ranks hold the same shard). Parameters carry their layout as `param.shard_layout`, and the layout carries its
spec, so checkpoints, consolidation and resharding never look at a plan and never guess a head count.

`to_json` / `from_json` are the one serialized form of both (the checkpoint index's fields: `global_shape`, `dim`,
`parts`; a layout adds `ranges` and `replicas`). `shard_sizes` / `shard_range` live here, not in comm: the region
ops take uneven sizes from their callers and split evenly with `torch.tensor_split`, so only specs and layers use them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..mesh import device as devices

Part = tuple[int, int | None]  # (size along the split dim, heads it is cut in; None: rows, uneven split allowed)


def shard_sizes(total: int, world: int) -> list[int]:
    """Sizes of `total` split over `world` ranks, the first `total % world` ranks one larger (torch.tensor_split)."""
    base, extra = divmod(total, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def shard_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's shard of `total` (see `shard_sizes`)."""
    sizes = shard_sizes(total, world)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def check_heads(heads: int | None, tp: int, what: str = "heads", allow_replication: bool = True) -> None:
    """Raise ValueError unless `heads` can be cut over `tp` ranks: tp divides them or, where replication is
    allowed (kv heads), is a multiple of them (each head then lives on tp / heads ranks)."""
    if heads is None or (heads >= tp and heads % tp == 0) or (allow_replication and heads < tp and tp % heads == 0):
        return
    allowed = f"tp must divide {heads}" + (" or be a multiple of it" if allow_replication else "")
    raise ValueError(f"{heads} {what} cannot be split over tensor-parallel size {tp}; {allowed}")


def check_attention_heads(tp: int, heads: tuple[str, int], kv_heads: tuple[str, int] | None = None) -> None:
    """A model-level check before any weight moves: tp must divide the query heads (config name, count), and divide
    the key/value heads or be a multiple of them (each kv head then lives on tp / kv_heads ranks)."""
    name, count = heads
    if count % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide {name}={count}")
    if kv_heads is not None:
        kv_name, kv_count = kv_heads
        if kv_count % tp and tp % kv_count:
            raise ValueError(f"tensor_parallel_size={tp} must divide {kv_name}={kv_count} or be a multiple of it")


def _cut(size: int, heads: int | None, rank: int, tp: int) -> tuple[tuple[int, int], int]:
    """((start, end), replicas) of `rank`'s piece of one part of `size` rows cut in whole `heads`."""
    if heads is None:
        return shard_range(size, rank, tp), 1
    if size % heads:
        raise ValueError(f"a part of size {size} is not a whole number of {heads} heads")
    check_heads(heads, tp)
    unit = size // heads
    if heads >= tp:
        per_rank = heads // tp * unit
        return (rank * per_rank, (rank + 1) * per_rank), 1
    replicas = tp // heads
    start = rank // replicas * unit
    return (start, start + unit), replicas


@dataclass(frozen=True)
class ReplicatedSegment:
    """Local rows [start, start + length) along the split dim are one head replicated over `heads` groups."""

    start: int
    length: int
    heads: int


@dataclass(frozen=True)
class ShardSpec:
    """`global_shape` cut along `dim` (None: replicated) as the packed `parts`, each split over tp on its own.

    One part is a plain split; several are a fused weight (q|k|v, gate|up) whose local shard is again a valid
    smaller fused weight ([q_local | k_local | v_local]).
    """

    global_shape: tuple[int, ...]
    dim: int | None = None
    parts: tuple[Part, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(n) for n in self.global_shape))
        if self.dim is None:
            object.__setattr__(self, "parts", ())
            return
        parts = tuple((int(s), None if h is None else int(h)) for s, h in self.parts)
        if not parts:
            parts = ((self.global_shape[self.dim], None),)
        if sum(size for size, _ in parts) != self.global_shape[self.dim]:
            raise ValueError(
                f"packed part sizes {[s for s, _ in parts]} do not add up to dim {self.dim} "
                f"of size {self.global_shape[self.dim]}"
            )
        object.__setattr__(self, "parts", parts)

    @classmethod
    def split(cls, shape: Sequence[int], dim: int, heads: int | None = None) -> ShardSpec:
        """`shape` split along `dim` in whole `heads` (None: in rows)."""
        shape = tuple(shape)
        return cls(shape, dim, ((shape[dim], heads),))

    @classmethod
    def packed(cls, shape: Sequence[int], dim: int, sizes: Sequence[int], heads: Sequence[int | None]) -> ShardSpec:
        """`shape` whose `dim` packs parts of `sizes`, each split in its own whole `heads` (None: rows)."""
        return cls(tuple(shape), dim, tuple(zip(sizes, heads, strict=True)))

    @property
    def is_split(self) -> bool:
        return self.dim is not None

    def check(self, tp: int) -> None:
        """Raise ValueError unless every part can be cut over `tp` ranks."""
        for size, heads in self.parts:
            if heads is not None and size % heads:
                raise ValueError(f"a part of size {size} is not a whole number of {heads} heads")
            check_heads(heads, tp)

    def local(self, rank: int, tp: int) -> ShardLayout:
        """The layout `rank` of `tp` holds: one range per part; `replicas` when every part is held by as many ranks."""
        if self.dim is None:
            return ShardLayout(self.global_shape, spec=self)
        ranges, replicas, offset = [], set(), 0
        for size, heads in self.parts:
            (start, end), copies = _cut(size, heads, rank, tp)
            ranges.append((offset + start, offset + end))
            replicas.add(copies)
            offset += size
        common = replicas.pop() if len(replicas) == 1 else 1
        return ShardLayout(self.global_shape, self.dim, tuple(ranges), common, spec=self)

    def replicated_segments(self, rank: int, tp: int) -> list[ReplicatedSegment]:
        """The local rows that are heads replicated over several ranks (their gradients are summed over them)."""
        segments, local = [], 0
        for size, heads in self.parts:
            (start, end), copies = _cut(size, heads, rank, tp)
            if copies > 1:
                segments.append(ReplicatedSegment(local, end - start, heads))
            local += end - start
        return segments

    def to_json(self) -> dict:
        """{"global_shape", "dim", "parts": [[size, heads or None], ...]} (replicated: dim None, no parts)."""
        return {"global_shape": list(self.global_shape), "dim": self.dim, "parts": [list(p) for p in self.parts]}

    @classmethod
    def from_json(cls, data: Mapping) -> ShardSpec:
        """The spec of a `to_json` dict (other keys, such as a layout's or a checkpoint entry's, are ignored)."""
        return cls(tuple(data["global_shape"]), data["dim"], tuple(tuple(p) for p in data.get("parts") or ()))


@dataclass(frozen=True)
class ShardLayout:
    """What one rank holds: the concatenation, along `dim`, of `ranges` of the global tensor.

    `dim=None` means replicated. `replicas` > 1 means that many tp ranks hold this same shard (e.g. a kv head
    replicated because tp > num_key_value_heads); their gradients are summed. `spec` is the ShardSpec the
    layout was cut from (every layout the styles make has one).
    """

    global_shape: tuple[int, ...]
    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    replicas: int = 1
    spec: ShardSpec | None = field(default=None, compare=False, repr=False)

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] = sum(end - start for start, end in self.ranges)
        return tuple(shape)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut out of the global `full` (a tensor or a safetensors slice)."""
        if self.dim is None:
            return full
        parts = [full.narrow(self.dim, start, end - start) for start, end in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def to_json(self) -> dict:
        """Its spec's `to_json` (without "parts" when it has no spec) and its "ranges" and "replicas"."""
        data = {"global_shape": list(self.global_shape), "dim": self.dim}
        if self.spec is not None:
            data["parts"] = self.spec.to_json()["parts"]
        return {**data, "ranges": [list(r) for r in self.ranges], "replicas": self.replicas}

    @classmethod
    def from_json(cls, data: Mapping) -> ShardLayout:
        """The layout of a `to_json` dict; it carries its spec when the dict has "parts"."""
        spec = ShardSpec.from_json(data) if "parts" in data else None
        ranges = tuple((int(s), int(e)) for s, e in data.get("ranges") or ())
        return cls(tuple(data["global_shape"]), data["dim"], ranges, int(data.get("replicas", 1)), spec=spec)


def split_layout(tensor: torch.Tensor) -> ShardLayout | None:
    """The layout of a tensor-parallel-split tensor, None for a replicated (or plain) one."""
    layout = getattr(tensor, "shard_layout", None)
    return layout if layout is not None and layout.dim is not None else None


def local_parameter(source: torch.Tensor, layout: ShardLayout, requires_grad: bool) -> nn.Parameter:
    """This rank's slice of `source` as a new Parameter carrying its `shard_layout` (meta stays meta). An XLA
    tensor is sliced on the CPU and moved back: slicing on the device would compile one graph per rank."""
    if devices.is_graph_device(source):
        local = layout.slice(source.detach().cpu()).clone().to(source.device)
    else:
        local = layout.slice(source.detach())
    if not (local.is_meta or devices.is_graph_device(local)):
        local = local.clone()
    param = nn.Parameter(local.contiguous(), requires_grad=requires_grad)
    param.shard_layout = layout
    return param


def shard_parameter(module: nn.Module, leaf: str, spec: ShardSpec, rank: int, tp: int) -> nn.Parameter:
    """Replace `module.<leaf>` by this rank's shard of it by `spec`; returns the new parameter."""
    source = getattr(module, leaf)
    param = local_parameter(source, spec.local(rank, tp), source.requires_grad)
    setattr(module, leaf, param)
    return param


def replace_tensor(module: nn.Module, leaf: str, value: torch.Tensor) -> None:
    """Give `module.<leaf>` the values `value`, keeping the Parameter object (and so every reference to it:
    tied weights, `orig_param_to_parallel_param`, its attributes and hooks)."""
    if leaf in module._buffers:
        module._buffers[leaf] = value
        return
    param = module._parameters[leaf]
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)  # shard_layout and friends
    for hook in (getattr(param, "_backward_hooks", None) or {}).values():
        new.register_hook(hook)
    torch.utils.swap_tensors(param, new)
