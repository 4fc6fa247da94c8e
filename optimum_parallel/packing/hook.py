"""The forward pre-hook that makes a parallel model honour packed rows on every layout without context parallelism
(tp, sp, dp, ep; the pipeline reads packed batches through its batch functions, context parallelism in its own
input split): the batch is put in the packed form (`documents.packed_inputs`), which the model's own mask builders turn
into a document mask under eager, sdpa and flex attention."""

from __future__ import annotations

import functools
import inspect

from torch import nn

from .documents import packed_inputs


@functools.cache
def _forward_signature(model_class: type) -> inspect.Signature:
    return inspect.signature(model_class.forward)


def _flash(model: nn.Module) -> bool:
    """Flash-attention kernels read `cu_seq_lens_*` themselves: those keys stay for them."""
    return "flash" in str(getattr(model.config, "_attn_implementation", "") or "")


def _before_forward(model: nn.Module, args: tuple, kwargs: dict):
    if not kwargs.keys() & {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"} and len(args) < 3:
        return None  # the common case, at no cost: nothing that marks documents
    bound = _forward_signature(type(model)).bind_partial(model, *args, **kwargs).arguments
    bound.pop("self", None)
    extra = bound.pop("kwargs", {})
    packed = packed_inputs({**bound, **extra}, keep_flash_keys=_flash(model))
    if packed is None:
        return None
    return (), packed


def install_packing(model: nn.Module) -> None:
    """Packed rows through `model`'s forward give every document what it gets run alone (see the module docstring)."""
    model.register_forward_pre_hook(_before_forward, with_kwargs=True)
