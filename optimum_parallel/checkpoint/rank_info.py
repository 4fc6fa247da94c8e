"""This rank's place in the mesh for checkpointing, and the few collectives saving and loading need.

Collectives run on the default process group, whose timeout `init_mesh` sets (a lost rank fails
the save instead of hanging it). Without torch.distributed everything is a single rank.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

from ..mesh import MeshLayout, get_mesh, ranks
from .crash import crash_point

T = TypeVar("T")


@dataclass(frozen=True)
class RankInfo:
    """This rank's coordinates, and the mesh sizes the files record (dp, pp, tp: cp is not among them).

    cp ranks hold the same parameters as their dp replica and FSDP2 / ZeRO-1 shard over dp x cp as one group, so
    a checkpoint does not depend on cp: the files a cp=2 run writes are those of the same run at cp=1, and any cp
    loads them.
    """

    dp: int
    pp: int
    tp: int
    sizes: dict[str, int]
    distributed: bool
    cp: int = 0
    ep: int = 0  # the rank in its expert group (sizes has "ep" when the mesh splits experts)
    replica: int = 0  # the rank among the dp x cp ranks holding the same (pp, tp) parameters
    group: dist.ProcessGroup | None = None  # where `gather` exchanges: None, the default group; an async save's own

    @property
    def writes_replica(self) -> bool:
        """Whether this rank writes its (pp, tp) shards: the first rank of the dp x cp ranks that hold them."""
        return self.replica == 0

    @property
    def writes_experts(self) -> bool:
        """Whether this rank writes its experts' (pp, tp) shards: it is in the first expert group of the dp x cp
        ranks (their ep ranks hold every expert once; dp x cp rank 0, the dense writer, is ep rank 0)."""
        return self.replica < self.sizes.get("ep", 1)

    @property
    def is_main(self) -> bool:
        return not self.distributed or ranks.global_rank() == 0

    def gather(self, obj: object) -> list:
        """`obj` from every rank, in global rank order."""
        if not self.distributed:
            return [obj]
        crash_point("gather")
        if self.group is not None:  # an async save's background thread: its own group, apart from training's
            out: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(out, obj, group=self.group)
            return out
        return ranks.all_gather_object(obj)  # on XLA through the store: the xla backend moves no pickles

    def run(self, fn: Callable[[], T], what: str, only_main: bool = False) -> list[T]:
        """Run `fn` on every rank (or the main one), then raise on every rank if it failed on any."""
        try:
            outcome = (True, fn() if self.is_main or not only_main else None)
        except Exception as err:  # reported to every rank below
            outcome = (False, f"{type(err).__name__}: {err}", err, traceback.format_exc())
        outcomes = self.gather(outcome[:2] if outcome[0] else (False, outcome[1]))
        failed = [(r, o[1]) for r, o in enumerate(outcomes) if not o[0]]
        if failed:
            if not outcome[0]:  # re-raise our own error with its type and traceback
                raise outcome[2]
            details = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
            raise RuntimeError(f"{what} failed on other ranks: {details}")
        return [o[1] for o in outcomes]


def current_rank() -> RankInfo:
    """This rank for checkpointing, from the mesh's layout: the sizes the files depend on are the dims that cut the
    weights (`MeshLayout.weight_shards`: pp, tp, ep; dp for the record), and the writer of a shard is the first of
    the ranks holding the same weights (the data-parallel dims, whatever the table holds)."""
    if not (dist.is_available() and dist.is_initialized()):
        return RankInfo(0, 0, 0, MeshLayout({}).weight_shards(), False)
    mesh = get_mesh()
    return RankInfo(
        mesh.rank("dp"),
        mesh.rank("pp"),
        mesh.rank("tp"),
        mesh.layout.weight_shards(),
        True,
        cp=mesh.rank("cp"),
        ep=mesh.rank("ep"),
        replica=mesh.data_parallel_rank,
    )
