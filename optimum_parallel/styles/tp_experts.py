"""Tensor-parallel mixture-of-experts: every expert's intermediate dim split over tp (3D expert tensors)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..tensor_parallel.expert_intermediate import bias_of, expert_specs, shard_experts
from .base import ParallelStyle


class TensorParallelExperts(ParallelStyle):
    """Split every expert's intermediate dim over tp (3D expert tensors, transformers 5 layout).

    packed: tensors packing gate|up (split each half on its own, or whole interleaved (gate, up) pairs); row: tensors
    whose input is the intermediate dim; transposed: the tensors are [E, in, out] (None: the module's
    `is_transposed`). Their biases (`<name>_bias`, gpt_oss) follow: a packed tensor's is split like its output
    features, a row tensor's stays whole and is added once. The experts module becomes one tp region; the router
    stays replicated.
    """

    swaps_module = True

    def __init__(
        self,
        packed: Sequence[str] = ("gate_up_proj",),
        row: Sequence[str] = ("down_proj",),
        transposed: bool | None = None,
    ) -> None:
        self.packed, self.row, self.transposed = tuple(packed), tuple(row), transposed

    def _transposed(self, module) -> bool:
        """Whether the tensors are laid out [E, in, out] (Llama 4's): as given, else the module's `is_transposed`."""
        return bool(getattr(module, "is_transposed", False)) if self.transposed is None else self.transposed

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        for param_name in self.packed + self.row:
            param = getattr(module, param_name, None)
            if not isinstance(param, nn.Parameter) or param.dim() != 3:
                raise ValueError(
                    f"TensorParallelExperts on {name!r}: {param_name!r} is not a 3D expert tensor "
                    f"(packed={self.packed}, row={self.row})"
                )
        if getattr(module, "has_bias", False):
            missing = [p for p in self.packed + self.row if bias_of(module, p) is None]
            if missing:
                raise ValueError(
                    f"TensorParallelExperts on {name!r}: has_bias is set but {missing} have no '<name>_bias' "
                    "parameter; allowed: expert biases named after their tensors (gate_up_proj_bias, down_proj_bias)"
                )
        for param_name in self.packed + self.row:
            bias = bias_of(module, param_name)
            expected = self._bias_shape(module, param_name, self._transposed(module))
            if bias is not None and tuple(getattr(module, bias).shape) != expected:
                raise ValueError(
                    f"{name}.{bias}: shape {tuple(getattr(module, bias).shape)} is not the [experts, output features] "
                    f"{expected} of {param_name!r}"
                )
        for param_name in self.packed:
            param = getattr(module, param_name)
            dim = param.dim() - 1 if self._transposed(module) else param.dim() - 2
            if param.shape[dim] % 2:
                raise ValueError(f"{name}.{param_name}: packed gate|up dim of size {param.shape[dim]} is odd")
            pairs, tp = param.shape[dim] // 2, ctx.mesh.tp_size
            if not getattr(module, "is_concatenated", True) and pairs % tp:
                raise ValueError(
                    f"{name}.{param_name}: {pairs} interleaved gate/up pairs cannot be split over tensor-parallel "
                    f"size {tp}; tp must divide {pairs}"
                )

    @staticmethod
    def _bias_shape(module, param_name: str, transposed: bool) -> tuple[int, ...]:
        """[experts, output features] of expert tensor `param_name` (its last dim when transposed)."""
        shape = getattr(module, param_name).shape
        return (shape[0], shape[-1] if transposed else shape[-2])

    def param_specs(self, module):
        return expert_specs(module, self.packed, self.row, self._transposed(module))

    def apply(self, module, name, ctx):
        rank, world = ctx.tp_rank_world
        layouts = {leaf: spec.local(rank, world) for leaf, spec in self.param_specs(module).items()}
        add_once = [bias for bias in (bias_of(module, p) for p in self.row) if bias is not None]
        shard_experts(module, layouts, ctx.mesh.tp_group, add_once, ctx.entry)
        if self.row and hasattr(module, "intermediate_dim"):
            row = layouts[self.row[0]]
            module.intermediate_dim = row.local_shape[row.dim]
        return module


class IdentityExpertParallel(ParallelStyle):
    """An identity ("zero") expert inside a tensor-parallel experts module (LongCat-Flash's `identity_expert`): every
    tp rank passes its tokens through whole, and the experts region sums the ranks' outputs, so each rank passes
    1/tp of them (the region's backward sums the 1/tp gradients back)."""

    def apply(self, module, name, ctx):
        world = ctx.mesh.tp_size

        def scale(module, args):
            return (args[0] / world, *args[1:])

        module.register_forward_pre_hook(scale)
        return module
