"""Process groups made once per process and shared by every mesh: `init_mesh` called again (a test module's cases, a
sweep over layouts, a notebook) reuses the groups of the ranks it already grouped instead of making new ones, each of
which starts its own worker threads (gloo: two per group and device) that live as long as the group."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

_GROUPS: dict[tuple[tuple[int, ...], str], object] = {}
_WORLD: list = [None]  # the default group the cache belongs to


def shared_group(ranks, backend: str, options, timeout: timedelta):
    """The group of `ranks` on `backend` (`dist.GroupMember.NON_GROUP_MEMBER` on a rank outside it), made with
    `options` and `timeout` the first time. Collective the first time: every rank asks for every group, in the same
    order (as `dist.new_group` requires); a hit on one rank is a hit on all."""
    world = dist.group.WORLD
    if _WORLD[0] is not world:  # a new default group (or the first): the groups of the old one are gone
        _GROUPS.clear()
        _WORLD[0] = world
    key = (tuple(int(r) for r in ranks), backend)
    group = _GROUPS.get(key)
    if group is None:
        group = dist.new_group(list(key[0]), timeout=timeout, backend=backend, pg_options=options)
        _GROUPS[key] = group
    return group
