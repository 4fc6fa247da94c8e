"""The style contract: how one module of a plan is parallelized.

A style checks that it fits its module before anything moves (`check`), says how it splits the module's own
parameters (`param_specs`, rank-free, so a plan can be resolved for any tp on one process) and then swaps or
hooks the module (`apply`). Styles know the engine's layers, never a model family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..comm.tp_entry import LayerWiring, RegionEntry, SequenceRegion
from ..mesh import ParallelMesh, ranks
from ..tensor_parallel.spec import ShardSpec, check_heads


@dataclass
class PlanContext:
    """What a style needs to know while it is applied: the mesh, the model's tp region entry and sequence-parallel
    region, and every layer's wiring, decided from the whole plan before any module is built (`plan/wiring.py`)."""

    mesh: ParallelMesh
    entry: RegionEntry = field(default_factory=RegionEntry)
    sequence: SequenceRegion | None = None  # set when the plan has sequence-parallel styles
    wirings: dict[str, LayerWiring] = field(default_factory=dict)  # module name -> its layer's wiring
    default_wiring: LayerWiring = field(
        default_factory=LayerWiring
    )  # a layer the plan did not name (styles used alone)
    gathering_blocks: frozenset[str] = frozenset()  # SequenceParallelDisable'd blocks with parallel layers inside
    kinds: dict[str, str] = field(default_factory=dict)  # module name -> COLUMN or ROW: the tp layers the plan builds

    def wiring(self, name: str) -> LayerWiring:
        """The wiring of the layer the style builds at `name`."""
        return self.wirings.get(name, self.default_wiring)

    @property
    def tp_rank_world(self) -> tuple[int, int]:
        group = self.mesh.tp_group
        return ranks.rank(group), ranks.world_size(group)


COLUMN, ROW = "column", "row"  # the layers a swapping style builds: entering the tp region, or leaving it


class ParallelStyle:
    """One way of parallelizing a module. `check` raises before anything moves; `apply` may swap the module."""

    allowed_modules: tuple[type, ...] = (nn.Module,)
    swaps_module = False  # True for styles that replace the module (applied before hooks and markers)
    builds: str | None = None  # COLUMN or ROW: the kind of tp layer it builds (its wiring is decided with the plan)

    def check(self, module: nn.Module, name: str, ctx: PlanContext) -> None:
        if not isinstance(module, self.allowed_modules):
            allowed = ", ".join(t.__name__ for t in self.allowed_modules)
            raise ValueError(
                f"{type(self).__name__} does not fit module {name!r} of type {type(module).__name__}; "
                f"it applies to: {allowed}"
            )

    def param_specs(self, module: nn.Module) -> dict[str, ShardSpec]:
        """{name of a parameter of `module` (dotted for a child's): how this style splits it}; {} for hooks."""
        return {}

    def apply(self, module: nn.Module, name: str, ctx: PlanContext) -> nn.Module:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class HeadSplitStyle(ParallelStyle):
    """A style that splits its module in whole heads (`units`; None: in rows). `replicates_heads`: fewer heads
    than ranks is allowed, each head then living on tp / heads ranks (column splits of kv heads)."""

    replicates_heads = False

    def __init__(self, units: int | None = None) -> None:
        self.units = units

    def check(self, module: nn.Module, name: str, ctx: PlanContext) -> None:
        super().check(module, name, ctx)
        check_style_heads(self.units, ctx.mesh.tp_size, name, allow_replication=self.replicates_heads)


@dataclass(frozen=True)
class optional:  # noqa: N801 - reads as a marker in plans: {"lm_head": optional(ColWiseParallel())}
    """Mark a plan entry that may match nothing (model-family plans covering several variants)."""

    styles: ParallelStyle | list[ParallelStyle]


def check_style_heads(heads: int | None, tp: int, name: str, allow_replication: bool = True) -> None:
    """`check_heads` with the module's name in the message."""
    try:
        check_heads(heads, tp, allow_replication=allow_replication)
    except ValueError as err:
        raise ValueError(f"{name!r}: {err}") from None
