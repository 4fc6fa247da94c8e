"""TRL's `GRPOTrainer` with `ParallelTrainerMixin`: completions generated, scored and trained on by the parallel model.

Prompts are sharded over the batch replicas, completions come from the parallel model's tp-synchronised `generate`,
rewards run on each replica's first rank, and TRL's gathers run over the replicas; the options a layout cannot run
are refused by name before training (`check_grpo_options`). What differs from TRL on one process, and why:
docs/module_notes.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import pickle
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM, ProcessorMixin, set_seed
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl import GRPOConfig, GRPOTrainer
from trl.trainer import grpo_trainer as trl_grpo

from ...engine.checks import validate
from ...engine.compose import compose_model
from ...frontends.family_request import family_request
from ...frontends.manager import ParallelizersManager
from ...mesh import ParallelMesh, ranks
from ...mesh import device as devices
from ...plan import logits_mode
from ...plan.caller_outputs import sync_generation
from ...plan.wrappers import plan_root
from ...tensor_parallel.layers import ColumnParallelLinear
from ...tensor_parallel.logprobs import IGNORE_INDEX, token_entropy, token_log_probs, vocab_slice
from ..transformers.internals import InternalsChanged, check_overrides, private_override
from ..transformers.lazy_loading import lazy_load_for_parallelism
from ..transformers.trainer import ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments, trainer_request
from .dpo import _WeightedLogProbs
from .fused_head import FusedHead, install_fused_head
from .pipeline_pass import check_whole_rows, surrogate_loss
from .replicas import ReplicaProcesses, check_module_globals, mean_over_replicas, seed_replicas, swapped_globals

check_module_globals(trl_grpo, "ParallelGRPOTrainer")
if getattr(trl_grpo, "asyncio", None) is not asyncio:  # the tool loop's, swapped for `_SharedAsyncio`
    raise InternalsChanged(
        "trl.trainer.grpo_trainer no longer reaches asyncio by module-level name; ParallelGRPOTrainer swaps it "
        "around the tool-calling loop (docs/module_notes.md). Install a TRL version this release supports."
    )


@dataclass
class ParallelGRPOConfig(GRPOConfig, ParallelTrainingArguments):
    """TRL's `GRPOConfig` plus the mesh settings of `ParallelTrainingArguments`. The generation batch is counted in
    batch replicas (world / (tp * pp * cp)), as TRL counts it in processes on a data-parallel run.

    `GRPOConfig` comes first so that its defaults (learning_rate 1e-6, remove_unused_columns False, logging_steps
    10, bf16, ...) win over `TrainingArguments`' own, which `ParallelTrainingArguments` inherits: dataclass fields
    take the default of the last class in reverse MRO order that declares them."""

    def __post_init__(self) -> None:
        asked = self.generation_batch_size, self.steps_per_generation
        # TRL sizes the generation batch with world_size processes: what the user asked is hidden from it (a size
        # valid per replica is not always valid per process, and TRL's error would name the world's batch) and
        # sized below per replica; TRL's defaults pass wherever the replicas' do (world = replicas x ranks each)
        self.generation_batch_size = self.steps_per_generation = None
        super().__post_init__()
        self.generation_batch_size, self.steps_per_generation = asked
        _size_generation_batch(self, max(1, self.world_size // self.ranks_per_replica))

    @property
    def ranks_per_replica(self) -> int:
        """The ranks sharing one batch (tp x pp x cp)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size


def _size_generation_batch(args: GRPOConfig, replicas: int) -> None:
    """TRL's `GRPOConfig.__post_init__` sizing (same rules, same errors) with `replicas` in place of processes."""
    per_step = args.per_device_train_batch_size * replicas
    if args.generation_batch_size is None and args.steps_per_generation is None:
        args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = per_step * args.steps_per_generation
    elif args.generation_batch_size is not None and args.steps_per_generation is None:
        if args.generation_batch_size % per_step != 0:
            raise ValueError(
                f"generation_batch_size ({args.generation_batch_size}) must be divisible by the global batch size "
                f"({per_step})."
            )
        args.steps_per_generation = args.generation_batch_size // per_step
    elif args.generation_batch_size is None and args.steps_per_generation is not None:
        args.generation_batch_size = per_step * args.steps_per_generation
    else:
        raise ValueError(
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time"
        )
    if args.do_eval and args.eval_strategy != "no":
        num_generations = args.num_generations_eval or args.num_generations
        if (args.per_device_eval_batch_size * replicas) % num_generations != 0:
            raise ValueError(
                f"The global eval batch size ({args.per_device_eval_batch_size} * {replicas}) must be "
                f"divisible by the number of generations used for evaluation ({num_generations})."
            )
    if args.generation_batch_size % args.num_generations != 0:
        raise ValueError(
            f"generation_batch_size ({args.generation_batch_size}) must be divisible by num_generations "
            f"({args.num_generations})."
        )


def check_grpo_options(args: ParallelGRPOConfig, kwargs: dict[str, Any]) -> None:
    """ValueError naming the first GRPO option the layout `args` asks for cannot run (docs/module_notes.md)."""
    check_sampling_options("ParallelGRPOTrainer", args, kwargs)
    if kwargs.get("quantization_config") is not None or "quantization_config" in (args.model_init_kwargs or {}):
        raise ValueError(
            "quantization_config is not supported by ParallelGRPOTrainer (the parallel layers split full-precision "
            "weights, not a quantized model's packed ones); allowed: None"
        )
    if args.model_init_kwargs is not None:
        _torch_dtype(args.model_init_kwargs.get("dtype", "float32"))  # a wrong name, before any loading


def check_sampling_options(trainer: str, args: ParallelTrainingArguments, kwargs: dict[str, Any]) -> None:
    """The refusals GRPO and RLOO share, in order, naming `trainer` (GRPO's options RLOO lacks read as off there)."""
    check_whole_rows(args, trainer, "the pipeline scores and generates on whole rows")
    flags = {
        "use_vllm": "vLLM generates outside the parallel model",
        "use_transformers_continuous_batching": "generate_batch is not synchronised over the tp ranks",
        "use_liger_kernel": "Liger's kernels replace the forward the parallel layout is built on",
        "use_adaptive_entropy": "the entropy bonus needs the entropy's gradient through the vocab-parallel logits",
    }
    for name, why in flags.items():
        if getattr(args, name, False):
            raise ValueError(f"{name}=True is not supported by {trainer} ({why}); allowed: False")
    if getattr(args, "entropy_coef", 0.0) != 0.0:
        raise ValueError(
            f"entropy_coef={args.entropy_coef} is not supported by {trainer} (the entropy bonus needs the "
            "entropy's gradient through the vocab-parallel logits); allowed: 0.0"
        )
    if args.tensor_parallel_size > 1 and getattr(args, "cast_lm_head_to_fp32", False):
        raise ValueError(
            "cast_lm_head_to_fp32=True is not supported with tensor_parallel_size > 1 (TRL replaces the LM head's "
            "forward with a plain linear over this rank's vocabulary slice); allowed there: False"
        )
    if args.sync_ref_model and args.sharding_level >= 2:
        raise ValueError(
            f"sync_ref_model=True is not supported with sharding_level={args.sharding_level} (FSDP2 shards the "
            "policy's parameters over dp, the reference's are whole, and TRL's callback mixes them element by "
            "element); allowed there: sync_ref_model=False, or sharding_level 0-1"
        )
    if isinstance(kwargs.get("processing_class"), ProcessorMixin):  # refused here, not after a first generation
        raise ValueError(
            f"processing_class={type(kwargs['processing_class']).__name__} (a multimodal processor) is not supported "
            f"by {trainer}; allowed: a tokenizer (text-only policies)"
        )


def _torch_dtype(dtype: Any) -> Any:
    """`model_init_kwargs["dtype"]` as TRL's `create_model_from_path` takes it: a torch dtype, "auto" or None as
    given, a float type's name made that torch dtype."""
    if isinstance(dtype, torch.dtype) or dtype in ("auto", None):
        return dtype
    if dtype in ("bfloat16", "float16", "float32"):
        return getattr(torch, dtype)
    raise ValueError(
        f"model_init_kwargs['dtype']={dtype!r} is not supported by ParallelGRPOTrainer; allowed: a torch.dtype, "
        "'auto', 'bfloat16', 'float16', 'float32'"
    )


def _policy_kwargs(args: GRPOConfig) -> dict[str, Any]:
    """TRL's `from_pretrained` arguments for a policy given as a path: `model_init_kwargs`, the dtype float32 unless
    named there (TRL's default, where transformers' is "auto"), no device map (each rank places its slices)."""
    kwargs = dict(args.model_init_kwargs or {})
    kwargs["dtype"] = _torch_dtype(kwargs.get("dtype", "float32"))
    kwargs.pop("device_map", None)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


class _DropWarning(logging.Filter):
    """Drops the log records whose message holds `words` (TRL's warning about kwargs this trainer did use)."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        return self.words not in record.getMessage()


@contextlib.contextmanager
def _without_warning(logger: logging.Logger, words: str | None) -> Iterator[None]:
    """For the block, `logger` drops the records holding `words` (nothing dropped when None)."""
    if words is None:
        yield
        return
    dropped = _DropWarning(words)
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


def _vocab_parallel_head(model: nn.Module) -> ColumnParallelLinear | None:
    """The model's LM head if it is split over the vocabulary (through any wrapper: DDP, PEFT), else None."""
    found = (m for m in model.modules() if isinstance(m, ColumnParallelLinear) and hasattr(m, "logits_mode"))
    return next(found, None)


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - whatever pickling raises
        return False
    return True


# ---------------------------------------------------------------------- user code on the replica's first rank


def _portable(err: BaseException) -> BaseException:
    """`err` if it survives a pickle round trip with its message, else a RuntimeError with that message."""
    try:
        copy = pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - whatever pickling raises
        return RuntimeError(str(err))
    return copy if str(copy) == str(err) else RuntimeError(str(err))


def _same(value: Any) -> Any:
    return value


def from_first_rank(mesh: ParallelMesh, compute: Callable[[], Any], sent: Callable[[Any], Any] = _same,
                    what: str = "the result") -> Any:  # fmt: skip
    """`compute()` (a tool, the rollout function, an environment) on the replica's first rank only: what it returned
    (as `sent` makes it: what TRL reads of it) or the error it raised, and the random states it left, reach the
    replica's other ranks in one broadcast; they return that value or raise that error, and draw on from the first
    rank's states (one process's stream, which the user code drew from). One rank per replica: `compute()`."""
    if mesh.size("peers") == 1:
        return compute()
    first = mesh.rank("peers") == 0
    box: list[Any] = [None]
    value: Any = None
    error: BaseException | None = None
    if first:
        try:
            value = compute()
            message: tuple[bool, Any] = (True, sent(value))
        except BaseException as err:  # noqa: BLE001 - raised again below, on every rank of the replica
            error, message = err, (False, _portable(err))
        try:
            box[0] = pickle.dumps((*message, devices.rng_states()))
        except Exception as err:  # noqa: BLE001 - whatever pickling raises: the other ranks must not wait
            error = TypeError(f"{what} cannot be sent to the replica's other ranks ({type(err).__name__}: {err})")
            box[0] = pickle.dumps((False, error, devices.rng_states()))
    dist.broadcast_object_list(box, src=mesh.ranks("peers")[0], group=mesh.group("peers"))
    if first:
        if error is not None:
            raise error
        return value
    ok, payload, states = pickle.loads(box[0])
    devices.set_rng_states(states)
    if not ok:
        raise payload
    return payload


def _tool_content(result: Any) -> Any:
    """What TRL's tool loop reads of a tool's result: a list of content blocks as it is, anything else as text."""
    return result if isinstance(result, list) else str(result)


def _async_contents(results: list) -> list:
    """One completion's async tool results as TRL's tool loop reads them: an error by its message."""
    return [(name, RuntimeError(str(r)) if isinstance(r, Exception) else _tool_content(r)) for name, r in results]


def _tool_on_first_rank(trainer: ParallelGRPOTrainer, tool: Callable) -> Callable:
    """A synchronous tool run on the replica's first rank, its result (or error) returned on every rank."""

    @functools.wraps(tool)
    def call(**arguments: Any) -> Any:
        return from_first_rank(trainer.mesh, lambda: tool(**arguments), _tool_content, f"tool {tool.__name__}'s result")

    return call


async def _nothing() -> None:
    return None


def _async_stand_in(tool: Callable) -> Callable:
    """An async tool on a rank that does not run it: the call binds the arguments as the first rank's does (the same
    TypeError) and runs nothing; the results come from the first rank (`_SharedAsyncio`)."""

    def call(**arguments: Any) -> Any:
        coroutine = tool(**arguments)
        getattr(coroutine, "close", _same)()
        return _nothing()

    return call


class _SharedAsyncio:
    """`asyncio` as TRL's tool loop reaches it: the loop waits for one completion's async tool calls with
    `run_coroutine_threadsafe(...).result()`; the result, on the replica's first rank the tools' (the other ranks
    gather stand-ins), is handed to the other ranks."""

    def __init__(self, mesh: ParallelMesh) -> None:
        self.mesh = mesh

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    def run_coroutine_threadsafe(self, coroutine, loop) -> _SharedResult:
        return _SharedResult(self.mesh, asyncio.run_coroutine_threadsafe(coroutine, loop))


class _SharedResult:
    def __init__(self, mesh: ParallelMesh, future) -> None:
        self.mesh, self.future = mesh, future

    def result(self, timeout: float | None = None) -> list:
        return from_first_rank(self.mesh, lambda: self.future.result(timeout), _async_contents, "async tools' results")


_STAND_INS: dict[type, type] = {}


def _no_observation(self, **kwargs: Any) -> None:
    return None


def _stand_in(cls: type) -> Any:
    """An environment of class `cls` on a rank that does not run it: TRL lists its public methods as tools and renders
    their schemas, never its state, so its `__init__` does not run; its `reset` gives no observation (the first rank's
    prompts replace this rank's, `_generate`) and its tools are never called (`_tool_call_loop`)."""
    shadow = _STAND_INS.get(cls)
    if shadow is None:

        def body(namespace: dict) -> None:
            namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__)
            if inspect.isfunction(getattr(cls, "reset", None)):
                namespace["reset"] = _no_observation

        shadow = _STAND_INS[cls] = types.new_class(cls.__name__, (cls,), exec_body=body)
    return object.__new__(shadow)


class _EnvironmentOnFirstRank:
    """An `environment_factory` whose environments are made, reset and called on the replica's first rank only; the
    other ranks get stand-ins of the same class (`_stand_in`)."""

    def __init__(self, trainer: ParallelGRPOTrainer, factory: Callable[[], Any]) -> None:
        self.trainer, self.factory = trainer, factory

    def __call__(self) -> Any:
        mesh = self.trainer.mesh
        made = from_first_rank(mesh, self.factory, type, "environment_factory's class")
        return made if mesh.rank("peers") == 0 else _stand_in(made)


def _rollout_on_first_rank(rollout_func: Callable) -> Callable:
    """`rollout_func` run on the replica's first rank, its output (or error) returned on every rank."""

    @functools.wraps(rollout_func)
    def rollout(prompts: list, trainer: ParallelGRPOTrainer) -> dict:
        return from_first_rank(trainer.mesh, lambda: rollout_func(prompts, trainer), what="rollout_func's output")

    return rollout


class ParallelGRPOTrainer(ReplicaProcesses, ParallelTrainerMixin, GRPOTrainer):
    """TRL's `GRPOTrainer` on a parallel model (docs/module_notes.md); `args` is a `ParallelGRPOConfig`.

    `ParallelGRPOTrainer(model_or_path, reward_funcs=..., args=ParallelGRPOConfig(...), train_dataset=...,
    processing_class=tokenizer)`; launch with torchrun.
    """

    trl_module = trl_grpo  # TRL's gathers and reductions run over the batch replicas (`ReplicaProcesses`)

    def __init__(self, model, reward_funcs=None, args: ParallelGRPOConfig | None = None, **kwargs: Any) -> None:
        if not isinstance(args, ParallelGRPOConfig):
            raise TypeError(f"ParallelGRPOTrainer needs ParallelGRPOConfig arguments, got {type(args).__name__}")
        check_grpo_options(args, kwargs)
        used_init_kwargs = None  # TRL's warning that they are ignored, when the policy was loaded with them here
        if isinstance(model, (str, os.PathLike)):
            if kwargs.get("model_kwargs") is not None and args.model_init_kwargs is not None:
                raise ValueError(
                    "model_kwargs and args.model_init_kwargs both given for a policy path; allowed: one of them"
                )
            if kwargs.get("model_kwargs") is None:
                kwargs["model_kwargs"] = _policy_kwargs(args)  # TRL's: float32 unless model_init_kwargs names one
                used_init_kwargs = None if args.model_init_kwargs is None else "model_init_kwargs"
        # tools, environments and the rollout function run on each replica's first rank (docs/module_notes.md)
        if kwargs.get("rollout_func") is not None:
            kwargs["rollout_func"] = _rollout_on_first_rank(kwargs["rollout_func"])
        factory = kwargs.get("environment_factory")
        if isinstance(factory, dict):
            kwargs["environment_factory"] = {k: _EnvironmentOnFirstRank(self, f) for k, f in factory.items()}
        elif factory is not None:
            kwargs["environment_factory"] = _EnvironmentOnFirstRank(self, factory)
        set_seed(args.seed)  # as TRL seeds before it builds the model: adapters (peft_config) start as TRL's do
        # the reference, when beta > 0
        with (
            swapped_globals(trl_grpo, {"create_model_from_path": self._load_reference}),
            _without_warning(logging.getLogger(trl_grpo.__name__), used_init_kwargs),
        ):
            super().__init__(model, args=args, reward_funcs=reward_funcs, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                f"router_aux_loss_coef={self.router_aux_loss_coef} is not supported by ParallelGRPOTrainer (the "
                "per-token log-probs come from the logits, not TRL's fused head that adds the router loss); "
                "allowed: 0.0"
            )
        self._policy_head: FusedHead | None = None
        self._pipeline_pass: tuple[torch.Tensor, ...] | None = None  # under pp: the step's rows (`training_step`)
        if self._through_fused_head:  # the per-token log-probs through the parallel fused head (cp, pp)
            for scorer in (self.model, self.ref_model):
                if scorer is not None:
                    head = install_fused_head(plan_root(self.accelerator.unwrap_model(scorer)), self.temperature)
                    self._policy_head = self._policy_head or head
        # the ranks of a replica sample, shuffle and draw alike (one process: the seed TRL gives process 0)
        seed_replicas(self.mesh, args.seed)

    @property
    def _through_fused_head(self) -> bool:
        """Whether the per-token log-probs come from the parallel fused head: under cp (gathered over cp) and under pp
        (scored by the pipeline's last stage, sent to the others)."""
        return self.mesh.size("cp") > 1 or self._pipeline is not None

    def _load_reference(self, model_id: str, **model_init_kwargs: Any) -> nn.Module:
        """TRL's reference model (`create_model_from_path(policy's path, ...)`: `model_init_kwargs`, else the policy's
        dtype), loaded lazily and made parallel on the policy's mesh with the policy's layout; frozen, in eval mode."""
        model_init_kwargs.pop("device_map", None)
        model_init_kwargs["dtype"] = _torch_dtype(model_init_kwargs.get("dtype", "float32"))
        args = self.args
        sizes = args.tensor_parallel_size, args.pipeline_parallel_size, args.expert_parallel_size
        with lazy_load_for_parallelism(*sizes):
            reference = AutoModelForCausalLM.from_pretrained(model_id, **model_init_kwargs)
        parallelizer = ParallelizersManager.parallelizer_for_model(reference)
        request = replace(trainer_request(args, device=args.device), compile=None)
        resolved = validate(request, reference, self.mesh, functools.partial(family_request, parallelizer))
        compose_model(reference, self.mesh, resolved)
        return reference.eval().requires_grad_(False)

    # ------------------------------------------------------------------ the batch replicas as TRL's processes
    # (`ReplicaProcesses`: TRL's generation, scoring, buffering and clipped policy loss over the replicas)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """TRL's evaluation loss, made the whole evaluation batch's on every replica (the mean of the replicas'
        shares): the Trainer repeats each rank's loss per example, gathers them over dp and keeps only the first
        `remainder` examples of the last batch (accelerate's gather_for_metrics), which would weigh the replicas'
        shares unevenly where one process weighs one loss."""
        if self._pipeline is None:
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        else:  # TRL's, its scoring through the pipeline (the Trainer's pp evaluation scores labels of its own)
            loss, logits, labels = GRPOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)
        return mean_over_replicas(loss, self.mesh), logits, labels

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Under pp, DPO's two passes (`ParallelDPOTrainer.training_step`): TRL's step, whose log-probs the pipeline
        scored without a graph (a leaf, `FusedHead.pipeline_log_probs`), backpropagates TRL's loss to them; then the
        pipeline's forward and backward of sum(weight x log p(token)), the weights being that gradient and the logits
        divided by the temperature, give the parameters the gradient of TRL's loss (one forward more than TRL's)."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return two_pass_step(self, GRPOTrainer.training_step, model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------ generation

    @private_override
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation through the parallel model's tp-synchronised `generate` (`parallel_generation`)."""
        with parallel_generation(self):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )

    # ------------------------------------------------------------------ tools and environments

    @private_override
    def _generate(self, prompts):
        """With environments, the prompts as the replica's first rank's environments left them (their `reset`
        observations; the other ranks hold stand-ins, `_stand_in`)."""
        if self.environments and self.mesh.size("peers") > 1:
            prompts = from_first_rank(self.mesh, lambda: prompts, what="the prompts after the environments' reset")
        return super()._generate(prompts)

    @private_override
    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        """TRL's tool loop (the generation after each tool turn runs on every rank of the replica), the tools run on
        the replica's first rank: its synchronous tools' results reach the other ranks one call at a time, a
        completion's async tool results (run there concurrently, as TRL runs them) together."""
        if self.mesh.size("peers") == 1:
            return super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, logprobs, images,
                                           multimodal_fields)  # fmt: skip
        saved = self._sync_tool_dicts, self._async_tool_dicts
        self._sync_tool_dicts = [{n: _tool_on_first_rank(self, t) for n, t in d.items()} for d in saved[0]]
        if self.mesh.rank("peers") != 0:
            self._async_tool_dicts = [{n: _async_stand_in(t) for n, t in d.items()} for d in saved[1]]
        try:
            with swapped_globals(trl_grpo, {"asyncio": _SharedAsyncio(self.mesh)}):
                return super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, logprobs, images,
                                               multimodal_fields)  # fmt: skip
        finally:
            self._sync_tool_dicts, self._async_tool_dicts = saved

    # ------------------------------------------------------------------ rewards

    @private_override
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """The reward functions on each replica's first rank only; one all-gather hands every rank the rewards of
        every replica (in replica order, as TRL's gather), what the functions logged, or the first error raised."""
        leader = self.mesh.rank("peers") == 0
        payload: Any = None
        own_error: Exception | None = None
        if leader:
            try:
                with swapped_globals(trl_grpo, {"gather": lambda tensor: tensor}):  # this replica's rows; shared below
                    payload = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list).cpu()
            except Exception as err:  # noqa: BLE001 - raised again below, on every rank
                own_error = err
                payload = err if _picklable(err) else RuntimeError(f"{type(err).__name__}: {err}")
            payload = (payload, dict(self._pending_metrics), dict(self._pending_extra_logs))
        everyone: list = [None] * ranks.world_size()
        dist.all_gather_object(everyone, (self.mesh.rank("batch"), payload))
        failed = [p[0] for _, p in everyone if p is not None and isinstance(p[0], BaseException)]
        if own_error is not None:
            raise own_error
        if failed:
            raise failed[0]
        mine = next(p for b, p in everyone if p is not None and b == self.mesh.rank("batch"))
        if not leader:  # what the reward functions logged through log_metric / log_extra, as on the leader
            self._pending_metrics.update(mine[1])
            self._pending_extra_logs.update(mine[2])
        rows = sorted((b, p[0]) for b, p in everyone if p is not None)
        return torch.cat([r for _, r in rows]).to(self.accelerator.device)

    # ------------------------------------------------------------------ per-token log-probabilities

    @private_override
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's per-token log-probs of the completion tokens (0 on padding) and their entropies, from the model's
        local logits of the completion positions (this rank's vocabulary slice under tp), divided by the
        temperature as TRL's fused head divides them."""
        extra = (pixel_values, image_grid_thw, pixel_attention_mask, spatial_shapes, image_sizes, token_type_ids,
                 mm_token_type_ids, image_position_ids)  # fmt: skip
        if any(value is not None for value in extra):
            raise ValueError("ParallelGRPOTrainer scores text-only models; allowed inputs: input_ids, attention_mask")
        if compute_aux_loss:
            raise ValueError("router_aux_loss_coef is not supported by ParallelGRPOTrainer; allowed: 0.0")
        batch_size = batch_size or input_ids.size(0)
        if self._through_fused_head:
            return self._per_token_over_context(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                compute_entropy)  # fmt: skip
        where = vocab_slice(self.accelerator.unwrap_model(model))  # this rank's vocabulary slice (tp) or all of it
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            targets = ids[:, -logits_to_keep:].masked_fill(mask[:, -logits_to_keep:] == 0, -100)
            local = logits_mode(model, "local") if where.group is not None else contextlib.nullcontext()
            # only the completion's positions reach the LM head; under sequence parallelism the whole sequence does
            # (a forward keeping some logits runs the plain tp path, see plan/caller_outputs.py: sp would be off)
            keep = {} if self.args.sequence_parallel else {"logits_to_keep": logits_to_keep + 1}
            with local, self.accelerator.autocast():
                output = model(input_ids=ids, attention_mask=mask, use_cache=False, **keep)
            logits = output.logits[:, -logits_to_keep - 1 : -1] / self.temperature  # position t scores token t + 1
            logps.append(token_log_probs(logits, targets, where.group, where.vocab_start))
            if compute_entropy:
                entropies.append(token_entropy(logits, targets, where.group, where.vocab_start))
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    def _per_token_over_context(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy):
        """Under cp: TRL's own labels through the parallel fused head (`fused_head.py`), which scores each rank's
        chunks and gathers the per-token numbers over cp (its backward: this rank's part, times cp, which the dp x cp
        gradient average makes the one-process gradient), so every cp rank holds the whole rows TRL's loss reads.
        Under pp the pipeline scores the rows (no graph); the policy's scored rows are kept for `training_step`."""
        if self._pipeline is not None and torch.is_grad_enabled():
            if batch_size != input_ids.size(0):  # one leaf per step: TRL scores the policy's rows in one call
                raise NotImplementedError("the policy's log-probs in several calls under pipeline parallelism")
            labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
            labels[:, :-logits_to_keep] = IGNORE_INDEX
            self._pipeline_pass = input_ids, attention_mask, labels
        # under pp x tp the pipeline would gather the last stage's logits over the vocabulary; the fused head scores
        # this rank's slice (on the other stages there is no head to set)
        local = _vocab_parallel_head(model) is not None and self._pipeline is not None
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            labels = ids.masked_fill(mask == 0, -100)
            labels[:, :-logits_to_keep] = -100
            with self.accelerator.autocast(), logits_mode(model, "local") if local else contextlib.nullcontext():
                output = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            logps.append(output.log_probs[:, -logits_to_keep:])
            entropies.append(output.entropy[:, -logits_to_keep:])
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None


def two_pass_step(trainer, trl_step: Callable, model, inputs, num_items_in_batch) -> torch.Tensor:
    """GRPO's and RLOO's step under pp: TRL's `trl_step` (backward to the leaf), then `tempered_pipeline_pass`."""
    trainer._pipeline_pass = None
    loss = trl_step(trainer, model, inputs, num_items_in_batch)
    tempered_pipeline_pass(trainer, model)
    return loss


def tempered_pipeline_pass(trainer, model) -> None:
    """The second of the two passes of a sampling trainer's pp step (GRPO's, RLOO's): the pipeline's forward and
    backward of sum(weight x log p(token)) over the rows `trainer.compute_loss` kept (`_pipeline_pass`), the weights
    being the gradient TRL's step left on the fused head's log-prob leaf, the logits divided by the temperature."""
    input_ids, attention_mask, labels = trainer._pipeline_pass
    weights = trainer._policy_head.pipeline_log_probs.grad
    root = plan_root(trainer.accelerator.unwrap_model(model))
    surrogate = _TemperedLogProbs(root, weights, root.config.get_text_config().vocab_size, trainer.temperature)
    try:
        with surrogate_loss(root, surrogate), trainer.accelerator.autocast():
            model.run_train(input_ids=input_ids, labels=surrogate.encode(labels), attention_mask=attention_mask)
    finally:
        trainer._pipeline_pass = None


class _TemperedLogProbs(_WeightedLogProbs):
    """DPO's pp surrogate, sum(weight x log p(label)), with the logits divided by GRPO's temperature as TRL's fused
    head divides them."""

    def __init__(self, model, weights: torch.Tensor, vocab_size: int, temperature: float) -> None:
        super().__init__(model, weights, vocab_size)
        self.temperature = temperature

    def __call__(self, logits, labels, **kwargs) -> torch.Tensor:
        return super().__call__(logits / self.temperature, labels, **kwargs)


class _PipelineNextToken:
    """`forward` for generation under pp: the rows through the pipeline's stages (`run_eval`, no kv cache), the last
    position's logits sent from the last stage to every stage, so every rank of the replica samples the same token.
    Slow (each token runs the whole rows through every stage, micro-batch by micro-batch) but exact."""

    def __init__(self, root: nn.Module, pipeline) -> None:
        self.root, self.pipeline = root, pipeline
        # the model's own signature: `generate` checks its keyword arguments against it
        self.__signature__ = inspect.signature(type(root).forward.__get__(root))

    def __call__(self, input_ids=None, attention_mask=None, **kwargs) -> CausalLMOutputWithPast:
        pipeline = self.pipeline
        logits = pipeline.run_eval(input_ids=input_ids, attention_mask=attention_mask).logits
        if pipeline.holds_last:
            last = logits[:, -1:].contiguous()
        else:
            vocab = self.root.config.get_text_config().vocab_size
            last = torch.empty(input_ids.shape[0], 1, vocab, dtype=self.root.dtype, device=input_ids.device)
        dist.broadcast(last, src=pipeline.last_rank, group=pipeline.pp_group)
        return CausalLMOutputWithPast(logits=last)


@contextlib.contextmanager
def parallel_generation(trainer: ParallelTrainerMixin) -> Iterator[None]:
    """For TRL's generation: full-vocabulary logits (also inside an evaluation); under cp or pp, no kv cache."""
    full = _vocab_parallel_head(trainer.model) is not None
    without_cache = trainer.mesh.size("cp") > 1 or trainer._pipeline is not None
    with (
        logits_mode(trainer.model, "full") if full else contextlib.nullcontext(),
        _generate_without_cache(trainer.accelerator.unwrap_model(trainer.model), trainer.mesh, trainer._pipeline)
        if without_cache
        else contextlib.nullcontext(),
    ):
        yield


@contextlib.contextmanager
def _generate_without_cache(model: nn.Module, mesh: ParallelMesh, pipeline=None) -> Iterator[None]:
    """Generation under cp: the model refuses `generate` (ring attention keeps no kv cache), so for the block its
    `generate` is transformers' own without a cache -- every new token runs the whole sequence through the cp ranks
    (a forward of the whole rows per token), whose logits, gathered over cp, are the same on every rank of the
    replica; they sample alike from one shared random state (the tp-synchronised generate's check and draw). Under
    pp (`pipeline`) the forward is the pipeline's (`_PipelineNextToken`)."""
    root = plan_root(model)
    saved = root.__dict__.get("generate")
    saved_forward = root.__dict__.get("forward")
    if pipeline is not None:
        root.forward = _PipelineNextToken(root, pipeline)

    def generate(input_ids=None, attention_mask=None, **kwargs):
        sync_generation(mesh.group("peers"), (), {"input_ids": input_ids})
        # positions count up from each row's first (padding) token, as in the training forward: the cp split takes
        # no others, and rotary positions are relative, so the real tokens attend as with generate's own
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        return type(root).generate(root, input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                   use_cache=False, logits_to_keep=0, **kwargs)  # fmt: skip

    root.generate = generate
    try:
        yield
    finally:
        for name, value in (("generate", saved), ("forward", saved_forward)):
            if value is None:
                root.__dict__.pop(name, None)
            else:
                setattr(root, name, value)


check_overrides(ParallelGRPOTrainer, GRPOTrainer)
check_overrides(ReplicaProcesses, GRPOTrainer)
