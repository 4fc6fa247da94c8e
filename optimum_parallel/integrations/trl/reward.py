"""TRL's `RewardTrainer` with `ParallelTrainerMixin`: an outcome reward model trained on a tp / sp / dp (sharding
levels 0-3) mesh, equal to TRL's `RewardTrainer` on one process.

TRL's trainer is used as it is (dataset preparation, the collator that puts chosen and rejected rows in one batch, the
Bradley-Terry loss with its margin and centring, the metrics). The model is `AutoModelForSequenceClassification` with
one label, as TRL loads it (a path: each rank reads its slice, `float32` unless `model_init_kwargs` says otherwise, the
seed set first so a head missing from a causal checkpoint is drawn as TRL draws it). Its value head `score` (hidden ->
1) stays whole on every rank: the hidden states it reads are whole after the last row-parallel layer, so each tp rank
computes the same head gradient and nothing is averaged; under sp the plan gathers the sequence at its input (split
backward, `frontends/family_request.py`), so the last non-padding token it pools is the row's own.

Refused before anything changes, by name (`check_reward_options`): cp and pp (the engine's context split and pipeline
stages are built for an LM head; the pooled token of a row lives on one cp rank or the last stage), and
`quantization_config`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, set_seed
from trl import RewardConfig, RewardTrainer
from trl.trainer.reward_trainer import suppress_seqcls_warning

from ..transformers.internals import check_overrides
from ..transformers.trainer import ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments


@dataclass
class ParallelRewardConfig(RewardConfig, ParallelTrainingArguments):
    """TRL's `RewardConfig` plus the mesh and parallelism settings of `ParallelTrainingArguments`; `RewardConfig`
    first, so TRL's defaults (learning rate, bf16, logging_steps, ...) win over `TrainingArguments`' own."""


def check_reward_options(args: RewardConfig, quantization_config: Any = None) -> None:
    """ValueError naming the first option ParallelRewardTrainer cannot run."""
    for option, why in (
        ("context_parallel_size", "the context split of the engine is built for a causal LM head, and the pooled "
         "last token of a row lives on one cp rank"),
        ("pipeline_parallel_size", "the pipeline's stages end in an LM head, not a sequence-classification head"),
    ):  # fmt: skip
        size = getattr(args, option)
        if size > 1:
            raise ValueError(f"{option}={size} is not supported by ParallelRewardTrainer ({why}); allowed: 1")
    if quantization_config is not None:
        raise ValueError(
            "quantization_config is not supported by ParallelRewardTrainer (the parallel layers hold plain weights); "
            "allowed: None"
        )


def reward_model_kwargs(args: RewardConfig, model_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """What TRL passes `from_pretrained` for a reward model given as a path: `model_init_kwargs` (or the caller's
    `model_kwargs`), one label, `float32` unless a dtype is named (transformers' own default would be the config's)."""
    kwargs = dict(args.model_init_kwargs or {}) | dict(model_kwargs or {})
    dtype = kwargs.get("dtype", "float32")
    kwargs["dtype"] = getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else dtype
    kwargs.pop("device_map", None)  # each rank places its own slice
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs | {"num_labels": 1}


class ParallelRewardTrainer(ParallelTrainerMixin, RewardTrainer):
    """TRL's `RewardTrainer` on a parallel model (see the module docstring); `args` is a `ParallelRewardConfig`,
    `model` a sequence-classification model or a checkpoint path (a causal LM's gets a new one-label head)."""

    def __init__(
        self,
        model: PreTrainedModel | str | os.PathLike,
        args: ParallelRewardConfig | None = None,
        *,
        model_kwargs: dict[str, Any] | None = None,
        quantization_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, ParallelRewardConfig):
            raise TypeError(f"ParallelRewardTrainer needs ParallelRewardConfig arguments, got {type(args).__name__}")
        check_reward_options(args, quantization_config)
        if isinstance(model, (str, os.PathLike)):
            model_kwargs = reward_model_kwargs(args, model_kwargs)
        set_seed(args.seed)  # as TRL, before the model is built: a new head is drawn from the same numbers
        with suppress_seqcls_warning():
            super().__init__(
                model, args, model_class=AutoModelForSequenceClassification, model_kwargs=model_kwargs, **kwargs
            )
        self._tp_size = self.get_tp_size()  # TRL divides its token count over the world by this


check_overrides(ParallelRewardTrainer, RewardTrainer)
