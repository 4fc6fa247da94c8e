"""ParallelTrainer: `transformers.Trainer` with tensor, sequence, pipeline and data parallelism.

The model is parallelized in `__init__` (the model half of `engine.compose`) before any optimizer exists, so the
Trainer's own optimizer (or one passed in, rebuilt) holds the parallel parameters; the training half (data
parallel) runs once transformers' Trainer has built it. Every override below says why it exists;
everything else (logging, callbacks, evaluation loop, checkpoint rotation, resuming) is the Trainer's own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import recursively_apply
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from ...checkpoint import find_last_checkpoint, read_index, reshard_checkpoint, save_model_checkpoint
from ...checkpoint.async_save import AsyncCheckpoint, wait_for_pending_save
from ...checkpoint.rank_info import current_rank
from ...data_parallel.replica_watch import check_replicas
from ...engine.checks import mesh_layout, validate
from ...engine.compose import compose_model, compose_training, optimizer_for_parallel_model
from ...engine.grad_norm import clip_grad_norm_
from ...engine.grad_norm import grad_norm as global_grad_norm
from ...engine.request import ParallelRequest
from ...frontends.family_request import family_request
from ...frontends.manager import ParallelizersManager
from ...mesh import ParallelMesh, get_mesh, init_mesh, launchers, ranks
from ...packing import PACKING_KEYS
from ...plan import logits_mode
from ...plan.wrappers import plan_root
from ...tensor_parallel.layers import ColumnParallelLinear
from .internals import InternalsChanged, check_overrides, installed_release, private_override, transformers_internal
from .lazy_loading import lazy_load_for_parallelism
from .training_args import ParallelTrainingArguments, trainer_request
from .xla import XlaStepCallback, no_token_gather, on_xla_device, plain_loader

SCHEDULER_NAME = transformers_internal("trainer.SCHEDULER_NAME")
TRAINING_ARGS_NAME = transformers_internal("trainer.TRAINING_ARGS_NAME")
TRAINER_STATE_NAME = transformers_internal("trainer.TRAINER_STATE_NAME")
PIPELINE_COLUMNS = ["input_ids", "attention_mask", "labels", "label", "label_ids", *PACKING_KEYS]


def _mesh_for(request: ParallelRequest, timeout: float) -> ParallelMesh:
    """The current mesh if it has the asked sizes, else a new dp x pp x cp x tp one (dp = world / (tp * pp * cp))."""
    world = ranks.world_size() if dist.is_initialized() else launchers.detect().world_size
    layout = mesh_layout(request, world)
    with contextlib.suppress(RuntimeError):
        if get_mesh().layout == layout:
            return get_mesh()
    return init_mesh(**layout.sizes, ep=layout.ep, timeout=timeout)


def _register_data_loader(accelerator, data_loader) -> None:
    """accelerate keeps the loaders it prepared in a private list (for their state and end-of-epoch handling)."""
    loaders = getattr(accelerator, "_dataloaders", None)
    if not isinstance(loaders, list):
        raise InternalsChanged(
            f"accelerate's Accelerator has no `_dataloaders` list any more (found {type(loaders).__name__}); "
            "ParallelTrainer registers its dp-sharded data loaders there. Install an accelerate version this "
            "release supports."
        )
    loaders.append(data_loader)


def _load(model, args, model_class: type, model_kwargs: dict[str, Any] | None):
    """`model` itself, or the checkpoint at that path loaded under `lazy_load_for_parallelism` (no rank ever holds
    the whole model)."""
    if not isinstance(model, (str, os.PathLike)):
        return model
    sizes = args.tensor_parallel_size, args.pipeline_parallel_size, args.expert_parallel_size
    with lazy_load_for_parallelism(*sizes):
        return model_class.from_pretrained(model, **(model_kwargs or {}))


def _has_vocab_parallel_head(model: nn.Module) -> bool:
    return any(isinstance(m, ColumnParallelLinear) and hasattr(m, "logits_mode") for m in model.modules())


def _inner(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


class ParallelTrainerMixin:
    """The parallel behaviour of `ParallelTrainer`, for any `transformers.Trainer` subclass: put it first,
    `class MyTrainer(ParallelTrainerMixin, SomeTrainer)`, with arguments that are `ParallelTrainingArguments` too
    (TRL's SFT trainer: `optimum_parallel.integrations.trl.ParallelSFTTrainer`).

    `model` is a transformers model or a checkpoint path (loaded under `lazy_load_for_parallelism` with
    `model_class.from_pretrained(path, **model_kwargs)`, so no rank ever holds the whole model). A PEFT model, or
    `peft_config` (adapters added once the base is split), trains its adapters; its checkpoints hold only them.
    Other arguments are the trainer's, passed by keyword; `model_init` is not supported.
    """

    def __init__(
        self,
        model: PreTrainedModel | str | os.PathLike,
        args: ParallelTrainingArguments,
        *,
        model_class: type = AutoModelForCausalLM,
        model_kwargs: dict[str, Any] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        check_overrides(ParallelTrainerMixin, Trainer)  # a renamed Trainer method fails here, loudly, before any work
        if not isinstance(args, ParallelTrainingArguments):
            raise TypeError(f"ParallelTrainer needs ParallelTrainingArguments, got {type(args).__name__}")
        if kwargs.get("model_init") is not None:
            raise ValueError("model_init is not supported by ParallelTrainer; pass the model or its path")
        request = trainer_request(args, optimizer=optimizers[0], device=args.device)
        self.mesh = _mesh_for(request, args.ddp_timeout)
        model = _load(model, args, model_class, model_kwargs)  # lazily: every rank reads only its slices
        self.parallelizer = ParallelizersManager.parallelizer_for_model(model)
        model, checked, composed = self._parallelize_model(model, request, peft_config)
        self._adapters_only = plan_root(model) is not model  # a PEFT model: checkpoints hold what trains
        optimizer, scheduler = optimizers
        if optimizer is not None:  # step 5 of compose, early: transformers' Trainer takes it as the one it steps
            optimizer = optimizer_for_parallel_model(optimizer, composed.param_map)
        self._pipeline = composed.pipeline
        self._resume_dir: tuple[str, Path] | None = None
        self._async_checkpoint: AsyncCheckpoint | None = None  # the checkpoint written in the background now
        super().__init__(model=model, args=args, optimizers=(optimizer, scheduler), **kwargs)
        self._parallelize_training(checked.data_parallel)

    def _parallelize_model(self, model: nn.Module, request, peft_config: Any) -> tuple[nn.Module, Any, Any]:
        """The whole request checked (data parallelism and the optimizer passed in included) before anything
        changes, then the model half of the composition, then the adapters on the parallel model (after the split:
        their targets are checked against the plan; its frozen base may have been loaded lazily)."""
        inner = plan_root(model)
        checked = validate(request, inner, self.mesh, partial(family_request, self.parallelizer))
        if peft_config is not None:
            from ..peft.lora import check_adapter_targets

            check_adapter_targets(inner, checked.module_styles or {}, peft_config)
        composed = compose_model(inner, self.mesh, checked)
        model.orig_param_to_parallel_param = composed.param_map
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        return model, checked, composed

    def _parallelize_training(self, data_parallel) -> None:
        """After transformers' Trainer exists: the model owns its placement and gradient reduction (accelerate
        neither DDP-wraps nor moves it, and shards batches over dp only), the optimizer over the parallel
        parameters, then the training half of the composition; on XLA one sync per optimizer step."""
        self.is_distributed_loading_by_transformers = True
        self.accelerator.prepare_data_loader = self._prepare_data_loader
        self.accelerator.prepare_model = self._prepare_model_unwrapped
        if self.optimizer is None:
            self.create_optimizer()
        # an optimizer passed in was rebuilt above, and the Trainer's own is built over the parallel parameters:
        # no parameter map here (its keys are ids of replaced parameters, which new ones, e.g. adapters, may reuse)
        self.model, self.optimizer = compose_training(self.model, self.optimizer, self.mesh, {}, data_parallel)
        self.model_wrapped = self.model
        if self.lr_scheduler is not None:
            self.lr_scheduler.optimizer = self.optimizer  # it was built over the optimizer before parallelism
        if on_xla_device(self.args.device):  # no all-reduce of gradients by accelerate
            XlaStepCallback.install(self)

    # ------------------------------------------------------------------ accelerate: no wrapping, batches per dp rank

    def _prepare_model_unwrapped(self, model, device_placement=None, evaluation_mode=False):
        """accelerate prepares autocast (and nothing else) for the model, which owns its placement and gradient
        reduction: what transformers >= 5.19 asks for a model loaded distributed; older releases call
        `accelerator.prepare(model, optimizer)`, which would wrap it in DDP over the whole world."""
        del device_placement, evaluation_mode
        return type(self.accelerator).prepare_model(
            self.accelerator, model, device_placement=False, evaluation_mode=True
        )

    @private_override
    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        """No device placement by accelerate: parallelize placed the model, and moving a ZeRO optimizer's state
        (a state_dict round trip) is not possible; batches are moved by `_prepare_inputs`. No whole-model
        torch.compile by accelerate either: `torch_compile` compiled each decoder block (`engine/compile.py`)."""
        args = {**super()._build_accelerator_args(**kwargs), "device_placement": False}
        args.pop("dynamo_plugin", None)
        return args

    def _prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """accelerate shards batches over the world; here over dp only, so the tp, pp and cp ranks of one replica
        get identical batches (same seedable sampler, same order as one process with the global batch; the cp ranks
        each take their share of the sequence in the model's forward)."""
        acc = self.accelerator
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return data_loader
        prepared = prepare_data_loader(
            data_loader,
            acc.device,
            num_processes=self.mesh.size("batch"),
            process_index=self.mesh.rank("batch"),
            split_batches=acc.split_batches,
            put_on_device=False,
            rng_types=acc.rng_types.copy(),
            dispatch_batches=False,
            even_batches=acc.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader,
        )
        prepared = plain_loader(prepared)  # on XLA: no device loader (it syncs per batch); see `xla.py`
        _register_data_loader(acc, prepared)
        return prepared

    def get_tp_size(self) -> int:
        """Ranks that share one batch (tp x pp x cp): the Trainer divides world-wide token counts and batch sizes,
        and its loss scale (world / this = dp), by it. cp is counted here, not in `get_cp_size` (which reads
        accelerate's own parallelism config, unset here), because the loss scale divides by this one only."""
        return self.mesh.size("tp") * self.mesh.size("pp") * self.mesh.size("cp")

    def _trainer_token_divisor(self) -> int:
        """What transformers divides its token count by: `get_tp_size` x cp x sp from 5.19 on (the last two read
        accelerate's parallelism config, unset here), accelerate's non-data-parallel size before (unset: 1)."""
        if installed_release("transformers") >= (5, 19):
            return self.get_tp_size()
        config = getattr(self.accelerator, "parallelism_config", None)
        return config.non_data_parallel_size if config is not None else 1

    @private_override
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """Without `average_tokens_across_devices` the Trainer's count is this replica's own, yet it still divides it
        by `get_tp_size` (meant for a count gathered over the world): undo that, or the loss would be the replica's
        token mean times tp x pp x cp. On XLA the count is this replica's, summed over dp in the graph: accelerate's
        gather over the world would sync the device a second time per step."""
        local = not self.args.average_tokens_across_devices
        xla = not local and on_xla_device(device)
        with no_token_gather(self.args) if xla else contextlib.nullcontext():
            count = super()._get_num_items_in_batch(batch_samples, device)
        if count is not None and (local or xla):
            count = count * self._trainer_token_divisor()
        if count is not None and xla and self.mesh.size("batch") > 1:  # the global batch's count, summed in the graph
            dist.all_reduce(count, group=self.mesh.group("batch"))
        return count

    @private_override
    def _sync_replicated_trainable_parameters(self, model: nn.Module) -> None:
        """The Trainer's fix-up for DTensor models would average tp shards over the world: ours need none."""

    @private_override
    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """FSDP2 (sharding_level 2-3) with gradient accumulation: reduce-scatter after the last micro-batch only."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    pipeline_columns: tuple[str, ...] = tuple(PIPELINE_COLUMNS)  # dataset columns kept under pp

    @private_override
    def _set_signature_columns_if_needed(self) -> None:
        """Under pp `model.forward` is blocked (the pipeline runs it): keep the columns `run_train` takes."""
        if self._signature_columns is None and self._pipeline is not None:
            self._signature_columns = list(self.pipeline_columns)
        super()._set_signature_columns_if_needed()

    @private_override
    def _track_num_input_tokens(self, inputs) -> None:
        """The Trainer sums tokens over the world; tp, pp and cp ranks of a replica saw the same ones."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.get_tp_size()

    # ------------------------------------------------------------------ training step and the global gradient norm

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """Under pp the pipeline runs forward and backward over its micro-batches and returns the global batch's loss
        (the same on every rank: the Trainer's mean over the world logs it as is). It gets the Trainer's count of
        labelled tokens, which with `average_tokens_across_devices` is the global batch's (gathered over the world,
        divided by `get_tp_size`); otherwise transformers' count is per device (and divided too): run_train then
        counts the global batch's tokens itself over the dp replicas."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if not self.args.average_tokens_across_devices:
            num_items_in_batch = None
        elif num_items_in_batch is not None and not on_xla_device(self.args.device):
            # the world's count, in which each replica's tokens come tp x pp x cp times: the global batch's count
            # (transformers before 5.19 does not divide it; its loss scale over the world makes up for that
            # outside pp, but the pipeline's loss is the global batch's mean as it is)
            num_items_in_batch = num_items_in_batch * self._trainer_token_divisor() / self.get_tp_size()
        inputs = self._prepare_inputs(inputs)
        with self.accelerator.autocast():  # accelerate's mixed precision wraps model.forward, which pp bypasses
            return model.run_train(**inputs, num_items_in_batch=num_items_in_batch).detach()

    @private_override
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Clip with the global norm (every gradient piece counted once over tp, pp, dp and cp); returns it."""
        return clip_grad_norm_(model, self.args.max_grad_norm, mesh=self.mesh)

    @private_override
    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        """The logged norm is the global one too (computed when clipping is off)."""
        return grad_norm if grad_norm is not None else global_grad_norm(model, mesh=self.mesh)

    # ------------------------------------------------------------------ evaluation

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys=None):
        """The model returns full-vocabulary logits in evaluation (see `logits_mode`): metrics see the whole
        vocabulary; when only the loss is wanted they stay vocab-parallel (nothing gathered). Under pp the
        pipeline runs the forward (loss on every rank, logits sent from the last stage)."""
        if self._pipeline is None:
            keep_local = prediction_loss_only and _has_vocab_parallel_head(model)
            with logits_mode(model, "local") if keep_local else contextlib.nullcontext():
                return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        model.eval()
        with self.accelerator.autocast():
            out = model.run_eval(**inputs)
        if prediction_loss_only:
            return out.loss, None, None
        return out.loss, self._logits_from_last_stage(out.logits, inputs["input_ids"]), inputs.get("labels")

    def _logits_from_last_stage(self, logits: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
        pipeline = self._pipeline
        if logits is None:
            shape = (*input_ids.shape, self.model.config.vocab_size)
            logits = torch.empty(shape, dtype=self.model.dtype, device=input_ids.device)
        logits = logits.contiguous()
        dist.broadcast(logits, src=pipeline.last_rank, group=pipeline.pp_group)
        return logits

    def evaluation_loop(self, *args, **kwargs):
        """Gather predictions over the dp replicas only (the Trainer resets `gather_function` after each loop)."""
        self.gather_function = self._gather_over_dp
        return super().evaluation_loop(*args, **kwargs)

    def _gather_over_dp(self, data, use_gather_object: bool = False):
        """`gather_for_metrics` over dp: tp/pp/cp ranks hold copies; the even_batches padding of the last batch goes."""
        replicas = self.mesh.size("batch")
        if replicas > 1:

            def gather(tensor: torch.Tensor) -> torch.Tensor:
                parts = [torch.empty_like(tensor) for _ in range(replicas)]
                dist.all_gather(parts, tensor.contiguous(), group=self.mesh.group("batch"))
                return torch.cat(parts)

            data = recursively_apply(gather, data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = recursively_apply(lambda t: t[: state.remainder], data)
        return data

    # ------------------------------------------------------------------ checkpoints

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """`resume_from_checkpoint="last"`: the newest complete checkpoint in `output_dir` (interrupted saves are
        skipped with a warning), or a fresh start where there is none, so one command serves the first run and every
        restart (`torchrun --max-restarts`); `True`: the same, but a checkpoint must exist."""
        if resume_from_checkpoint is True or resume_from_checkpoint == "last":
            found = find_last_checkpoint(self.args.output_dir, required=[TRAINER_STATE_NAME])
            if found is None and resume_from_checkpoint is True:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            resume_from_checkpoint = None if found is None else str(found)
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self._wait_for_checkpoint()  # the last async checkpoint is in place (or its error raised) when train returns
        return output

    @private_override
    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """With `async_save`: the same checkpoint, its files snapshotted and written in the background (the model
        and optimizer shards, copied while the next step's forward and backward run and before its optimizer step,
        which waits for the copy; the Trainer's RNG, scheduler, scaler and state files, made here in memory and
        written into the directory before it is renamed into place). The previous one is waited for first. Every
        save first checks that the copies of every replicated tensor (weights and optimizer state) agree."""
        check_replicas(plan_root(self.model), _inner(self.optimizer), self.mesh)
        if not self.args.async_save:
            return super()._save_checkpoint(model, trial)
        self._wait_for_checkpoint()
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            best = self.state.best_global_step and os.path.join(
                run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"
            )
            if best and (best == output_dir or os.path.exists(best)):  # this one is in place once written
                self.state.best_model_checkpoint = best
        optimizer = None if self.args.save_only_model else _inner(self.optimizer)
        self._async_checkpoint = save_model_checkpoint(
            self.model,
            output_dir,
            optimizer=optimizer,
            trainable_only=self._adapters_only,
            async_save=True,
            extra_files=self._checkpoint_files(),
            step_optimizer=_inner(self.optimizer),  # its next step waits for the copy of the weights and state
        )

    def _checkpoint_files(self) -> dict[str, bytes]:
        """This rank's share of the Trainer's own checkpoint files, as the Trainer writes them (into a local scratch
        directory, read back): its RNG state; on rank 0 the scheduler, scaler and `trainer_state.json`."""
        with tempfile.TemporaryDirectory(prefix="optimum-parallel-") as scratch:
            if not self.args.save_only_model:
                self._save_optimizer_and_scheduler(scratch)
                self._save_scaler(scratch)
                Trainer._save_rng_state(self, scratch)  # the Trainer's, without our barrier (nothing on disk yet)
            if self.args.should_save:
                callbacks = self.callback_handler.callbacks + [self.control]
                for cb in [c for c in callbacks if isinstance(c, ExportableState)]:  # as the Trainer does
                    name, state = cb.__class__.__name__, cb.state()
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(state)
                    else:
                        self.state.stateful_callbacks[name] = state
                self.state.save_to_json(os.path.join(scratch, TRAINER_STATE_NAME))
            return {path.name: path.read_bytes() for path in Path(scratch).iterdir()}

    def _wait_for_checkpoint(self) -> None:
        """The async checkpoint in flight renamed into place (a background error is raised here, on every rank), then
        older checkpoints rotated out as the Trainer does after a save (`save_total_limit`)."""
        handle, self._async_checkpoint = self._async_checkpoint, None
        wait_for_pending_save()
        if handle is None:
            return
        handle.wait()
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=str(handle.path.parent),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    @private_override
    def _save_rng_state(self, output_dir: str) -> None:
        """Every rank writes its RNG state before rank 0 writes `trainer_state.json`, the Trainer's last file, so
        its presence means the checkpoint is whole (`find_last_checkpoint`)."""
        super()._save_rng_state(output_dir)
        dist.barrier()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Checkpoints (`_internal_call`) are sharded: each rank's shards (of the adapters only for a PEFT model),
        and the optimizer state unless `save_only_model`. A user's `save_model()` writes a consolidated checkpoint
        `from_pretrained` loads, or for a PEFT model the adapter `PeftModel.from_pretrained` loads."""
        self._wait_for_checkpoint()
        output_dir = Path(output_dir or self.args.output_dir)
        if _internal_call:
            optimizer = None if self.args.save_only_model else _inner(self.optimizer)
            self.parallelizer.save_model_checkpoint(
                self.model, output_dir, optimizer=optimizer, trainable_only=self._adapters_only
            )
            return
        if self._adapters_only:  # a standard PEFT adapter (whole tensors, written by rank 0)
            self.model.save_pretrained(output_dir)
            if self.args.should_save:
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, output_dir / TRAINING_ARGS_NAME)
            dist.barrier()
            return
        staging = output_dir / ".consolidating"  # publishing replaces a directory: do not replace output_dir
        self.parallelizer.save_model_checkpoint(self.model, staging, as_regular=True, as_sharded=False)
        if self.args.should_save:
            for file in staging.iterdir():
                os.replace(file, output_dir / file.name)
            staging.rmdir()
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, output_dir / TRAINING_ARGS_NAME)
        dist.barrier()

    @private_override
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer state went into the sharded checkpoint with the model; only the scheduler is left."""
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _sharded_dir(self, checkpoint: str) -> Path:
        """`checkpoint`, or a copy resharded to the running tp/pp/ep sizes (next to the outputs, removed after use);
        dp, cp and the sharding level need none (the files do not depend on them)."""
        if self._resume_dir is not None and self._resume_dir[0] == checkpoint:
            return self._resume_dir[1]
        saved = read_index(checkpoint).mesh
        tp, pp, ep = self.mesh.size("tp"), self.mesh.size("pp"), self.mesh.size("ep")
        path = Path(checkpoint)
        if (saved.get("tp", 1), saved.get("pp", 1), saved.get("ep", 1)) != (tp, pp, ep):
            path = Path(self.args.output_dir) / f".{Path(checkpoint).name}-resharded-tp{tp}-pp{pp}-ep{ep}"
            current_rank().run(
                lambda: reshard_checkpoint(checkpoint, path, tp=tp, pp=pp, progress=False, ep=ep),
                f"resharding {checkpoint} to tp={tp}, pp={pp}, ep={ep}",
                only_main=True,
            )
        self._resume_dir = (checkpoint, path)
        return path

    @private_override
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Each rank reads its shards (resharded first if the checkpoint was saved at another tp/pp layout)."""
        self.parallelizer.load_model_checkpoint(model or self.model, self._sharded_dir(resume_from_checkpoint))

    @private_override
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer state comes from the sharded checkpoint (its loader reads the model's shards with it)."""
        if checkpoint is None:
            return
        path = self._sharded_dir(checkpoint)
        if read_index(path).optimizer is not None:
            self.parallelizer.load_model_checkpoint(self.model, path, optimizer=_inner(self.optimizer))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        if path != Path(checkpoint):
            dist.barrier()
            if self.args.should_save:
                shutil.rmtree(path, ignore_errors=True)
        self._resume_dir = None

    @private_override
    def _load_best_model(self) -> None:
        """The best checkpoint is a sharded one too (an async one is waited for)."""
        self._wait_for_checkpoint()
        self.parallelizer.load_model_checkpoint(self.model, self._sharded_dir(self.state.best_model_checkpoint))


class ParallelTrainer(ParallelTrainerMixin, Trainer):
    """A `Trainer` over a dp x pp x cp x tp mesh set by `ParallelTrainingArguments`; launch it with `torchrun`.
    See `ParallelTrainerMixin` for the arguments."""
