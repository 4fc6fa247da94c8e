"""Every check of a parallelization request, in one place, and `validate`, the one entry that runs them around
`resolve`: `check_settings` (neither model nor mesh; the Trainer's arguments run it when they are made),
`check_on_mesh`, a family's part (`check_capabilities` among it), `resolve`, then `check` on what it decided. Each
error names the caller's key (`request.keys`) and the allowed values, on every rank, before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..autoplan.capabilities import Capabilities
from ..context_parallel import check_context_parallel, check_strategy
from ..data_parallel.levels import DataParallelConfig
from ..data_parallel.shared_batch import SHARED_BATCH
from ..expert_parallel import check_expert_parallel
from ..mesh import MeshLayout, ParallelMesh, check_expert_parallel_size, check_positive_int
from ..mesh import device as devices
from ..mixers import check_heads_split
from ..packing import PACKING_KEYS
from ..pipeline import SCHEDULES, check_pipeline, check_schedule
from ..pipeline.split import SplitPoint
from ..state import find_state
from ..styles import ExpertParallel, optional
from .compile import check_compile_config, compile_config
from .request import ParallelRequest, PipelineSettings, RequestKeys, ResolvedRequest
from .resolve import resolve

SHARDING_LEVELS = (0, 1, 2, 3)
XLA_SHARDING_LEVELS = (0,)
_XLA_REFUSED = {  # why the other levels do not run on XLA devices
    1: "torch's ZeroRedundancyOptimizer gives each rank its share of the optimizer state by torch.distributed's "
    "rank, which is 0 on every device one process drives, and broadcasts each share from its owner",
    2: "FSDP2 needs a torch DeviceMesh, which the XLA mesh does not build",
    3: "FSDP2 needs a torch DeviceMesh, which the XLA mesh does not build",
}
PIPELINE_INPUTS = ("input_ids", "attention_mask", "labels", *PACKING_KEYS)
FamilyPart = Callable[[ParallelRequest, nn.Module, ParallelMesh], ParallelRequest]


def validate(
    request: ParallelRequest, model: nn.Module, mesh: ParallelMesh, family_part: FamilyPart | None = None
) -> ResolvedRequest:
    """Raise if any step of `compose` would refuse `request` on `model` over `mesh`; change nothing. In the order a
    caller meets the errors: the settings, the mesh and config sections, then `family_part` (a family entry point's:
    `request` with the family's plan, capabilities and fix-up decided, `frontends/family_request.py`), then what
    `resolve` decides, checked. Returns that `ResolvedRequest`: what `compose` takes."""
    check_settings(request)
    check_on_mesh(request, mesh)
    if family_part is not None:
        request = family_part(request, model, mesh)
    resolved = resolve(request, model, mesh)
    check(resolved, model, mesh)
    return resolved


def check(resolved: ResolvedRequest, model: nn.Module, mesh: ParallelMesh) -> None:
    """Raise if a step of `compose` would refuse what `resolve` decided for `model` over `mesh`; change nothing: the
    pipeline split, context parallelism, data parallelism over its optimizer, expert parallelism."""
    request, keys, pipeline = resolved.request, resolved.request.keys, resolved.pipeline
    if pipeline is not None:
        pp = mesh.size("pp")
        if pipeline.global_spec is not None:
            _check_global_spec(model, pipeline.global_spec, keys.global_spec)
        check_pipeline(
            model,
            pp,
            pipeline.split_spec,
            pipeline.num_microbatches,
            pipeline.schedule,
            schedule_key=keys.schedule,
            microbatches_key=keys.num_microbatches,
        )
        check_router_logits(model, pp)
    state = find_state(model)  # a read that records nothing: checking changes nothing
    cp, capabilities = mesh.size("cp"), resolved.capabilities
    if cp > 1 and (state is None or state.context_parallel is None):
        tp = mesh.size("tp") if request.plan else 1  # q/k/v are split over tp by the plan: all_to_all sees local heads
        check_context_parallel(
            model,
            cp,
            request.context_parallel,
            tp,
            keys.context_parallel,
            supported=capabilities.context_parallel,
            why=capabilities.reason("context"),
        )
        for mixer in resolved.mixers:  # a mixer's heads split over tp x cp: whole heads on every rank
            check_heads_split(mixer, tp, cp)
    data_parallel = resolved.data_parallel
    if data_parallel is not None:
        check_data_parallel(data_parallel, request.optimizer, keys, mesh.data_parallel_size, mesh.device_type)
    ep = mesh.size("ep")
    if ep > 1 and (state is None or state.expert_parallel is None):
        module_styles = resolved.module_styles or {}
        declared = [n for n, styles in module_styles.items() if any(isinstance(s, ExpertParallel) for s in styles)]
        check_expert_parallel(model, ep, declared=declared)
        if data_parallel is not None:
            check_expert_data_parallel(data_parallel.shard_size, ep, keys.shard_size)


# ---------------------------------------------------------------------------------------------- without model or mesh


def check_settings(request: ParallelRequest) -> None:
    """The checks that need neither model nor mesh: types, names and ranges of every setting."""
    keys = request.keys
    for dim, size in request.mesh_sizes.items():
        check_positive_int(keys.sizes.get(dim, dim), size)
    if request.plan is not None and not isinstance(request.plan, Mapping):
        raise TypeError(f"{keys.plan} must be a dict of name regex -> style, got {type(request.plan).__name__}")
    if request.sequence_parallel not in (True, False):
        raise ValueError(f"{keys.sequence_parallel}={request.sequence_parallel!r} is not allowed; allowed: True, False")
    check_strategy(request.context_parallel, keys.context_parallel)
    if request.shared_batch not in SHARED_BATCH:
        raise ValueError(
            f"{keys.shared_batch}={request.shared_batch!r} is not allowed; allowed: {', '.join(SHARED_BATCH)}"
        )
    if request.pipeline is not None:
        _check_pipeline_settings(request.pipeline, keys)
        microbatches, pp = request.pipeline.num_microbatches, request.mesh_sizes.get("pp")
        if pp == 1 and microbatches not in (None, 1):
            raise ValueError(
                f"{keys.num_microbatches}={microbatches} needs {keys.sizes['pp']} > 1; allowed with "
                f"{keys.sizes['pp']}=1: 1"
            )
        for name, size in request.batch_sizes.items():
            if isinstance(microbatches, int) and microbatches > 1 and size % microbatches:
                raise ValueError(
                    f"{name}={size} is not allowed: it must be a multiple of {keys.num_microbatches}={microbatches}"
                )
        if request.gradient_accumulation_steps != 1 and request.mesh_sizes.get("pp", 1) != 1:
            # the pipeline accumulates over its micro-batches: accumulation outside it would scale wrongly
            raise ValueError(
                f"gradient_accumulation_steps={request.gradient_accumulation_steps} is not allowed with "
                f"{keys.sizes['pp']} > 1; allowed: 1 (raise {keys.num_microbatches} instead)"
            )
        if isinstance(pp, int) and pp > 1 and isinstance(microbatches, int) and microbatches < pp:
            raise ValueError(
                f"{keys.num_microbatches}={microbatches} is not allowed; it must be >= {keys.sizes['pp']}={pp}"
            )
    if request.data_parallel is not None:
        check_data_parallel_config(request.data_parallel, keys)
    _check_compile(request.compile, keys.compile, request.device)
    if request.async_save and request.push_to_hub:
        raise ValueError("async_save=True with push_to_hub=True is not supported; allowed there: async_save=False")
    if request.async_save and devices.is_graph_device(request.device):
        raise ValueError(
            "async_save=True on an XLA device (its process groups have no gloo) is not supported; allowed there: "
            "async_save=False"
        )


def _check_compile(value: object, key: str, device: object) -> None:
    """The caller's `compile` value is one `compile_config` reads, its backend and mode are known to torch, and the
    device is not an XLA one. `resolve` makes the CompileConfig the steps apply."""
    compiled = compile_config(value, key)
    if compiled is None:
        return
    check_compile_config(compiled, key)
    if devices.is_graph_device(device):
        raise ValueError(
            f"{key} on an XLA device is not supported (torch-xla traces the whole step into its own graph); allowed "
            f"there: {key}=False"
        )


def _check_pipeline_settings(pipeline: PipelineSettings, keys: RequestKeys) -> None:
    spec = pipeline.split_spec
    if isinstance(spec, Mapping):
        for name, point in spec.items():
            if not isinstance(point, SplitPoint):
                raise ValueError(
                    f"{keys.split_spec}[{name!r}] = {point!r}; allowed: SplitPoint.BEGINNING, SplitPoint.END"
                )
    elif spec is not None and not isinstance(spec, str):
        raise TypeError(f"{keys.split_spec} must be a str or a dict, got {type(spec).__name__}")
    if pipeline.global_spec is not None and not isinstance(pipeline.global_spec, str):
        raise TypeError(f"{keys.global_spec} must be a str, got {type(pipeline.global_spec).__name__}")
    check_schedule(pipeline.schedule, keys.schedule)
    count = pipeline.num_microbatches
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
        raise TypeError(f"{keys.num_microbatches} must be an int, got {count!r}")
    if isinstance(count, int) and count < 1:
        check_positive_int(keys.num_microbatches, count)
    unknown = [name for name in pipeline.input_names or () if name not in PIPELINE_INPUTS]
    if unknown:
        raise ValueError(f"{keys.input_names} {unknown} not supported; allowed: {', '.join(PIPELINE_INPUTS)}")


def check_sharding_level(level: object, key: str) -> None:
    """`level` is one of `SHARDING_LEVELS`; the error names `key` (the caller's name for it) and the allowed ones."""
    if isinstance(level, bool) or level not in SHARDING_LEVELS:
        raise ValueError(f"{key}={level!r} is not allowed; allowed: {', '.join(map(str, SHARDING_LEVELS))}")


def check_data_parallel_config(config: DataParallelConfig, keys: RequestKeys) -> None:
    """The level, shard_size, threshold and reduce_dtype of a data-parallel request, each error naming its key."""
    if not isinstance(config, DataParallelConfig):
        raise TypeError(f"data parallelism needs a DataParallelConfig, got {type(config).__name__}")
    check_sharding_level(config.sharding_level, keys.sharding_level)
    size = config.shard_size
    if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
        raise ValueError(
            f"{keys.shard_size}={size!r} is not allowed; allowed: -1 (all dp x cp ranks) or a positive integer "
            "dividing dp x cp"
        )
    if size != -1 and config.sharding_level == 0:
        raise ValueError(
            f"{keys.shard_size}={size} needs sharding; allowed with sharding_level 0: -1 "
            f"(or set {keys.sharding_level} to 1, 2 or 3)"
        )
    kb = config.threshold
    if isinstance(kb, bool) or not isinstance(kb, (int, float)) or not kb >= 0 or kb == float("inf"):
        raise ValueError(f"{keys.threshold}={kb!r} is not allowed; allowed: a number of KB >= 0")
    if config.reduce_dtype is not None and not isinstance(config.reduce_dtype, torch.dtype):
        raise ValueError(f"{keys.reduce_dtype}={config.reduce_dtype!r} is not a torch.dtype")


# ---------------------------------------------------------------------------------------------- against the mesh


def check_on_mesh(request: ParallelRequest, mesh: ParallelMesh) -> None:
    """What the mesh must be for `request`: a ParallelMesh, with a dim to act on for every config section named, and
    pp > 1 for a micro-batch count other than 1."""
    if not isinstance(mesh, ParallelMesh):
        raise TypeError(f"mesh must be a ParallelMesh (from optimum_parallel.init_mesh), got {type(mesh).__name__}")
    _check_sections_act(request, mesh)
    pipeline, keys = request.pipeline, request.keys
    if pipeline is not None and mesh.size("pp") == 1 and pipeline.num_microbatches not in (None, 1):
        raise ValueError(
            f"{keys.num_microbatches}={pipeline.num_microbatches} needs a mesh with pp > 1; allowed with pp=1: 1"
        )


def check_capabilities(request: ParallelRequest, capabilities: Capabilities, pp: int, owner: str) -> None:
    """sequence parallelism and pp > 1 only where the model supports them (`owner`: who declared `capabilities`, the
    family an entry point chose, named when the structure gave no reason)."""
    keys = request.keys
    if request.sequence_parallel and not capabilities.sequence_parallel:
        why = capabilities.reason("sequence") or f"{owner} does not support sequence parallelism"
        raise NotImplementedError(
            f"{keys.sequence_parallel}=True is not supported: {why}; allowed for this model: False"
        )
    if request.pipeline is not None and pp > 1 and not capabilities.pipeline_parallel:
        why = capabilities.reason("pipeline") or f"{owner} does not support pipeline parallelism"
        raise NotImplementedError(
            f"pipeline parallelism (pp={pp}) is not supported: {why}; allowed for this model: pp=1"
        )


def mesh_layout(request: ParallelRequest, world: int) -> MeshLayout:
    """The dp x pp x cp x tp (and ep) layout a request's mesh sizes ask for over `world` ranks (dp takes what the
    others leave), checked: the sizes divide the world, ep divides dp x cp, a shard_size divides dp x cp."""
    keys, asked = request.keys, request.mesh_sizes
    tp, pp, cp, ep = (asked.get(dim, 1) for dim in ("tp", "pp", "cp", "ep"))
    for dim, size in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        check_positive_int(keys.sizes[dim], size)
    if world % (tp * pp * cp):
        raise ValueError(
            f"{keys.sizes['tp']}={tp} x {keys.sizes['pp']}={pp} x {keys.sizes['cp']}={cp} does not divide the world "
            f"size {world}; allowed: sizes whose product divides the number of processes"
        )
    dp = world // (tp * pp * cp)
    check_expert_parallel_size(ep, dp * cp, keys.sizes["ep"], f"dp x cp = {dp} x {cp}")
    config = request.data_parallel
    if config is not None and dp * cp > 1:
        check_shard_size(config.shard_size, dp * cp, keys.shard_size)
    return MeshLayout({"dp": dp, "pp": pp, "cp": cp, "tp": tp}, ep)


def check_data_parallel(
    config: DataParallelConfig,
    optimizer: torch.optim.Optimizer | None,
    keys: RequestKeys,
    data_parallel_size: int,
    device_type: str,
) -> None:
    """What data parallelism needs of its request on this mesh: the level (on XLA devices with dp x cp > 1 level 0
    only), a shard_size dividing the dp x cp ranks, and for ZeRO-1 an optimizer with no state yet (its state cannot
    be re-partitioned)."""
    check_data_parallel_config(config, keys)
    level, key = config.sharding_level, keys.sharding_level
    if devices.is_graph_device(device_type) and data_parallel_size > 1 and level not in XLA_SHARDING_LEVELS:
        allowed = ", ".join(map(str, XLA_SHARDING_LEVELS))
        raise ValueError(
            f"{key}={level} is not supported on XLA devices ({_XLA_REFUSED[level]}); allowed on XLA: {allowed} "
            "(parameters and optimizer state replicated, gradients averaged over the dp ranks)"
        )
    check_shard_size(config.shard_size, data_parallel_size, keys.shard_size)
    if level == 1 and optimizer is not None and getattr(optimizer, "state", None):
        raise ValueError(
            f"{key}=1 (ZeRO-1) needs a fresh optimizer: this one already holds state, which cannot be re-partitioned "
            "here; allowed: an optimizer that has not stepped yet, or sharding_level 0, 2, 3"
        )


def check_shard_size(shard_size: int, data_parallel_size: int, key: str) -> None:
    """ValueError naming `key` and the allowed values unless `shard_size` is -1 or divides the dp x cp ranks."""
    if shard_size != -1 and data_parallel_size % shard_size:
        allowed = [-1] + [d for d in range(1, data_parallel_size + 1) if data_parallel_size % d == 0]
        raise ValueError(
            f"{key}={shard_size} does not divide the dp x cp ranks ({data_parallel_size}); "
            f"allowed: {', '.join(map(str, allowed))}"
        )


def check_expert_data_parallel(shard_size: int, ep: int, key: str) -> None:
    """ValueError naming `key` unless the request's data parallelism composes with ep (no hybrid sharding yet)."""
    if ep > 1 and shard_size != -1:
        raise ValueError(
            f"{key}={shard_size} (hybrid sharding) with ep={ep} is not supported yet; allowed with ep > 1: -1"
        )


def check_router_logits(model: nn.Module, pp: int) -> None:
    """Under pp the stages pass hidden states only and the loss is the language-model one: a router aux loss
    (`output_router_logits=True`) would be dropped without a word, so it is refused."""
    config = getattr(model, "config", None)
    if pp > 1 and getattr(config, "output_router_logits", False):
        raise ValueError(
            f"output_router_logits=True with pp={pp} is not supported (the pipeline's loss has no router aux loss: "
            "the stages pass hidden states only); allowed with pp > 1: output_router_logits=False"
        )


def _check_sections_act(request: ParallelRequest, mesh: ParallelMesh) -> None:
    """Each config section a caller named needs a mesh dim to act on (`parallelize(...)`'s): dp_config dp x cp > 1,
    mp_config tp > 1 (or ep > 1 for a plan of ExpertParallel styles only), pp_config pp > 1."""
    declares_only = "mp_config" in request.sections and _only_expert_declarations(request.plan)
    needs = {
        "mp_config": (
            "tp > 1 (or ep > 1 for a plan of ExpertParallel styles only)",
            mesh.size("tp") if not declares_only else max(mesh.size("tp"), mesh.size("ep")),
        ),
        "dp_config": ("dp x cp > 1", mesh.data_parallel_size),
        "pp_config": ("pp > 1", mesh.size("pp")),
    }
    for key in request.sections:
        dims, size = needs[key]
        if size == 1:
            sizes = ", ".join(f"{d}={s}" for d, s in mesh.sizes.items())
            raise ValueError(f"{key} needs a mesh with {dims}; the mesh has {sizes}")


def _only_expert_declarations(plan: Mapping | None) -> bool:
    """Whether every style of `plan` is `ExpertParallel` (it splits nothing over tp: it declares experts for ep)."""
    if not isinstance(plan, Mapping) or not plan:
        return False
    values = [value.styles if isinstance(value, optional) else value for value in plan.values()]
    styles = [style for value in values for style in (value if isinstance(value, (list, tuple)) else [value])]
    return all(isinstance(style, ExpertParallel) for style in styles)


def _check_global_spec(model: nn.Module, global_spec: str, key: str) -> None:
    """Every stage recomputes the module `global_spec` names (the decoder's rotary embedding): it must exist."""
    if global_spec not in dict(model.named_modules()):
        raise ValueError(
            f"{key} = {global_spec!r} names no module of {type(model).__name__}; allowed: a module name such as "
            "'model.rotary_emb'"
        )


__all__ = [
    "SCHEDULES",
    "SHARDING_LEVELS",
    "FamilyPart",
    "check",
    "check_capabilities",
    "check_data_parallel",
    "check_on_mesh",
    "check_settings",
    "mesh_layout",
    "validate",
]
