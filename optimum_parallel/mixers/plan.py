"""How each token mixer that carries a state along the sequence runs under context parallelism, decided from the
checked plan before anything changes (pure: it reads the original modules and the plan's styles).

A mixer the plan splits by heads (`autoplan/mixer_plan.py`: projections, convolution channels, per-head parameters
and the forward's own size attributes) runs its heads split once more over the cp ranks, on the whole sequence
(`mode="heads"`): its head split over tp x cp ranks must be whole heads, or the request is refused naming the layer
and the number. A mixer the plan leaves whole (a gated norm spanning every head, a custom plan naming none of it)
runs whole on every cp rank (`mode="whole"`: the same answer, cp times the mixer's work), with a warning naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from ..styles import DepthwiseConvParallel, ParallelStyle, ReplicatedWithGradAllReduce
from ..styles.base import ROW
from ..styles.mixer import AllReduceOutputGradient, LocalAttributes, SplitBuffer
from ..tensor_parallel.spec import ShardSpec

Counts = tuple[tuple[int, int], ...]  # (units, size of one): see styles.mixer.LocalAttributes


@dataclass(frozen=True)
class MixerSpec:
    """One mixer's part in context parallelism. Names are relative to the mixer (dotted for a child's); specs are
    the global ones its tp plan cuts by (a rank's cp slice of its tp-local tensor follows from them)."""

    name: str
    mode: str  # "heads": split once more over cp; "whole": run whole on every cp rank
    reason: str = ""  # why "whole"
    params: Mapping[str, ShardSpec] = field(default_factory=dict)
    buffers: Mapping[str, ShardSpec] = field(default_factory=dict)
    attrs: Mapping[str, Counts] = field(default_factory=dict)
    convs: tuple[str, ...] = ()  # depthwise convolutions: `groups` and channels follow the split
    inner_rows: tuple[str, ...] = ()  # row layers whose (partial) output feeds split work inside the mixer
    exit_biases: tuple[str, ...] = ()  # biases added after the mixer's output row layer: kept on cp rank 0 only


def _relative(name: str, mixer: str) -> str:
    return name[len(mixer) + 1 :] if name != mixer else ""


def _join(owner: str, leaf: str) -> str:
    return f"{owner}.{leaf}" if owner else leaf


def _whole(name: str, reason: str) -> MixerSpec:
    return MixerSpec(name, "whole", reason)


def _builds(styles: Sequence[ParallelStyle]) -> str | None:
    return next((s.builds for s in styles if s.swaps_module and s.builds is not None), None)


def plan_mixer(model: nn.Module, name: str, module_styles: Mapping[str, Sequence[ParallelStyle]] | None) -> MixerSpec:
    """The part of the mixer `name` (a module of `model`, not yet parallelized) under cp, from the checked plan
    `module_styles` (module name -> styles)."""
    mixer = model.get_submodule(name)
    styled = {n: s for n, s in (module_styles or {}).items() if n == name or n.startswith(name + ".")}
    kinds = {n: _builds(s) for n, s in styled.items()}
    params: dict[str, ShardSpec] = {}
    buffers: dict[str, ShardSpec] = {}
    attrs: dict[str, Counts] = {}
    convs, inner, kept = [], [], set()
    modules = dict(mixer.named_modules())
    for full, styles in styled.items():
        owner = _relative(full, name)
        module = modules[owner]
        for style in styles:
            for leaf, spec in style.param_specs(module).items():
                kept.add(_join(owner, leaf))  # split, or whole by the style's own decision (a row layer's bias)
                if spec.is_split:
                    params[_join(owner, leaf)] = spec
            if isinstance(style, LocalAttributes):
                attrs.update({_join(owner, a): counts for a, counts in style.attrs.items()})
            if isinstance(style, SplitBuffer):
                value = module._buffers[style.buffer]
                dim = style.dim % value.dim()
                buffers[_join(owner, style.buffer)] = ShardSpec.packed(value.shape, dim, style.parts, style.units)
            if isinstance(style, DepthwiseConvParallel):
                convs.append(owner)
            if isinstance(style, AllReduceOutputGradient) and kinds.get(full) == ROW:
                inner.append(owner)
            if isinstance(style, (ReplicatedWithGradAllReduce, AllReduceOutputGradient)):  # whole
                kept.update(_join(owner, leaf) for leaf, _ in module.named_parameters())
    left = [n for n, _ in mixer.named_parameters() if n not in params and n not in kept]
    if not params:
        return _whole(name, "no plan splits its heads")
    if left:
        return _whole(name, f"the plan says nothing of {', '.join(left[:4])}")
    rows = [n for n, kind in kinds.items() if kind == ROW]
    exits = [_relative(n, name) for n in rows if _relative(n, name) not in inner]
    biases = tuple(_join(e, "bias") for e in exits if getattr(modules[e], "bias", None) is not None)
    return MixerSpec(name, "heads", "", params, buffers, attrs, tuple(convs), tuple(inner), biases)


def check_heads_split(spec: MixerSpec, tp: int, cp: int) -> None:
    """Raise, naming the mixer, its tensor and the sizes, when its heads do not split over tp x cp ranks."""
    if spec.mode != "heads":
        return
    shards = {**spec.params, **spec.buffers}
    most = max((heads for shard in shards.values() for _, heads in shard.parts if heads is not None), default=None)
    for leaf, shard in shards.items():
        for size, heads in shard.parts:
            shared = heads is not None and heads < (most or 0)  # key heads / B-C groups that several heads read
            if _splits(size, heads, tp * cp, shared):
                continue
            allowed = [c for c in range(1, 2 * max(cp, 8) + 1) if _splits(size, heads, tp * c, shared)]
            what = f"{heads} heads" if heads is not None else f"{size} channels"
            raise ValueError(
                f"{spec.name}.{leaf}: {what} cannot be split over tensor_parallel_size={tp} x "
                f"context_parallel_size={cp} ranks; allowed context_parallel_size: {allowed}"
            )


def _splits(size: int, heads: int | None, ranks: int, shared: bool) -> bool:
    """Whether `ranks` can cut a part of `size` rows in whole `heads` (None: rows): evenly, or (`shared`: key heads
    or B/C groups read by several of the mixer's heads) each head replicated over `ranks / heads` ranks."""
    count = heads if heads is not None else size
    return count % ranks == 0 or (shared and count < ranks and ranks % count == 0)
