"""A default group stays bound to its device (`init_process_group(device_id=...)`) only where its backend can split.

Once the default group is bound, torch makes every later group by splitting the bound backend whenever that backend
reports `supports_splitting`, and a rank outside the new group calls the backend's `perform_nocolor_split`. NCCL has
it; gloo reports splitting but has no such method, so on a device whose process-group backend is built on gloo every
`new_group` that leaves a rank out (DeviceMesh's dims) failed on every rank: "'ProcessGroupGloo' object has no
attribute 'perform_nocolor_split'". Such a group is unbound here, right after it is made, and its sub-groups are then
made whole, as on any unbound group. The decision is read from the backend object itself, not from a list of names,
so a device package's own backend is judged by what it can do.
"""

from __future__ import annotations

import torch.distributed as dist


def split_works(group: dist.ProcessGroup) -> bool:
    """Whether torch's split of `group`'s bound backend can run (or is never tried): the backend does not report
    splitting, or what torch splits from (its wrappers peeled, as torch does) has `perform_nocolor_split`."""
    device = getattr(group, "bound_device_id", None)
    if device is None:
        return True
    try:
        backend = group._get_backend(device)
    except RuntimeError:  # no backend for the bound device: torch would not split either
        return True
    if not getattr(backend, "supports_splitting", False):
        return True
    while getattr(backend, "wrapped_pg", None) is not None:  # torch's debug wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL)
        backend = backend.wrapped_pg
    return hasattr(backend, "perform_nocolor_split")


def keep_only_where_split_works(group: dist.ProcessGroup | None = None) -> None:
    """Unbind `group` (the default group by default) from its device when torch's split of it would raise."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if not split_works(group):
        group.bound_device_id = None
