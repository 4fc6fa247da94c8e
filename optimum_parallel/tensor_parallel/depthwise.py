"""A depthwise Conv1d (groups == channels) split by channels over tp: the convolution of the channels this rank
holds, nothing to communicate.

State-space and linear-attention mixers (Mamba, gated delta nets, LFM2's short convolutions) convolve each channel
on its own, and many read `conv.weight` directly instead of calling the module. The local weight is a packed layout
(x | B | C): a part with fewer groups than ranks is replicated, and its gradient rows are summed over the replicas
whenever the weight is read (a class-level property over the registered parameter, so state-dict keys, DDP and
FSDP2, which replace `_parameters`, are unchanged).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed import ProcessGroup

from .packed_linear import sum_segment_grads
from .spec import ReplicatedSegment

_CLASSES: dict[type, type] = {}


def _summed(name: str):
    def read(self):
        param = self._parameters[name]
        # FSDP2's sharded parameter (a DTensor) is read as it is: FSDP2 keeps whatever `getattr` returns as the
        # parameter it shards; the forward reads the unsharded one it registered, whose segments are summed
        if param is None or not self.segments or hasattr(param, "_local_tensor"):
            return param
        return sum_segment_grads(param, 0, self.segments)

    def write(self, value):
        nn.Module.__setattr__(self, name, value)

    return property(read, write)


def localize_depthwise_conv(
    conv: nn.Conv1d, channels: int, segments: Sequence[tuple[ReplicatedSegment, ProcessGroup]] = ()
) -> nn.Conv1d:
    """Make `conv` (its weight and bias already this rank's channels) a depthwise conv over `channels` channels whose
    replicated `segments` have their gradient rows summed over their replicas."""
    conv.in_channels = conv.out_channels = conv.groups = channels
    if segments:
        cls = type(conv)
        if cls not in _CLASSES.values():
            if cls not in _CLASSES:
                props = {"weight": _summed("weight"), "bias": _summed("bias"), "__module__": cls.__module__}
                _CLASSES[cls] = type(cls.__name__, (cls,), props)
            conv.__class__ = _CLASSES[cls]
    conv.segments = tuple(segments)
    return conv
