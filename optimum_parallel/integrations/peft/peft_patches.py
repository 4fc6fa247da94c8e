"""Make PEFT handle this package's parallel layers (`install_peft_dispatch`, installed once): `get_peft_model` on an
already parallel model, `target_modules="all-linear"` counting the parallel layers, unsupported targets refused before
PEFT changes anything, and adapters saved from a parallel model in PEFT's own format (whole tensors, loadable on one
device). Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import torch.distributed as dist

from ...mesh import ranks
from ...tensor_parallel.gather import gather_full
from ...tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..transformers.internals import transformers_internal
from .lora import check_lora_target, is_parallel_lora, shard_lora_layer

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
        check_lora_target(base, kwargs.get("current_key") or type(base).__name__)
        module = Linear(target, adapter_name, config=lora_config, **kwargs)
        shard_lora_layer(module, ranks.rank(base.group), ranks.world_size(base.group))
        return module

    LoraModel._create_new_module = staticmethod(create_new_module)
    _install_all_linear()
    _install_target_check(LoraModel)
    _install_save()
    _INSTALLED = True


def _install_all_linear() -> None:
    """PEFT decides "all-linear" with `isinstance(module, (nn.Linear, Conv1D))`, `Conv1D` read from its module at
    call time: for the call, that name is a tuple that also holds the parallel layers (isinstance takes nested
    tuples). PEFT's own selection and exclusions run unchanged; nothing else sees the wider name."""
    from peft.tuners import tuners_utils

    original = transformers_internal("tuners_utils._maybe_include_all_linear_layers")
    conv1d = transformers_internal("tuners_utils.Conv1D")

    def include_all_linear_layers(peft_config, model):
        tuners_utils.Conv1D = (conv1d, ColumnParallelLinear, RowParallelLinear)
        try:
            return original(peft_config, model)
        finally:
            tuners_utils.Conv1D = conv1d

    tuners_utils._maybe_include_all_linear_layers = include_all_linear_layers


def _install_target_check(lora_model: type) -> None:
    """Before PEFT replaces any module: refuse every target of the adapter config that is a parallel layer LoRA does
    not support (the vocab-parallel LM head, packed layers, gathered outputs), so a refused `get_peft_model` leaves
    the model as it was (the dispatch above would refuse too, but only after the earlier targets were wrapped)."""
    from peft.tuners import tuners_utils
    from peft.tuners.tuners_utils import check_target_module_exists

    original = lora_model.inject_adapter

    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        config = self.peft_config.get(adapter_name) if isinstance(self.peft_config, dict) else None
        if config is not None and config.target_modules is not None:
            config = tuners_utils._maybe_include_all_linear_layers(config, model)  # "all-linear": the names, as PEFT
            # resolves it next (in place, on the config PEFT keeps)
            parallel = (ColumnParallelLinear, RowParallelLinear)
            for name, module in model.named_modules():
                if isinstance(module, parallel) and check_target_module_exists(config, name):
                    check_lora_target(module, name)
        return original(self, model, adapter_name, *args, **kwargs)

    lora_model.inject_adapter = inject_adapter


def _install_save() -> None:
    """`PeftModel.save_pretrained` of a tensor-parallel model writes whole adapter tensors, from rank 0 (call it on
    every rank: the shards are gathered over tp); other models save exactly as before."""
    from peft import PeftModel

    original = PeftModel.save_pretrained

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        layers = [m for m in self.modules() if is_parallel_lora(m)]
        if not layers or "state_dict" in kwargs:
            return original(self, save_directory, *args, is_main_process=is_main_process, **kwargs)
        groups = {id(p): layer.base_layer.group for layer in layers for p in layer.parameters(recurse=True)}
        state = self.state_dict()
        for name, param in self.named_parameters():
            if id(param) in groups and name in state:
                state[name] = gather_full(param, getattr(param, "shard_layout", None), groups[id(param)])
        main = is_main_process and (not dist.is_initialized() or ranks.global_rank() == 0)
        result = original(self, save_directory, *args, is_main_process=main, state_dict=state, **kwargs)
        if dist.is_initialized():
            dist.barrier()
        return result

    PeftModel.save_pretrained = save_pretrained
