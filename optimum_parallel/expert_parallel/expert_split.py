"""Expert parallelism: the experts of every MoE block split along the expert dim over the mesh's expert group.

`apply_expert_parallel` keeps `num_experts / ep` consecutive experts on each rank and gives the experts module a
forward that sends each routed row to the rank holding its expert and back (no row dropped: the single-device output);
`check_expert_parallel` raises unless a model's experts can be split over ep ranks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.compiled import all_to_all
from ..state import parallel_state
from ..tensor_parallel.spec import ShardLayout, ShardSpec, local_parameter
from .dispatch import all_to_all_rows, exchange_counts

_EXPERT_WEIGHTS = (("gate_up_proj", "down_proj"), ("up_proj", "down_proj"))


@dataclass(frozen=True)
class ExpertsDeclaration:
    """A custom experts module, declared by the `ExpertParallel` plan style: its tensors holding the experts along
    dim 0, and the attribute counting them (None: it has none)."""

    tensors: tuple[str, ...]
    num_experts: str | None = None


def declare_experts(module: nn.Module, declaration: ExpertsDeclaration) -> None:
    """Mark `module` as a stacked-experts module laid out as `declaration` says."""
    module.experts_declaration = declaration


def is_experts_module(module: nn.Module) -> bool:
    """A stacked-experts module: declared (`ExpertParallel`), or transformers' layout: an int `num_experts` and 3D
    expert tensors [num_experts, ...]."""
    if isinstance(getattr(module, "experts_declaration", None), ExpertsDeclaration):
        return True
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool):
        return False
    params = module._parameters
    return any(
        all(isinstance(params.get(n), nn.Parameter) and params[n].dim() == 3 for n in names)
        and all(params[n].shape[0] == count for n in names)
        for names in _EXPERT_WEIGHTS
    )


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every stacked-experts module of `model`, in model order."""
    return [(name, module) for name, module in model.named_modules() if is_experts_module(module)]


def expert_tensors(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(leaf, parameter) of the tensors of a stacked-experts module that hold one slice per expert along dim 0
    (gate_up_proj / down_proj and their biases, or the declared ones): what ep splits, and what a checkpoint marks
    as expert tensors."""
    declaration = getattr(module, "experts_declaration", None)
    if isinstance(declaration, ExpertsDeclaration):
        return [(n, getattr(module, n)) for n in declaration.tensors]
    count = module.num_experts
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() > 0 and p.shape[0] == count]


def expert_range(param: torch.Tensor) -> tuple[int, int] | None:
    """[start, end) of the experts an expert-parallel parameter holds (dim 0 of the global one), None otherwise."""
    layout = getattr(param, "expert_layout", None)
    return None if layout is None else layout.ranges[0]


def check_expert_parallel(model: nn.Module, ep: int, key: str = "ep", declared: Collection[str] = ()) -> None:
    """Raise ValueError (naming `key` and the allowed values) unless `model`'s experts can be split over ep ranks;
    `declared`: names of modules a plan's `ExpertParallel` style declares (checked by the style itself)."""
    experts = [(name, module) for name, module in find_experts(model) if name not in declared]
    if not experts and not declared:
        unlike = _unlike_experts(model)
        if unlike:
            raise ValueError(
                f"{key}={ep}: the experts module {unlike} is not laid out as transformers' stacked experts (an int "
                "num_experts and gate_up_proj or up_proj / down_proj holding that many experts along dim 0), so "
                "ep cannot split it; allowed for this model: ep=1"
            )
        raise ValueError(
            f"{key}={ep}: {type(model).__name__} has no stacked experts module (num_experts and 3D gate_up_proj or "
            "up_proj / down_proj, or a module declared by the ExpertParallel style in mp_config's "
            "parallelize_plan), so there is nothing to split over ep; allowed for this model: ep=1"
        )
    for name, module in experts:
        check_routed_forward(module, name, key, ep)
        check_experts_divide(expert_count(module), ep, name, key)


def _unlike_experts(model: nn.Module) -> str:
    """'name (Class): its expert tensors' shapes' of the first module holding 3D expert-named tensors that
    `is_experts_module` does not recognise (LongCat-Flash's gate_up_proj holds its identity experts' slices too)."""
    names = {n for pair in _EXPERT_WEIGHTS for n in pair}
    for name, module in model.named_modules():
        tensors = {n: tuple(p.shape) for n, p in module._parameters.items() if n in names and p is not None}
        if tensors and all(len(shape) == 3 for shape in tensors.values()):
            count = getattr(module, "num_experts", None)
            return f"{name!r} ({type(module).__name__}: {tensors}, num_experts={count!r})"
    return ""


def _positional(cls: type) -> list[inspect.Parameter] | None:
    """The positional parameters of the class's forward after self (None: no signature to read)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]


def takes_expert_major_rows(module: nn.Module | type) -> bool:
    """Llama 4's experts contract: `forward(hidden_states)` on every token for every expert, expert-major
    ([experts x tokens, hidden], each row already scaled by its router score), summed by the caller. The only
    stacked-experts module of transformers 5 whose forward takes the rows alone."""
    positional = _positional(type(module) if isinstance(module, nn.Module) else module)
    return (
        positional is not None and len(positional) == 1 and positional[0].kind is not inspect.Parameter.VAR_POSITIONAL
    )


def check_routed_forward(module: nn.Module, name: str, key: str = "ep", ep: int | None = None) -> None:
    """Raise ValueError unless the experts module's forward takes transformers' routed contract
    `(hidden_states, top_k_index, top_k_weights)` (ep calls it on the rows dispatched to this rank) or, for a module
    found by its shape (`ep` given), Llama 4's expert-major rows (`takes_expert_major_rows`)."""
    positional = _positional(type(module))
    if positional is None:  # no signature to read: trust the contract
        return
    if ep is not None and takes_expert_major_rows(module):
        return
    if len(positional) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in positional):
        request = f"{key}={ep}: " if ep is not None else ""
        raise ValueError(
            f"{request}the experts module {name!r} ({type(module).__name__}) cannot be split over ep: its forward "
            f"takes {[p.name for p in positional]}, not transformers' routed contract (hidden_states, "
            "top_k_index, top_k_weights) that ep dispatches rows to; allowed for this model: ep=1"
        )


def check_experts_divide(count: int, ep: int, name: str, key: str = "ep") -> None:
    """Raise ValueError (naming `key` and the allowed sizes) unless ep divides the `count` experts of module `name`."""
    if count % ep:
        allowed = [d for d in range(1, count + 1) if count % d == 0]
        raise ValueError(
            f"{key}={ep} does not divide the {count} experts of {name!r}; allowed: divisors of {count} that "
            f"divide dp x cp ({', '.join(map(str, allowed))})"
        )


@dataclass
class ExpertParallelRuntime:
    """What every split experts module of one model shares: the groups, and the work queued after each backward
    (data parallelism's expert-gradient reduction: `after_backward`)."""

    group: ProcessGroup
    ep: int
    rank: int
    gradients_reduced: bool = False
    after_backward: list[Callable[[], None]] = field(default_factory=list)
    _queued: bool = False

    def backward_started(self) -> None:
        """Called by the first dispatch backward of a backward pass: queue the after-backward work once."""
        if self._queued or not self.after_backward:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._run_after_backward)

    def _run_after_backward(self) -> None:
        self._queued = False
        for callback in self.after_backward:
            callback()


def apply_expert_parallel(model: nn.Module, group: ProcessGroup, ep: int, rank: int) -> dict[int, nn.Parameter]:
    """Split the experts of `model` over the `ep` ranks of `group` (this rank is `rank` of them), in place; returns
    {id(old parameter): new parameter}. Each new parameter carries its `expert_layout` (dim 0 of the global one)."""
    check_expert_parallel(model, ep)
    runtime = ExpertParallelRuntime(group, ep, rank)
    parallel_state(model).expert_parallel = runtime
    mapping: dict[int, nn.Parameter] = {}
    for _, module in find_experts(model):
        count = expert_count(module)
        for leaf, param in expert_tensors(module):
            layout = ShardSpec.split(tuple(param.shape), 0).local(rank, ep)
            new = local_parameter(param, layout, param.requires_grad)
            tensor_parallel = getattr(param, "shard_layout", None)
            if tensor_parallel is not None:
                new.shard_layout = tensor_parallel  # the tp cut (another dim) of the same experts
            else:
                del new.shard_layout
            new.expert_layout = layout
            setattr(module, leaf, new)
            mapping[id(param)] = new
        module.global_num_experts = count
        declaration = getattr(module, "experts_declaration", None)
        counter = declaration.num_experts if declaration is not None else "num_experts"
        if counter is not None:
            setattr(module, counter, count // ep)
        module.expert_parallel = runtime
        if hasattr(module, "_is_expert_parallel"):  # transformers' experts then skip the sentinel rows (`_traced`)
            module._is_expert_parallel = True
        module.ep_local_experts = count // ep
        module.__class__ = _expert_parallel_class(type(module))
    return mapping


def expert_count(module: nn.Module) -> int:
    """The number of experts a stacked-experts module holds (dim 0 of its expert tensors)."""
    return expert_tensors(module)[0][1].shape[0]


def expert_layout(param: torch.Tensor) -> ShardLayout | None:
    """The expert-dim cut of an expert-parallel parameter, None for any other."""
    return getattr(param, "expert_layout", None)


_EXPERT_PARALLEL_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    """`cls` with the forward below, made once per class: the forward is the class's, so a compiled block guards on
    the class, not on one object per module (one graph serves every block). `_local_forward` is `cls`'s own
    (transformers' experts implementation dispatch included)."""
    if cls in _EXPERT_PARALLEL_CLASSES.values():
        return cls
    if cls not in _EXPERT_PARALLEL_CLASSES:
        members = {"forward": _ExpertParallelForward.forward, "_traced": _ExpertParallelForward._traced}
        if takes_expert_major_rows(cls):
            members = {"forward": _ExpertParallelForward.expert_major}
        members.update(_local_forward=cls.forward, __module__=cls.__module__)
        _EXPERT_PARALLEL_CLASSES[cls] = type(cls.__name__, (cls,), members)
    return _EXPERT_PARALLEL_CLASSES[cls]


class _ExpertParallelForward:
    """The experts module's forward under ep (the methods of `_expert_parallel_class`; `self` is the module)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        module = self
        runtime: ExpertParallelRuntime = module.expert_parallel
        if torch.is_grad_enabled() and not runtime.gradients_reduced:
            raise RuntimeError(
                "an expert-parallel model (ep > 1) trains only with its gradients reduced over dp x cp (each rank's "
                "expert gradients hold other ranks' tokens): call op.parallelize(model, optimizer, mesh, "
                "{'dp_config': {'sharding_level': 0}}), or train with ParallelTrainer; for evaluation run under "
                "torch.no_grad()"
            )
        if torch.compiler.is_compiling():
            return self._traced(hidden_states, top_k_index, top_k_weights)
        ep, local = runtime.ep, module.ep_local_experts
        top_k = top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # (token, k) rows grouped by expert, so by destination rank
        token_of_row = order // top_k
        counts = torch.bincount(experts, minlength=ep * local).view(ep, local)
        received = exchange_counts(counts, runtime.group)  # [source rank, local expert]
        send_splits, recv_splits = counts.sum(1).tolist(), received.sum(1).tolist()
        rows = all_to_all_rows(hidden_states[token_of_row], send_splits, recv_splits, runtime.group)
        local_expert = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(received.reshape(-1))
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        out = module._local_forward(rows, local_expert[:, None], ones)
        if rows.shape[0] == 0:  # no row reached this rank: its experts still get (zero) gradients, as on the others
            out = out + sum(p.sum() for p in module.parameters(recurse=False)) * 0
        back = all_to_all_rows(out, recv_splits, send_splits, runtime.group, runtime.backward_started)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros_like(hidden_states)
        return combined.index_add(0, token_of_row, (back * weights).to(hidden_states.dtype))

    def expert_major(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Llama 4's contract (`takes_expert_major_rows`): the rows [experts x tokens, hidden], expert-major. Each rank
        sends every rank the rows of that rank's experts (all of its tokens: the router already scaled them, 0 for
        an expert not chosen), runs its local experts on every source's tokens at once and sends the outputs back;
        the caller sums them over the experts as on one device."""
        module = self
        runtime: ExpertParallelRuntime = module.expert_parallel
        if torch.is_grad_enabled() and not runtime.gradients_reduced:
            raise RuntimeError(
                "an expert-parallel model (ep > 1) trains only with its gradients reduced over dp x cp: call "
                "op.parallelize(model, optimizer, mesh, {'dp_config': {'sharding_level': 0}}), or train with "
                "ParallelTrainer; for evaluation run under torch.no_grad()"
            )
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"{type(module).__name__} under ep inside a compiled block: its expert-major exchange has per-rank "
                "token counts; allowed: compile=False with ep > 1 for this model"
            )
        ep, local = runtime.ep, module.ep_local_experts
        hidden = hidden_states.shape[-1]
        tokens = hidden_states.shape[0] // (ep * local)
        counts = torch.full((ep, 1), tokens, dtype=torch.long, device=hidden_states.device)
        sources = exchange_counts(counts, runtime.group).view(-1).tolist()  # tokens each rank sends
        send, recv = [local * tokens] * ep, [local * t for t in sources]
        rows = all_to_all_rows(hidden_states, send, recv, runtime.group)
        by_expert = torch.cat(
            [part.view(local, t, hidden) for part, t in zip(rows.split(recv), sources, strict=True)], dim=1
        )
        out = module._local_forward(by_expert.reshape(-1, hidden)).view(local, sum(sources), hidden)
        out = out + sum(p.sum() for p in module.parameters(recurse=False)) * 0  # every rank's experts get gradients
        back = torch.cat([part.reshape(-1, hidden) for part in out.split(sources, dim=1)])
        return all_to_all_rows(back, recv, send, runtime.group, runtime.backward_started)

    def _traced(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The same dispatch with the shapes a compiled graph needs fixed: every rank sends each rank a block of as many
        rows as it routes (all of them could go to one rank), its rows first, then padding marked with the sentinel
        expert `local` (transformers' experts skip it, as under its own expert parallelism) and weighted 0. Equal
        blocks make both exchanges `comm.compiled.all_to_all`s; no count leaves the graph."""
        module = self
        runtime: ExpertParallelRuntime = module.expert_parallel
        group = runtime.group.group_name
        ep, local = runtime.ep, module.ep_local_experts
        top_k = top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        rows = experts.shape[0]  # the block each rank gets from this one
        order = torch.argsort(experts, stable=True)
        token_of_row = order // top_k
        destination = experts[order] // local
        counts = torch.zeros(ep, dtype=torch.long, device=experts.device).index_add(
            0, destination, torch.ones_like(destination)
        )
        first = torch.cumsum(counts, 0) - counts
        slot = destination * rows + torch.arange(rows, device=experts.device) - first[destination]
        send = hidden_states.new_zeros(ep * rows, hidden_states.shape[-1])
        send = send.index_copy(0, slot, hidden_states[token_of_row])
        ids = torch.full((ep * rows,), local, dtype=experts.dtype, device=experts.device)
        ids = ids.index_copy(0, slot, experts[order] % local)
        received, received_ids = all_to_all(send, group), all_to_all(ids, group)
        weights = (received_ids < local).to(top_k_weights.dtype)[:, None]
        out = module._local_forward(received, received_ids[:, None], weights)
        back = all_to_all(out, group)[slot]
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros_like(hidden_states)
        return combined.index_add(0, token_of_row, (back * weights).to(hidden_states.dtype))
