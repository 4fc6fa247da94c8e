"""torch's `PipelineStage` and ZBV schedule for the installed torch: torch 2.13's as they are; torch 2.9's (the oldest
supported) taught what the pipeline needs of them and torch 2.13's do themselves. `TorchStage` is the stage class to
build, `torch_schedule(cls)` the schedule class to run. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble, _utils
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.distributed.pipelining.stage import _RecvInfo


def _takes_grad(info: object) -> bool:
    """Whether a receive entry of torch 2.9's stage holds a floating-point buffer (root inputs have none)."""
    return isinstance(info, _RecvInfo) and info.buffer is not None and info.buffer.is_floating_point()


class _Torch29Stage(PipelineStage):
    """torch 2.9's stage whose integer activations travel without gradients, as torch 2.13's do."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        ops = [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]
        for op in ops:  # both sides float32, as torch 2.13's warm-up
            op.tensor = op.tensor.float()
        return ops

    def _prepare_forward_infra(self, num_microbatches, args, kwargs=None):
        training, self.has_backward = self.has_backward, False  # no requires_grad on every receive buffer
        try:
            outputs = super()._prepare_forward_infra(num_microbatches, args, kwargs)
        finally:
            self.has_backward = training
        if training:
            for infos in self.args_recv_info.values():
                for info in filter(_takes_grad, infos):
                    info.buffer.requires_grad_(True)
        return outputs

    def _shape_inference(self, args, kwargs=None):
        if not self.is_first:
            return super()._shape_inference(args, kwargs)
        # torch 2.9 runs the first stage on zeros of its inputs' shapes, where a VLM's image tokens vanish ('tokens: 0,
        # features: 1024'): here on the first micro-batch itself
        submod = self.submod
        self.submod = lambda *zeros, **named: submod(*args, **named)
        try:
            return super()._shape_inference(args, kwargs)
        finally:
            self.submod = submod

    def _create_grad_recv_info(self, act_send_info):
        infos = super()._create_grad_recv_info(act_send_info)
        for info in infos:
            if not info.buffer.is_floating_point():  # no gradient comes back for an integer output
                info.buffer = None
        return infos

    def _create_grad_send_info(self, args_recv_info):
        sends = super()._create_grad_send_info(args_recv_info)
        return [dst if _takes_grad(info) else None for info, dst in zip(args_recv_info, sends, strict=True)]

    def _get_recv_ops(self, recv_infos):
        kept = tuple(info for info in recv_infos if not isinstance(info, _RecvInfo) or info.buffer is not None)
        return super()._get_recv_ops(kept)  # none for the integer outputs' gradients (no buffer)

    def set_local_fwd_input(self, prev_stage_outputs, mb_index: int) -> None:
        # the previous stage on this rank (a V placement) hands its outputs over: a fresh leaf each, floats taking grads
        for info, tensor in zip(self.args_recv_info[mb_index], prev_stage_outputs, strict=True):
            info.buffer = tensor.detach().requires_grad_(tensor.is_floating_point())

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        # the next stage on this rank hands its input gradients over (None for an integer input)
        for info, grad in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs, strict=True):
            info.buffer = grad

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if backward_type != "input":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        outputs, grads = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"]
        if grads is not None:  # not the loss: only the outputs that take a gradient are differentiated
            kept = [(out, grad) for out, grad in zip(outputs, grads, strict=True) if out.requires_grad]
            outputs, grads = tuple(out for out, _ in kept), tuple(grad for _, grad in kept)
        given, param_groups = super().backward_maybe_with_nosync(
            "input", {**bwd_kwargs, "stage_output": outputs, "output_grads": grads}, last_backward
        )
        given = iter(given)  # back in line with the inputs: None for those that take no gradient
        inputs = bwd_kwargs["input_values"]
        return tuple(next(given) if x.requires_grad else None for x in inputs), param_groups


TorchStage: type[PipelineStage] = PipelineStage if hasattr(_utils, "_StageMeta") else _Torch29Stage


class _ZBVLowered(_PipelineScheduleRuntime):
    """torch 2.9's ZBV order run by its schedule runtime, which hands activations and gradients between a rank's own
    two stages in memory: torch 2.9's `ScheduleZBVZeroBubble` sends them through the process group, to its own rank
    (gloo: 'Pair is not connected'); torch 2.13's is such a runtime itself."""

    def __init__(self, stages, n_microbatches, **kwargs) -> None:
        super().__init__(stages, n_microbatches, **kwargs)
        order = ScheduleZBVZeroBubble(stages, n_microbatches, **kwargs)  # its V placement, set on the stages
        self._prepare_schedule_with_comms(order.pipeline_order)


def torch_schedule(cls: type) -> type:
    """torch's schedule class `cls`, or what runs its order on this torch (torch 2.9's ZBV: `_ZBVLowered`)."""
    if cls is ScheduleZBVZeroBubble and not issubclass(cls, _PipelineScheduleRuntime):
        return _ZBVLowered
    return cls
