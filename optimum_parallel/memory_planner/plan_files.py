"""Plan files: a resolved plan (every module's styles, every parameter's layout on every tp rank) as JSON.

`save_plan` writes one (also as a dry run on one process at a simulated tp size); `load_plan`, `check_plan_fits` and
`plan_file_parallelizer` read it back, checking that it fits the model and naming the first entry that does not. The
format is `"optimum-parallel-plan"`, version 2; version 1 files still load.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..frontends.manager import ParallelizersManager
from ..frontends.parallelizer import Parallelizer
from ..mesh import MeshLayout, ranks
from ..styles import ParallelStyle
from ..tensor_parallel.spec import ShardLayout, ShardSpec
from .simulate import ResolvedPlan, build_meta_model, resolve_for_tp
from .style_json import STYLES, register_style, style_from_dict, style_to_dict

__all__ = [  # the style <-> JSON half lives in style_json.py; its names still import from here
    "STYLES",
    "check_plan_fits",
    "load_plan",
    "plan_document",
    "plan_file_parallelizer",
    "read_plan_file",
    "register_style",
    "save_plan",
    "style_from_dict",
    "style_to_dict",
]

FORMAT, VERSION = "optimum-parallel-plan", 2
READS = (1, 2)  # version 1: see docs/module_notes.md
RANK_KEYS = ("ranges", "replicas")  # what a rank's `ShardLayout.to_json` adds to its spec's

# --------------------------------------------------------------------------------------------------------------
# Documents


def _check_split_alike(per_rank: list[ShardLayout | None], shape: tuple[int, ...], name: str) -> ShardLayout | None:
    """The first rank's layout when every rank's is split alike, None when none is split."""
    first = per_rank[0]
    if first is None or first.dim is None:
        return None
    for layout in per_rank:
        if layout is None or layout.dim != first.dim or layout.global_shape != tuple(shape):
            raise ValueError(f"parameter {name!r} is split on some tp ranks and not on others: {per_rank}")
    return first


def _param_entry(per_rank: list[ShardLayout | None], shape: tuple[int, ...], name: str) -> dict:
    """A parameter's entry: its spec's JSON and, when split, each tp rank's ranges and replicas."""
    first = _check_split_alike(per_rank, shape, name)
    if first is None:
        return ShardSpec(tuple(shape)).to_json()
    spec = {k: v for k, v in first.to_json().items() if k not in RANK_KEYS}
    rank_docs = [{k: layout.to_json()[k] for k in RANK_KEYS} for layout in per_rank]
    return {**spec, "ranks": rank_docs}


def _v1_split_entry(per_rank: list[ShardLayout | None], shape: tuple[int, ...], name: str) -> dict | None:
    """A version 1 file's "split" of a parameter (to check such files against the model)."""
    first = _check_split_alike(per_rank, shape, name)
    if first is None:
        return None
    return {"dim": first.dim, "replicas": first.replicas, "ranges": [layout.to_json()["ranges"] for layout in per_rank]}


def plan_document(
    resolved: ResolvedPlan,
    mesh_sizes: Mapping[str, int] | None = None,
    parallelize_embeddings: bool = True,
    sequence_parallel_enabled: bool = False,
) -> dict:
    """The JSON document of a resolved plan (its layout: `docs/module_notes.md`)."""
    model = resolved.model
    sizes = MeshLayout({**(mesh_sizes or {}), "tp": resolved.tp}).sizes  # every dim of the table
    modules = {name: [style_to_dict(s) for s in module_styles] for name, module_styles in resolved.targets.items()}
    params, tied, first_name = {}, {}, {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            tied[name] = first_name[id(param)]
        first_name.setdefault(id(param), name)
        per_rank = [layouts.get(name) for layouts in resolved.layouts]
        params[name] = _param_entry(per_rank, tuple(param.shape), name)
    config = getattr(model, "config", None)
    return {
        "format": FORMAT,
        "version": VERSION,
        "model_type": getattr(config, "model_type", None),
        "model_class": _model_class(model).__name__,
        "parallelizer": resolved.parallelizer.__name__ if resolved.parallelizer is not None else None,
        "mesh": sizes,
        "options": {
            "parallelize_embeddings": parallelize_embeddings,
            "sequence_parallel": sequence_parallel_enabled,
        },
        "modules": modules,
        "params": params,
        "tied": tied,
    }


def _model_class(model: nn.Module) -> type:
    """The model's own class (FSDP2 wraps it in a generated subclass)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def _meta_twin(model_or_config) -> nn.Module:
    """An unparallelized copy of the model's structure on the meta device (the model itself if it is one)."""
    if isinstance(model_or_config, nn.Module):
        if not _is_parallelized(model_or_config):
            return model_or_config
        with torch.device("meta"):
            return _model_class(model_or_config)._from_config(model_or_config.config)
    if isinstance(model_or_config, (str, Path)):
        from transformers import AutoConfig

        model_or_config = AutoConfig.from_pretrained(model_or_config)
    return build_meta_model(model_or_config)


def _is_parallelized(model: nn.Module) -> bool:
    return any(hasattr(p, "shard_layout") for p in model.parameters()) or hasattr(model, "orig_param_to_parallel_param")


def _write_json(doc: dict, path: str | Path) -> None:
    """Write atomically: a temp file in the same directory, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_plan(
    model_or_config,
    path: str | Path,
    plan: Mapping[str, object] | None = None,
    *,
    tp: int | None = None,
    dp: int = 1,
    pp: int = 1,
    cp: int = 1,
    parallelize_embeddings: bool = True,
    sequence_parallel_enabled: bool = False,
) -> dict:
    """Write the resolved plan of a model to JSON at `path` and return the document.

    Dry run (`tp` given): `model_or_config` is an unparallelized model (meta is fine), a config or a model
    directory; no process group is needed. On a parallelized model (`tp` None, every rank calls it): the
    plan is resolved at the current mesh's tp on a meta twin and checked against this rank's parameters
    (raises on every rank if a layout differs); global rank 0 writes. `plan` defaults to the family's plan,
    with the same `parallelize_embeddings` / `sequence_parallel_enabled` the model was parallelized with.
    """
    import torch.distributed as dist

    if tp is None:
        from ..mesh import get_mesh

        mesh = get_mesh()
        tp, sizes = mesh.tp_size, dict(mesh.sizes)
    else:
        sizes = MeshLayout({"dp": dp, "pp": pp, "cp": cp, "tp": tp}).sizes  # every dim of the table
    resolved = resolve_for_tp(_meta_twin(model_or_config), tp, plan, parallelize_embeddings, sequence_parallel_enabled)
    doc = plan_document(resolved, sizes, parallelize_embeddings, sequence_parallel_enabled)
    distributed = isinstance(model_or_config, nn.Module) and _is_parallelized(model_or_config)
    if distributed:
        from ..mesh import get_mesh

        problem = _check_local_layouts(model_or_config, resolved, get_mesh().tp_rank)
        if dist.is_initialized():
            problems: list[str | None] = [None] * ranks.world_size()
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p), None)
        if problem:
            raise ValueError(problem)
    if not dist.is_initialized() or not distributed or ranks.global_rank() == 0:
        _write_json(doc, path)
    if distributed and dist.is_initialized():
        dist.barrier()
    return doc


def _check_local_layouts(model: nn.Module, resolved: ResolvedPlan, tp_rank: int) -> str | None:
    """The first parameter of this rank whose layout differs from the resolved plan's, as a message."""
    expected = resolved.layouts[tp_rank]
    for name, param in model.named_parameters(remove_duplicate=False):
        if hasattr(param, "to_local"):  # re-created by FSDP2 (a DTensor): its layout attribute is gone
            continue
        actual = getattr(param, "shard_layout", None)
        planned = expected.get(name)
        if _split_or_none(planned) != _split_or_none(actual):
            actual_text, planned_text = (str(x) if _split_or_none(x) else "not split" for x in (actual, planned))
            return (
                f"parameter {name!r} on tp rank {tp_rank} is {actual_text}, but the plan being saved gives "
                f"{planned_text}; pass save_plan the plan (and flags) the model was parallelized with"
            )
    return None


def _split_or_none(layout: ShardLayout | None) -> ShardLayout | None:
    return None if layout is None or layout.dim is None else layout


# --------------------------------------------------------------------------------------------------------------
# Loading


def read_plan_file(path_or_doc: str | Path | Mapping) -> dict:
    """The document of a plan file (or the document itself), with its format checked."""
    if isinstance(path_or_doc, Mapping):
        doc = dict(path_or_doc)
    else:
        try:
            with open(path_or_doc) as f:
                doc = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path_or_doc}: not a plan file (invalid JSON: {err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f'{path_or_doc}: not a plan file (no "format": "{FORMAT}")')
    if doc.get("version") not in READS:
        readable = ", ".join(map(str, READS))
        raise ValueError(f"{path_or_doc}: plan file version {doc.get('version')!r}; this version reads {readable}")
    for key in ("mesh", "modules", "params"):
        if not isinstance(doc.get(key), dict):
            raise ValueError(f"{path_or_doc}: plan file has no {key!r} object")
    return doc


def load_plan(
    path_or_doc: str | Path | Mapping,
    model: nn.Module | None = None,
    *,
    tp: int | None = None,
    skip_unreloadable: bool = False,
) -> dict[str, list[ParallelStyle]]:
    """The plan of a plan file, for `apply_plan` / `mp_config["parallelize_plan"]`: {re.escape(module): styles}.

    With `model`, first checks that the file fits it (at `tp`, default the file's) and raises ValueError
    naming the first mismatching entry. Styles saved as not reloadable raise, or are left out (with a
    warning) under `skip_unreloadable`.
    """
    doc = read_plan_file(path_or_doc)
    if model is not None:
        check_plan_fits(model, doc, tp=tp, skip_unreloadable=skip_unreloadable)
    return _plan_of(doc, skip_unreloadable)


def _plan_of(doc: Mapping, skip_unreloadable: bool) -> dict[str, list[ParallelStyle]]:
    plan, skipped = {}, []
    for name, entries in doc["modules"].items():
        module_styles = []
        for i, entry in enumerate(entries):
            if entry.get("reloadable", True) is False and skip_unreloadable:
                skipped.append(f"{name}: {entry.get('style')}")
                continue
            module_styles.append(style_from_dict(entry, f"modules[{name!r}][{i}]"))
        if module_styles:
            plan[re.escape(name)] = module_styles
    if skipped:
        warnings.warn(f"plan file styles left out (not reloadable): {'; '.join(skipped)}", stacklevel=3)
    return plan


def check_plan_fits(
    model: nn.Module, path_or_doc: str | Path | Mapping, *, tp: int | None = None, skip_unreloadable: bool = False
) -> None:
    """Raise ValueError naming the first entry of the plan file that does not fit `model` at tp size `tp`.

    Checks, in order: the tp size, the model type, every module and parameter name, every global shape,
    and that the file's styles, resolved on the model, give exactly the file's layouts.
    """
    doc = read_plan_file(path_or_doc)
    file_tp = doc["mesh"].get("tp")
    if tp is not None and tp != file_tp:
        raise ValueError(f"plan file entry mesh.tp: the file was made for tp={file_tp}, the mesh has tp={tp}")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if doc.get("model_type") is not None and model_type is not None and doc["model_type"] != model_type:
        raise ValueError(
            f"plan file entry model_type: the file is for {doc['model_type']!r}, the model is {model_type!r}"
        )
    twin = _meta_twin(model)
    modules = dict(twin.named_modules())
    for name in doc["modules"]:
        if name not in modules:
            raise ValueError(f"plan file entry modules[{name!r}]: {type(twin).__name__} has no module {name!r}")
    shapes = {name: tuple(p.shape) for name, p in twin.named_parameters(remove_duplicate=False)}
    for name, entry in doc["params"].items():
        if name not in shapes:
            raise ValueError(f"plan file entry params[{name!r}]: {type(twin).__name__} has no parameter {name!r}")
        shape = entry["shape"] if doc["version"] == 1 else entry["global_shape"]
        if tuple(shape) != shapes[name]:
            raise ValueError(
                f"plan file entry params[{name!r}]: shape {shape} in the file, {list(shapes[name])} in the model"
            )
    missing = next((name for name in shapes if name not in doc["params"]), None)
    if missing is not None:
        raise ValueError(f"plan file entry params: the model's parameter {missing!r} is not in the file")
    plan = _plan_of(doc, skip_unreloadable)
    try:
        resolved = resolve_for_tp(twin, file_tp, plan)
    except ValueError as err:
        raise ValueError(f"plan file styles do not fit {type(twin).__name__}: {err}") from None
    for name, param in twin.named_parameters(remove_duplicate=False):
        per_rank = [layouts.get(name) for layouts in resolved.layouts]
        if doc["version"] == 1:
            saved, given = doc["params"][name]["split"], _v1_split_entry(per_rank, tuple(param.shape), name)
        else:
            saved, given = doc["params"][name], _param_entry(per_rank, tuple(param.shape), name)
        if given != saved:
            raise ValueError(
                f"plan file entry params[{name!r}]: split {saved} in the file, but its styles give {given} "
                "on this model"
            )


def plan_file_parallelizer(path_or_doc: str | Path | Mapping) -> type[Parallelizer]:
    """A Parallelizer whose plan is the file's (checked against the model and the mesh first), with the model
    family's checks, hooks and pipeline support: `plan_file_parallelizer(path).parallelize(model, ...)`."""
    doc = read_plan_file(path_or_doc)
    family: type[Parallelizer] = Parallelizer  # a user plan for a model type without a parallelizer
    if doc.get("model_type"):
        try:
            family = ParallelizersManager.parallelizer_for_model(doc["model_type"])
        except ValueError:
            pass
    options = doc.get("options", {})

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        return load_plan(doc, model=model, tp=mesh.tp_size)

    @classmethod
    def parallelize(cls, model, *args, **kwargs):
        for key, saved in (("sequence_parallel_enabled", "sequence_parallel"), ("parallelize_embeddings", None)):
            value = kwargs.get(key)
            recorded = options.get(saved or key)
            if value is not None and recorded is not None and value != recorded:
                raise ValueError(f"{key}={value} but the plan file was made with {key}={recorded}")
        return family.parallelize.__func__(cls, model, *args, **kwargs)

    @classmethod
    def capabilities_for(cls, model):  # the file's plan has sequence parallelism or not, whatever the structure allows
        return replace(family.capabilities_for(model), sequence_parallel=bool(options.get("sequence_parallel")))

    attrs = {
        "plan": plan,
        "parallelize": parallelize,
        "capabilities_for": capabilities_for,
        "capabilities": replace(family.capabilities, sequence_parallel=bool(options.get("sequence_parallel"))),
        "__doc__": f"{family.__name__} with the plan of a plan file.",
    }
    return type(f"PlanFile[{family.__name__}]", (family,), attrs)
