"""What a caller of a tensor-parallel Hugging Face model sees: full-vocabulary logits, by default outside a training
step (`install_full_logits`; `logits_mode` picks "auto", "full" or "local"), and a `generate` whose tp ranks never
diverge (`install_generation_sync`, `sync_generation`). `install_sequence_region` runs a forward that keeps only the
last logits (generate) on the plain tensor-parallel path under sequence parallelism. Design notes:
docs/module_notes.md.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..comm.tp_entry import SequenceRegion
from ..mesh import device as devices
from ..mesh import ranks
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.random import share_rng_states

LOGITS_MODES = ("auto", "full", "local")


def _vocab_parallel_heads(model: nn.Module) -> list[ColumnParallelLinear]:
    return [m for m in model.modules() if isinstance(m, ColumnParallelLinear) and hasattr(m, "logits_mode")]


class logits_mode:  # noqa: N801 - used like torch.set_grad_enabled: a call, or a context manager
    """Set how a model with a vocab-parallel LM head returns its logits: "auto" (full unless the forward computed
    the loss with gradients enabled), "full" or "local" (this rank's vocabulary slice).

    `logits_mode(model, "local")` sets it; `with logits_mode(model, "local"): ...` sets it for the block.
    Works on the model or any wrapper of it (DDP, FSDP2).
    """

    def __init__(self, model: nn.Module, mode: str) -> None:
        if mode not in LOGITS_MODES:
            raise ValueError(f"logits_mode {mode!r} is not known; allowed: {', '.join(LOGITS_MODES)}")
        heads = _vocab_parallel_heads(model)
        if not heads:
            raise ValueError(f"{type(model).__name__} has no vocab-parallel LM head: its logits are already full")
        self._previous = [(head, head.logits_mode) for head in heads]
        for head in heads:
            head.logits_mode = mode

    def __enter__(self) -> logits_mode:
        return self

    def __exit__(self, *exc) -> None:
        for head, mode in self._previous:
            head.logits_mode = mode


def _logits_position(output) -> tuple[object, int | str | None, bool]:
    """(container, key of the logits in it, whether a loss was computed) for a ModelOutput or a tuple."""
    if isinstance(output, Mapping):
        return output, ("logits" if torch.is_tensor(output.get("logits")) else None), output.get("loss") is not None
    if isinstance(output, tuple) and output and torch.is_tensor(output[0]):
        has_loss = output[0].dim() == 0  # return_dict=False: (loss, logits, ...) or (logits, ...)
        index = 1 if has_loss else 0
        return output, (index if len(output) > index and torch.is_tensor(output[index]) else None), has_loss
    return output, None, False


def _full_logits_hook(model: nn.Module, args, kwargs, output):
    """Gather the vocab-parallel logits at the model's output unless the mode keeps them local."""
    head = model.get_output_embeddings()
    mode = getattr(head, "logits_mode", "local")
    if mode == "local":
        return output
    container, key, has_loss = _logits_position(output)
    if key is None or (mode == "auto" and has_loss and torch.is_grad_enabled()):
        return output
    logits = container[key]
    if logits.shape[-1] != head.weight.shape[0]:  # already whole (a head that gathers its output itself)
        return output
    if isinstance(container, Mapping):
        container[key] = head.gather(logits)
        return container
    return (*container[:key], head.gather(logits), *container[key + 1 :])


def install_full_logits(model: nn.Module) -> None:
    """A vocab-parallel LM head (column-parallel, output not gathered) gets mode "auto" and the output gather."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if not isinstance(head, ColumnParallelLinear) or head.gather_output:
        return
    head.logits_mode = "auto"
    model.register_forward_hook(_full_logits_hook, with_kwargs=True)


# ---------------------------------------------------------------------------------------------- sequence parallel


def _keeps_last_logits(kwargs: Mapping) -> bool:
    keep = kwargs.get("logits_to_keep", 0)
    return torch.is_tensor(keep) or (isinstance(keep, int) and keep != 0)


def install_sequence_region(model: nn.Module, region: SequenceRegion) -> None:
    """On a sequence-parallel model, a forward keeping only the last logits (generate) runs the plain
    tensor-parallel path: the LM head would otherwise see sequence slices."""
    kept: list[bool] = []  # one entry per running forward (they nest)

    def before(module, args, kwargs):
        keep = _keeps_last_logits(kwargs)
        if keep:
            region.keep_whole()
        kept.append(keep)

    def after(module, args, kwargs, output):
        if kept and kept.pop():
            region.release()
        return output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)


# ---------------------------------------------------------------------------------------------- generation


def _tp_group(model: nn.Module):
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            return module.group
    return None


def _input_fingerprint(args: tuple, kwargs: Mapping) -> torch.Tensor:
    """A few numbers that differ when two ranks hold different prompts (shape, sums)."""
    found = [kwargs.get(k) for k in ("inputs", "input_ids", "inputs_embeds", "input_features")] + list(args[:1])
    tensor = next((t for t in found if torch.is_tensor(t)), None)
    if tensor is None:
        return torch.zeros(6, dtype=torch.float64)
    flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    return torch.tensor(
        [tensor.dim(), flat.numel(), tensor.shape[0], tensor.shape[-1], flat.sum(), (flat * weights).sum()],
        dtype=torch.float64,
    )


def sync_generation(group: dist.ProcessGroup, args: tuple = (), kwargs: Mapping | None = None) -> None:
    """Before generating: every tp rank must hold the same prompts; all take tp rank 0's generator state."""
    world = ranks.world_size(group)
    if world == 1:
        return
    device = devices.collective_device(group)
    mine = _input_fingerprint(args, kwargs or {}).to(device)
    prints = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(prints, mine, group=group)
    differing = [r for r, p in enumerate(prints) if not torch.equal(p, prints[0])]
    if differing:
        raise ValueError(
            f"generate on a tensor-parallel model: tp ranks {differing} hold other prompts than tp rank 0; every "
            "rank of a tp group must call generate with the same inputs (shard the data over dp, not tp)"
        )
    share_rng_states(group)


def _generate_on_tp(self: nn.Module, *args, **kwargs):
    """transformers' `generate`, after the tp ranks agreed on their inputs and random state."""
    group = _tp_group(self)
    if group is not None:
        sync_generation(group, args, kwargs)
    return type(self).generate(self, *args, **kwargs)


def install_generation_sync(model: nn.Module) -> None:
    """Models that generate get the tp-synchronised `generate` (an instance attribute over the class's)."""
    if callable(getattr(type(model), "generate", None)) and _tp_group(model) is not None:
        model.generate = types.MethodType(_generate_on_tp, model)
