"""The ranks of one batch replica (its tp, cp and pp ranks, the mesh's `peers`) must all be given the same batch:
`SharedBatch` checks that they are ("check", the default), gives them the replica's first rank's batch ("broadcast")
or does nothing ("trust"); `install_shared_batch` runs it before every forward of a model (around every run of a
pipeline). Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..mesh import ParallelMesh, ranks
from ..mesh import device as devices

SHARED_BATCH = ("check", "broadcast", "trust")
CHECK_EVERY = 100
INPUTS = ("input_ids", "labels", "attention_mask", "position_ids", "inputs_embeds")


def _fingerprint(inputs: dict) -> torch.Tensor:
    """Per input name: present, numel, sum, index-weighted sum (float64): equal when the batches are."""
    rows = []
    for name in INPUTS:
        value = inputs.get(name)
        if not torch.is_tensor(value):
            rows.append(torch.zeros(4, dtype=torch.float64))
            continue
        flat = value.detach().reshape(-1).to("cpu", torch.float64)
        weights = torch.arange(flat.numel(), dtype=torch.float64) % 1009 + 1
        rows.append(torch.stack([torch.tensor(1.0, dtype=torch.float64), torch.tensor(float(flat.numel()),
                                 dtype=torch.float64), flat.sum(), (flat * weights).sum()]))  # fmt: skip
    return torch.cat(rows)


class SharedBatch:
    """The policy of one model's peers (docs/module_notes.md)."""

    def __init__(self, mesh: ParallelMesh, mode: str = "check", every: int = CHECK_EVERY) -> None:
        self.group, self.mode, self.every = mesh.group("peers"), mode, every
        self.peers = mesh.ranks("peers")
        self._shapes: set[tuple] = set()
        self._count = 0

    def __call__(self, inputs: dict) -> dict:
        """`inputs` as this rank must use them (the first peer's under "broadcast")."""
        if self.mode == "trust" or ranks.world_size(self.group) == 1:
            return inputs
        if self.mode == "broadcast":
            return self._broadcast(inputs)
        tensors = [v for v in inputs.values() if torch.is_tensor(v)]
        if any(devices.is_graph_device(t) for t in tensors):
            return inputs
        self._count += 1
        shape = tuple((name, tuple(inputs[name].shape)) for name in INPUTS if torch.is_tensor(inputs.get(name)))
        if shape in self._shapes and self._count % self.every:
            return inputs
        self._shapes.add(shape)
        self._check(inputs)
        return inputs

    def _check(self, inputs: dict) -> None:
        where = devices.collective_device(self.group)
        mine = _fingerprint(inputs).to(where)
        prints = [torch.empty_like(mine) for _ in self.peers]
        dist.all_gather(prints, mine, group=self.group)
        differing = [self.peers[i] for i, p in enumerate(prints) if not torch.equal(p, prints[0])]
        if differing:
            first = self.peers[0]
            raise ValueError(
                f"ranks {differing} hold other inputs than rank {first}, but the ranks {self.peers} split one batch "
                "replica's work (its tp, cp and pp ranks) and must all be given the same batch. Sample over the "
                "batch replicas only: DistributedSampler(dataset, num_replicas=mesh.size('batch'), "
                f"rank=mesh.rank('batch')); or parallelize with shared_batch='broadcast' to take rank {first}'s "
                "batch (for a loader that runs there only)"
            )

    def _broadcast(self, inputs: dict) -> dict:
        first = self.peers[0]
        mine = {n: (tuple(v.shape), v.dtype) for n, v in inputs.items() if n in INPUTS and torch.is_tensor(v)}
        described = [mine]
        dist.broadcast_object_list(described, src=first, group=self.group)
        where = devices.collective_device(self.group)
        out = dict(inputs)
        for name, (shape, dtype) in described[0].items():
            value = inputs.get(name)
            tensor = value.to(where) if ranks.global_rank() == first else torch.empty(shape, dtype=dtype, device=where)
            dist.broadcast(tensor, src=first, group=self.group)
            device = value.device if torch.is_tensor(value) else None
            out[name] = tensor.to(device) if device is not None else tensor
        return out


def install_shared_batch(model, mesh: ParallelMesh, mode: str) -> SharedBatch | None:
    """Run the peers' policy before every forward of `model` (first, before context parallelism cuts the batch), or
    around a pipeline's `run_train` / `run_eval`."""
    if mode == "trust" or mesh.size("peers") == 1:
        return None
    shared = SharedBatch(mesh, mode)

    def before_forward(module, args, kwargs):
        inputs = dict(kwargs)
        if args and torch.is_tensor(args[0]):
            inputs["input_ids"] = args[0]
        out = shared(inputs)
        if args and torch.is_tensor(args[0]):
            return (out.pop("input_ids"), *args[1:]), out
        return args, out

    run_train = getattr(model, "run_train", None)
    if run_train is not None:  # a pipeline: forward is refused, its runs take the batch
        run_eval = model.run_eval
        model.run_train = lambda *args, **kwargs: run_train(*args, **shared(kwargs))
        model.run_eval = lambda *args, **kwargs: run_eval(*args, **shared(kwargs))
    else:
        model.register_forward_pre_hook(before_forward, with_kwargs=True, prepend=True)
    return shared
