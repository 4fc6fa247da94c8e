"""Every contact with transformers' (and accelerate's, peft's) private internals, named once and checked loudly.

Private symbols change between releases without notice. Each one this package touches is listed here with
what it is for; code reaches it through `transformers_internal(name)`, which raises `InternalsChanged`
naming the symbol, the installed and the tested versions and the feature that needs it, instead of an
AttributeError deep inside a training run. A `ParallelTrainer` checks when it is made (never at import) that every
private Trainer method it overrides exists with the parameters it expects (`check_overrides`), or was added by a
transformers release newer than the installed one (`ADDED_IN`). `tests/test_internals.py` checks the whole list
against the installed transformers; `make test-compat` runs it on the lowest tested versions.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

# the versions the test lanes run: `make test` the newest, `make test-compat` the oldest (pyproject.toml's floors)
TESTED = {"transformers": ("5.17.0", "5.24.0"), "accelerate": ("1.15.0", "1.15.0"), "torch": ("2.9.0", "2.13.0")}

# private Trainer methods overridden here that transformers added after the oldest tested release: before it, nothing
# calls them and nothing needs overriding: 5.19 added the replicated-parameter fix-up for DTensor models; 5.23 the
# deferred FSDP2 reduction (before it, gradient accumulation at levels 2-3 reduce-scatters every micro-batch: the same
# gradients, more communication)
ADDED_IN = {"_sync_replicated_trainable_parameters": "5.19.0", "_defer_fsdp_gradient_reduction": "5.23.0"}


class InternalsChanged(RuntimeError):
    """A private transformers/accelerate symbol this package relies on is gone or has a new signature."""


@dataclass(frozen=True)
class Internal:
    module: str  # where it lives
    path: str  # attribute path inside the module ("PreTrainedModel._from_config")
    used_for: str
    params: tuple[str, ...] = ()  # parameter names our code passes or receives, in order (checked when given)


INTERNALS: dict[str, Internal] = {
    "PreTrainedModel._load_pretrained_model": Internal(
        "transformers.modeling_utils",
        "PreTrainedModel._load_pretrained_model",
        "lazy_load_for_parallelism: replaced by a stand-in that records where each weight lives",
        ("model", "state_dict", "checkpoint_files", "load_config", "expected_keys"),
    ),
    "PreTrainedModel._from_config": Internal(
        "transformers.modeling_utils",
        "PreTrainedModel._from_config",
        "lazy_load_for_parallelism: from_config builds on the meta device",
        ("config",),
    ),
    "PreTrainedModel._init_weights": Internal(
        "transformers.modeling_utils",
        "PreTrainedModel._init_weights",
        "lazy from_config: each module's init is replayed on a full-size stand-in, then sliced",
        ("self", "module"),
    ),
    "initialization.guard_torch_init_functions": Internal(
        "transformers.initialization",
        "guard_torch_init_functions",
        "lazy from_config: the replayed init runs under transformers' own init guards",
    ),
    "modeling_utils.get_model_conversion_mapping": Internal(
        "transformers.modeling_utils",
        "get_model_conversion_mapping",
        "lazy from_pretrained: deferred until a checkpoint key is not a model key (building it costs ~0.08 s)",
        ("model", "key_mapping", "hf_quantizer"),
    ),
    "core_model_loading.rename_source_key": Internal(
        "transformers.core_model_loading",
        "rename_source_key",
        "lazy from_pretrained: checkpoint keys are renamed exactly as transformers renames them",
        ("source_key", "weight_renamings", "weight_converters", "base_model_prefix", "meta_state_dict"),
    ),
    "core_model_loading.WeightRenaming": Internal(
        "transformers.core_model_loading", "WeightRenaming", "lazy from_pretrained: key renamings"
    ),
    "core_model_loading.WeightConverter": Internal(
        "transformers.core_model_loading", "WeightConverter", "lazy from_pretrained: weight conversions"
    ),
    "core_model_loading.MergeModulelist": Internal(
        "transformers.core_model_loading", "MergeModulelist", "lazy from_pretrained: per-expert tensors stacked"
    ),
    "core_model_loading.Concatenate": Internal(
        "transformers.core_model_loading", "Concatenate", "lazy from_pretrained: gate and up concatenated"
    ),
    "loading_report.LoadStateDictInfo": Internal(
        "transformers.utils.loading_report",
        "LoadStateDictInfo",
        "lazy from_pretrained: the stand-in returns transformers' own load report",
        ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs", "conversion_errors", "skipped_pp_keys"),
    ),
    "trainer.SCHEDULER_NAME": Internal(
        "transformers.trainer", "SCHEDULER_NAME", "ParallelTrainer: the scheduler file of a checkpoint"
    ),
    "trainer.TRAINING_ARGS_NAME": Internal(
        "transformers.trainer", "TRAINING_ARGS_NAME", "ParallelTrainer: the arguments file of save_model"
    ),
    "trainer.TRAINER_STATE_NAME": Internal(
        "transformers.trainer", "TRAINER_STATE_NAME", "ParallelTrainer: a checkpoint's last file (resume from last)"
    ),
    "LoraModel._create_new_module": Internal(
        "peft.tuners.lora.model",
        "LoraModel._create_new_module",
        "get_peft_model on a tensor-parallel model: PEFT's LoRA dispatch learns the parallel layers",
        ("lora_config", "adapter_name", "target"),
    ),
    "tuners_utils._maybe_include_all_linear_layers": Internal(
        "peft.tuners.tuners_utils",
        "_maybe_include_all_linear_layers",
        'LoRA target_modules="all-linear" on a tensor-parallel model: PEFT\'s lookup counts the parallel layers',
        ("peft_config", "model"),
    ),
    "tuners_utils.Conv1D": Internal(
        "peft.tuners.tuners_utils",
        "Conv1D",
        'LoRA target_modules="all-linear" on a tensor-parallel model: the linear classes PEFT\'s lookup reads',
    ),
    "Trainer._prepare_inputs": Internal(
        "transformers.trainer", "Trainer._prepare_inputs", "ParallelTrainer: batches moved under pp", ("self", "inputs")
    ),
}


def _resolve(internal: Internal) -> object:
    obj = importlib.import_module(internal.module)
    for part in internal.path.split("."):
        obj = getattr(obj, part)
    return obj


def _version(module: str) -> str:
    package = module.partition(".")[0]
    try:
        return importlib.import_module(package).__version__
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown"


def _release(version: str) -> tuple[int, ...]:
    """(5, 19, 0) from '5.19.0', '5.19.0.dev0' or '2.13.0+cpu'."""
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        numbers.append(int(digits or 0))
    return tuple(numbers)


def installed_release(package: str) -> tuple[int, ...]:
    """The installed `package`'s (major, minor, patch), for the few behaviours that differ inside the tested range."""
    return _release(_version(package))


def _supported(package: str) -> str:
    low, high = TESTED.get(package, ("?", "?"))
    return f"Install a {package} version between {low} and {high} (the versions this release is tested on)"


def _changed(name: str, internal: Internal, what: str) -> InternalsChanged:
    package = internal.module.partition(".")[0]
    return InternalsChanged(
        f"{package} {_version(internal.module)}: {internal.module}.{internal.path} {what}; optimum-parallel needs it "
        f"for {internal.used_for}. {_supported(package)} or report it ({name})."
    )


def _check_params(name: str, internal: Internal, obj: object) -> None:
    if not internal.params:
        return
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return
    if params[: len(internal.params)] != list(internal.params):
        raise _changed(name, internal, f"takes ({', '.join(params)}), expected ({', '.join(internal.params)}, ...)")


def transformers_internal(name: str) -> object:
    """The private symbol registered as `name`, checked; `InternalsChanged` names what moved and what needs it."""
    internal = INTERNALS[name]
    try:
        obj = _resolve(internal)
    except (ImportError, AttributeError):
        raise _changed(name, internal, "no longer exists") from None
    _check_params(name, internal, obj)
    return obj


def check_internals() -> list[str]:
    """One message per registered internal that is missing or changed (empty when all are as expected)."""
    problems = []
    for name in INTERNALS:
        try:
            transformers_internal(name)
        except InternalsChanged as err:
            problems.append(str(err))
    return problems


def private_override(method):
    """Mark a method that overrides a private method of the base class (checked by `check_overrides`)."""
    method.__private_override__ = True
    return method


def check_overrides(cls: type, base: type) -> None:
    """Every `@private_override` of `cls` must still exist on `base` with the same parameter names (an override
    of a method the base no longer calls would silently stop running), and no other private method of `cls`
    may shadow one of `base`'s by accident."""
    for name, method in vars(cls).items():
        if not (name.startswith("_") and not name.startswith("__") and inspect.isfunction(method)):
            continue
        original = getattr(base, name, None)
        if not getattr(method, "__private_override__", False):
            if original is not None:
                raise InternalsChanged(
                    f"{cls.__qualname__}.{name} shadows {base.__qualname__}.{name}: "
                    "mark it @private_override or rename it"
                )
            continue
        installed = _version(base.__module__)
        if original is None:
            if name in ADDED_IN and _release(installed) < _release(ADDED_IN[name]):
                continue  # not yet in this release: nothing calls it
            raise InternalsChanged(
                f"transformers {installed}: {base.__module__}.{base.__qualname__}.{name} no longer exists; "
                f"{cls.__qualname__} overrides it and relies on it being called. {_supported('transformers')}."
            )
        ours = list(inspect.signature(method).parameters)
        theirs = list(inspect.signature(original).parameters)
        if ours != theirs:
            raise InternalsChanged(
                f"transformers {installed}: {base.__qualname__}.{name} now takes ({', '.join(theirs)}); "
                f"{cls.__qualname__} overrides it as ({', '.join(ours)}). {_supported('transformers')}."
            )
