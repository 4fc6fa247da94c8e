"""ParallelTrainer on XLA devices (Neuron; torch-xla's CPU device in the tests): one `torch_xla.sync()` per optimizer
step, and no gradient reduction but the model's own.

On XLA, transformers' Trainer leaves the graph cut to accelerate's device loader (`MpDeviceLoader` syncs at every
batch it hands out, from background threads that move the batches), and accelerate's optimizer wrapper all-reduces
every gradient over every device before a step: its data parallelism, over all devices. A parallel model reduces its
gradients itself over the ranks that hold the same parameters, and tp shards must not be averaged at all; so here
the loader stays a plain one (the Trainer's `_prepare_inputs` moves each batch), accelerate is told the gradients
are reduced, and the one sync comes right after the optimizer step, before any callback or log reads a value.
"""

from __future__ import annotations

import contextlib

import torch
from accelerate import data_loader as accelerate_loaders
from transformers import TrainerCallback

from ...mesh import device as devices


def on_xla_device(device: torch.device | str) -> bool:
    return devices.is_graph_device(device)


def plain_loader(prepared):
    """accelerate's loader without its XLA device wrapper (`MpDeviceLoaderWrapper`, which syncs per batch)."""
    wrapper = getattr(accelerate_loaders, "MpDeviceLoaderWrapper", None)  # defined where torch-xla imports
    return prepared.dataloader if wrapper is not None and isinstance(prepared, wrapper) else prepared


class XlaStepCallback(TrainerCallback):
    """The first of the Trainer's callbacks (`install`): before each optimizer step it tells accelerate the gradients
    are reduced (accelerate keeps that state per thread on XLA: each device's thread marks its own); after the step
    it cuts and runs the step's graph."""

    def __init__(self, gradient_state, device: torch.device) -> None:
        self.gradient_state, self.device = gradient_state, device

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.gradient_state.is_xla_gradients_synced = True

    def on_optimizer_step(self, args, state, control, **kwargs):
        devices.sync_graph(self.device)

    @classmethod
    def install(cls, trainer) -> None:
        trainer.callback_handler.callbacks.insert(0, cls(trainer.accelerator.gradient_state, trainer.args.device))


@contextlib.contextmanager
def no_token_gather(args):
    """transformers' count of a batch's labelled tokens, without its gather over every device (accelerate's XLA
    gather syncs right after it); the caller sums the count over the dp replicas in the graph instead."""
    saved, args.average_tokens_across_devices = args.average_tokens_across_devices, False
    try:
        yield
    finally:
        args.average_tokens_across_devices = saved
