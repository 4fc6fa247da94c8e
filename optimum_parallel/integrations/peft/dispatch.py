"""Teach PEFT to wrap this package's parallel layers: `get_peft_model` on an already parallel model.

PEFT picks the LoRA layer for a target module through `LoraModel._create_new_module`, whose dispatchers know
torch's layers, Megatron's and a few quantised ones. It is wrapped once: a target whose base is a
`ColumnParallelLinear` / `RowParallelLinear` becomes a PEFT `lora.Linear` (sized by the layers' global
`input_size` / `output_size`, so its init draws what one device would) whose adapters are then split like the
base (`shard_lora_layer`); every other target goes to PEFT's own dispatch unchanged.
"""

from __future__ import annotations

import torch.distributed as dist

from ...tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..transformers.internals import transformers_internal
from .lora import shard_lora_layer

_INSTALLED = False


def install_peft_dispatch() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from peft.tuners.lora import Linear
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    original = transformers_internal("LoraModel._create_new_module")

    def create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
            return original(lora_config, adapter_name, target, **kwargs)
        module = Linear(target, adapter_name, config=lora_config, **kwargs)
        shard_lora_layer(module, dist.get_rank(base.group), dist.get_world_size(base.group))
        return module

    LoraModel._create_new_module = staticmethod(create_new_module)
    _INSTALLED = True
