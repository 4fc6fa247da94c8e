"""Random numbers on tensor-parallel ranks: the same where activations are replicated, independent where they are
split (Megatron's discipline, without asking the caller to seed in a special way). `share_rng_states` gives every rank
of a tp group its first rank's states; `SplitRegions` holds this rank's own streams for split work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import device as devices
from ..mesh import ranks


def share_rng_states(group: dist.ProcessGroup) -> None:
    """Every rank of `group` takes the group's first rank's random states (the CPU's and the accelerator's)."""
    if ranks.world_size(group) == 1:
        return
    source = ranks.group_ranks(group)[0]
    states = devices.rng_states()
    if ranks.on_xla():  # the XLA backend broadcasts XLA tensors only: the states travel as objects
        devices.set_rng_states(ranks.all_gather_object(states)[source])
        return
    where = devices.collective_device(group)
    for kind, state in states.items():
        on_wire = state.to(where)
        dist.broadcast(on_wire, src=source, group=group)
        states[kind] = on_wire.cpu()
    devices.set_rng_states(states)


_SEED_RANGE = 2**62


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class SplitRegions:
    """This rank's random streams for split work, entered after a column layer's forward in training mode (dropout
    is off in eval mode: nothing is drawn then) and left before the next row layer's (or at the end of the model's
    forward)."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        # while inside a split region: the default states before and after the seed's draw, and the region's own
        # states as seeded (to tell whether the region drew anything)
        self._saved: tuple[dict[str, torch.Tensor], ...] | None = None

    def enter(self) -> None:
        """Draw this region's seed from the shared default stream (the same draw on every tp rank), then switch the
        default generators to ones seeded for this rank (nothing if already inside)."""
        if self._saved is not None:
            return
        before = devices.rng_states()
        seed = int(torch.randint(0, _SEED_RANGE, (1,)).item())
        seeded = devices.seeded_rng_states(hash((seed, self.tp_rank)) % _SEED_RANGE)
        self._saved = before, devices.rng_states(), seeded
        devices.set_rng_states(seeded)

    def leave(self) -> None:
        """Back to the default streams: as they were after the seed's draw if the region drew random numbers, as they
        were before it otherwise (one device would have drawn nothing there). The tp ranks run the same operations on
        their shards, so they all draw or all do not, and their default streams stay equal."""
        if self._saved is not None:
            (before, after, seeded), self._saved = self._saved, None
            now = devices.rng_states()
            drew = any(not torch.equal(now[kind], seeded[kind]) for kind in seeded if kind in now)
            devices.set_rng_states(after if drew else before)

    def install(self, model: nn.Module, columns: list[nn.Module], rows: list[nn.Module]) -> None:
        """Enter after every column layer of `columns`, leave before every row layer of `rows`, and leave at the end
        of every forward of `model` (whatever it ended in). Inside a compiled block the layers' hooks do nothing:
        generators are not state a graph can swap, and the block's random numbers come from seeds the compiled
        graph draws from the shared default stream (see `engine/compile.py`)."""
        for layer in columns:  # only in training mode: an eval forward draws nothing (sampling sees one device's RNG)
            layer.register_forward_hook(
                lambda module, args, output: self.enter() if module.training and not _compiling() else None
            )
        for layer in rows:
            layer.register_forward_pre_hook(lambda module, args: None if _compiling() else self.leave())
        model.register_forward_pre_hook(lambda module, args: self.leave())
        model.register_forward_hook(lambda module, args, output: self.leave(), always_call=True)
