"""Styles that keep a module whole: user hooks around it, or replicated parameters whose gradients sum over tp."""

from __future__ import annotations

from collections.abc import Callable

from ..tensor_parallel.replicated import sum_parameter_gradients
from .base import ParallelStyle


class PrepareLayerInput(ParallelStyle):
    """Run `fn(module, args, kwargs)` before the module (torch's forward pre-hook with kwargs contract:
    return None or a new `(args, kwargs)`)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def apply(self, module, name, ctx):
        module.register_forward_pre_hook(self.fn, with_kwargs=True)
        return module


class PrepareLayerOutput(ParallelStyle):
    """Run `fn(module, args, output)` after the module (torch's forward hook: return None or a new output)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def apply(self, module, name, ctx):
        module.register_forward_hook(self.fn)
        return module


class ReplicatedWithGradAllReduce(ParallelStyle):
    """Keep the module's parameters whole on every rank, but sum their gradients over tp.

    For parameters applied to split work (Qwen3's per-head q_norm/k_norm see only this rank's heads),
    each rank's gradient is a partial sum. The sum happens in the forward path (FSDP2/DDP-safe); it
    covers the module's own parameters.
    """

    def apply(self, module, name, ctx):
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            sum_parameter_gradients(module, ctx.mesh.tp_group)
        return module
