"""Parallelizer: the per-model-family entry point (optimum-neuron's API). Its methods translate their arguments into
one `ParallelRequest` (with this API's key names); the family's part is decided here (`family_request.py`) and the
rest by the engine (`validate`, `compose`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ..autoplan.capabilities import Capabilities
from ..checkpoint import AsyncCheckpoint, load_model_checkpoint, save_model_checkpoint
from ..data_parallel.levels import DataParallelConfig
from ..engine.checks import validate
from ..engine.compose import compose_model, optimizer_for_parallel_model
from ..engine.request import PARALLELIZER_KEYS, ParallelRequest, PipelineSettings, RequestKeys
from ..mesh import ParallelMesh, get_mesh
from ..plan.wrappers import plan_root
from .family_request import family_request


class Parallelizer:
    """Base class of the model-family parallelizers.

    A family supplies `plan()` (regex -> style), what it supports (`capabilities`) and, where it needs them,
    `check()` (raise before any weight moves) and `after_plan()` (fix module attributes such as local head counts).
    """

    capabilities = Capabilities()

    def __init_subclass__(cls, **kwargs) -> None:
        """A family written for an earlier release sets `supports_sequence_parallel` / `supports_pipeline_parallel`:
        they still count, folded into its capabilities."""
        super().__init_subclass__(**kwargs)
        legacy = {
            name: cls.__dict__[f"supports_{name}"]
            for name in ("sequence_parallel", "pipeline_parallel")
            if f"supports_{name}" in cls.__dict__
        }
        if legacy:
            cls.capabilities = replace(cls.capabilities, **legacy)

    @classmethod
    def capabilities_for(cls, model: nn.Module) -> Capabilities:
        """What this family supports on `model`: its declaration (a hand-written family knows); an automatic plan
        derives it from the model's structure."""
        return cls.capabilities

    @classmethod
    def plan(
        cls, model: nn.Module, mesh: ParallelMesh, parallelize_embeddings: bool, sequence_parallel_enabled: bool
    ) -> dict:
        raise NotImplementedError(f"{cls.__name__} must define plan()")

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        """Raise ValueError if `model` cannot be split over `mesh` (called before anything changes)."""

    @classmethod
    def after_plan(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        """Adjust module attributes once the plan is applied."""

    @staticmethod
    def base_model_prefix(model: nn.Module) -> str:
        """'model.' for `LlamaForCausalLM`-style wrappers, '' for the bare base model. A wrapper whose declared prefix
        names no child (Llama4ForCausalLM declares its multimodal parent's 'language_model' and holds 'model') takes
        its `model` child."""
        for prefix in (getattr(model, "base_model_prefix", ""), "model"):
            if prefix and isinstance(getattr(model, prefix, None), nn.Module):
                return f"{prefix}."
        return ""

    @classmethod
    def pipeline_split_spec(cls, model: nn.Module) -> str:
        """The layer list the pipeline splits evenly: the decoder layers of the base model."""
        return cls.base_model_prefix(model) + "layers"

    @classmethod
    def request(
        cls,
        parallelize_embeddings: bool = True,
        sequence_parallel_enabled: bool = False,
        pipeline_parallel_input_names: list[str] | None = None,
        pipeline_parallel_num_microbatches: int = 1,
        pipeline_parallel_schedule: str = "1f1b",
        context_parallel_strategy: str = "ring",
        *,
        device: torch.device | str | None = None,
        read_checkpoint: bool = True,
        data_parallel: DataParallelConfig | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        keys: RequestKeys = PARALLELIZER_KEYS,
        **settings,
    ) -> ParallelRequest:
        """This entry point's arguments as one request (`keys`: what the caller calls them; the Trainer passes its own),
        before its family's part (`family_request`) is decided."""
        names = tuple(pipeline_parallel_input_names) if pipeline_parallel_input_names is not None else None
        pipeline = PipelineSettings(None, pipeline_parallel_num_microbatches, pipeline_parallel_schedule, None, names)
        return ParallelRequest(
            parallelize_embeddings=parallelize_embeddings,
            sequence_parallel=sequence_parallel_enabled,
            pipeline=pipeline,
            context_parallel=context_parallel_strategy,
            data_parallel=data_parallel,
            optimizer=optimizer,
            device=device,
            read_checkpoint=read_checkpoint,
            keys=keys,
            **settings,
        )

    @classmethod
    def validate(cls, model: nn.Module, *args, **kwargs) -> None:
        """Raise, changing nothing, if `parallelize` with these arguments (`request`'s: data parallelism at
        `data_parallel` over `optimizer` included) would refuse."""
        validate(cls.request(*args, **kwargs), plan_root(model), get_mesh(), partial(family_request, cls))

    @classmethod
    def parallelize(
        cls,
        model: nn.Module,
        device: torch.device | None = None,
        parallelize_embeddings: bool = True,
        sequence_parallel_enabled: bool = False,
        pipeline_parallel_input_names: list[str] | None = None,
        pipeline_parallel_num_microbatches: int = 1,
        pipeline_parallel_use_zero1_optimizer: bool = False,
        checkpoint_dir: str | Path | None = None,
        pipeline_parallel_schedule: str = "1f1b",
        context_parallel_strategy: str = "ring",
        shared_batch: str = "check",
        compile: bool | str | dict = False,
    ) -> nn.Module:
        """Parallelize `model` over the current mesh (see `init_mesh`) and return it.

        Under pp > 1 the rank keeps only its pipeline stages; train with `model.run_train(**batch)`.
        `pipeline_parallel_use_zero1_optimizer` is accepted for optimum-neuron compatibility: here the
        data-parallel wrappers own gradient averaging whatever the optimizer. The mapping
        {id(original parameter): parallel parameter, or None if it lives on another stage} is left on
        `model.orig_param_to_parallel_param` for `optimizer_for_mp`. On a mesh with cp > 1 the sequence is split
        over cp and attention runs as `context_parallel_strategy`: "ring" or "all_to_all" (heads must divide by cp).
        The ranks of one batch replica (tp, cp, pp) must be given the same batch: `shared_batch` "check" (default)
        verifies it on new input shapes and every 100 forwards, "broadcast" takes the first rank's, "trust" skips.
        `compile` compiles each decoder block with torch.compile: True (inductor), a backend name ("neuron" for
        TorchNeuron) or {"backend": ..., "mode": ..., "dynamic": ...} (`engine/compile.py`).
        A bad request raises on every rank before anything changes (`validate`).
        """
        inner = plan_root(model)  # the transformers model inside a PeftModel: plans name its modules
        # a sharded checkpoint about to be loaded replaces the HF weights: allocate instead of reading them
        request = cls.request(
            parallelize_embeddings,
            sequence_parallel_enabled,
            pipeline_parallel_input_names,
            pipeline_parallel_num_microbatches,
            pipeline_parallel_schedule,
            context_parallel_strategy,
            device=device,
            read_checkpoint=checkpoint_dir is None,
            shared_batch=shared_batch,
            compile=compile,
        )
        mesh = get_mesh()
        composed = compose_model(inner, mesh, validate(request, inner, mesh, partial(family_request, cls)))
        model.orig_param_to_parallel_param = composed.param_map  # optimum-neuron's name, for `optimizer_for_mp`
        if checkpoint_dir is not None:
            cls.load_model_checkpoint(model, checkpoint_dir)
        return model

    @classmethod
    def optimizer_for_mp(
        cls, optimizer: torch.optim.Optimizer, orig_param_to_parallel_param: Mapping[int, nn.Parameter]
    ) -> torch.optim.Optimizer:
        """The same optimizer (class, param groups, hyper-parameters) over the parallel parameters.

        A lazy optimizer (`make_optimizer_constructor_lazy`) is built for the first time here, exactly
        as it was asked for. State already held for an original parameter is cut to the parameter's shard.
        """
        return optimizer_for_parallel_model(optimizer, orig_param_to_parallel_param)

    @classmethod
    def save_model_checkpoint(
        cls,
        model: nn.Module,
        output_dir: str | Path,
        as_regular: bool = False,
        as_sharded: bool = True,
        optimizer: torch.optim.Optimizer | None = None,
        trainable_only: bool = False,
        async_save: bool = False,
        step_optimizer: torch.optim.Optimizer | None = None,
    ) -> Path | AsyncCheckpoint:
        """Save a sharded checkpoint (per-rank safetensors + layout metadata) and/or a regular HF one.

        Call it on every rank. Every split parameter carries its shard spec, so the files reshard to any layout.
        `trainable_only`: just the parameters that train (LoRA adapters), for a model that rebuilds its frozen base.
        `async_save`: copy the shards to host memory and write them in the background; returns a handle whose
        `.wait()` returns the path once the checkpoint is in place (the next save waits for it too). The weights and
        optimizer state are copied in the background before the next step of `optimizer` (or `step_optimizer`,
        when the optimizer's state is not saved), which waits for the copy; with neither, they are copied in the call.
        """
        return save_model_checkpoint(
            model,
            output_dir,
            as_regular=as_regular,
            as_sharded=as_sharded,
            optimizer=optimizer,
            trainable_only=trainable_only,
            async_save=async_save,
            step_optimizer=step_optimizer,
        )

    @classmethod
    def load_model_checkpoint(
        cls, model: nn.Module, load_dir: str | Path, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Load this rank's shards of a sharded checkpoint into a parallelized `model`, and the optimizer state into
        `optimizer` when given (build it with `optimizer_for_mp` first); call on every rank."""
        load_model_checkpoint(model, load_dir, optimizer=optimizer)
