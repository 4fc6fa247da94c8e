"""Replicas that must stay equal, checked: every parameter (and optimizer state) held in copies on several ranks --
a replicated weight on the tp ranks, every weight on the data-parallel replicas, an expert on its replica group --
must be the same on each. A drift means a wrong model without a word (torch's `clip_grad_norm_` over local shards,
ranks re-seeded differently with dropout on, an optimizer stepped on some ranks only).

`check_replicas(model)` compares a fingerprint of every such tensor over the ranks that hold it, one small all-gather
per group, and raises naming the first tensor and ranks that differ. Parallelized models run it themselves on their
2nd and 3rd forward (after the first optimizer steps) and every `CHECK_EVERY` forwards after; the Trainer also at
every save.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import ParallelMesh, get_mesh, ranks
from ..mesh import device as devices
from ..mesh.loaded import is_dtensor, is_zero_optimizer, local_tensor
from ..plan.wrappers import plan_root
from ..state import parallel_state

CHECK_EVERY = 100
LIKELY_CAUSES = (
    "likely causes: torch.nn.utils.clip_grad_norm_ over a parallel model (each rank sees its own shards and clips by "
    "another factor: use op.clip_grad_norm_(model, max_norm)), ranks re-seeded differently after parallelize with "
    "dropout on (seed before parallelize: it shares the tp ranks' random state), or an optimizer stepped on some ranks "
    "only"
)


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A few numbers that differ when two copies do (of this rank's part: FSDP2's shard of a DTensor)."""
    flat = local_tensor(tensor).detach().reshape(-1).double()
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 251 + 1
    return torch.stack([flat.sum(), (flat * flat).sum(), (flat * weights).sum()])


def _replica_groups(param: nn.Parameter, mesh: ParallelMesh, data_parallel: bool, split: bool) -> list[str]:
    """The mesh dims over which `param` is held in equal copies (`data_parallel`: the data-parallel replicas too;
    `split`: it is split over tp)."""
    dims = []
    if not split and mesh.size("tp") > 1:
        dims.append("tp")
    if data_parallel and not is_dtensor(param):  # FSDP2 shards over the data-parallel ranks: no copies there
        if getattr(param, "expert_layout", None) is not None:
            dims.append("ep_replicate" if mesh.size("ep") > 1 else "dp_cp")
        else:
            dims.append("dp_cp")
    return [d for d in dims if mesh.size(d) > 1]


def check_replicas(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    mesh: ParallelMesh | None = None,
    *,
    data_parallel: bool | None = None,
    split: set[str] | None = None,
) -> None:
    """Raise RuntimeError, on every rank, if a tensor that must be the same on several ranks differs between them;
    call it on every rank. `optimizer`: its state is checked too (not ZeRO-1's, which is sharded by design).
    `data_parallel`: compare the data-parallel replicas too (default: when the model runs data parallelism).
    `split`: names of parameters split over tp beside those carrying a `shard_layout` now (FSDP2 at level 2 registers
    plain unsharded parameters between a no-grad forward and the next step)."""
    mesh = mesh or get_mesh()
    if data_parallel is None:
        data_parallel = parallel_state(plan_root(model)).data_parallel_level is not None
    tensors: dict[str, list[tuple[str, torch.Tensor]]] = {}
    state = optimizer.state if optimizer is not None and not is_zero_optimizer(optimizer) else {}
    for name, param in plan_root(model).named_parameters():
        is_split = getattr(param, "shard_layout", None) is not None or (split is not None and name in split)
        for dim in _replica_groups(param, mesh, data_parallel, is_split):
            tensors.setdefault(dim, []).append((name, param))
            for key, value in state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and not is_dtensor(value):
                    tensors[dim].append((f"{name} (optimizer state {key!r})", value))
    for dim in sorted(tensors):  # the same order on every rank
        entries = tensors[dim]
        group = mesh.group(dim)
        where = devices.collective_device(group)
        mine = torch.stack([_fingerprint(t).to(where) for _, t in entries])
        if ranks.on_xla():
            gathered = [torch.as_tensor(p) for p in ranks.all_gather_object(mine.cpu())]
            members = mesh.ranks(dim)
            gathered = [gathered[r] for r in members]
        else:
            gathered = [torch.empty_like(mine) for _ in range(ranks.world_size(group))]
            dist.all_gather(gathered, mine, group=group)
            members = mesh.ranks(dim)
        for index, (name, _) in enumerate(entries):
            rows = [g[index] for g in gathered]
            differing = [members[i] for i, row in enumerate(rows) if not torch.equal(row, rows[0])]
            if differing:
                raise RuntimeError(
                    f"{name!r} must be the same on ranks {members} (its copies over the {dim} group), but ranks "
                    f"{differing} hold another value than rank {members[0]}: {LIKELY_CAUSES}"
                )


def install_replica_watch(model: nn.Module, mesh: ParallelMesh, every: int = CHECK_EVERY) -> None:
    """Check the replicas of `model` on its 2nd and 3rd forward (after the first optimizer steps) and every `every`
    forwards after (a pipeline: its `run_train` calls); not on XLA devices (it reads values on the host)."""
    count = [0]
    split = {name for name, p in model.named_parameters() if getattr(p, "shard_layout", None) is not None}

    def due() -> bool:
        count[0] += 1
        return count[0] in (2, 3) or count[0] % every == 0

    def check() -> None:
        params = list(model.parameters())
        if params and not any(devices.is_graph_device(p) for p in params[:1]):
            check_replicas(model, mesh=mesh, split=split)

    run_train = getattr(model, "run_train", None)
    if run_train is not None:

        def watched_run_train(*args, **kwargs):
            if due():
                check()
            return run_train(*args, **kwargs)

        model.run_train = watched_run_train
    else:

        def before_forward(module, args):
            if torch.is_grad_enabled() and due():
                check()

        model.register_forward_pre_hook(before_forward)
