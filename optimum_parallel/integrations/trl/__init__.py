"""TRL (`pip install optimum-parallel[trl]`): its trainers with the parallel behaviour of `ParallelTrainer`.

`ParallelSFTTrainer(model, args=ParallelSFTConfig(...), train_dataset=..., processing_class=...)` is TRL's
`SFTTrainer` (dataset preparation, packing, padding-free collation, checkpoints) over a tp / sp / pp / cp / dp / ep
mesh; packed rows keep every document to itself on every layout (`optimum_parallel.packing`).
`ParallelDPOTrainer(model, args=ParallelDPOConfig(...), train_dataset=..., processing_class=...)` is TRL's
`DPOTrainer` over a tp / sp / cp / pp / dp mesh, its policy and reference both parallel. Both read per-token
log-probabilities, entropy and token accuracy with the vocab-parallel log-softmax
(`optimum_parallel.tensor_parallel.logprobs`), never gathering the vocabulary.
`ParallelGRPOTrainer(model, reward_funcs=..., args=ParallelGRPOConfig(...), train_dataset=...)` is TRL's
`GRPOTrainer` over a tp / sp / dp mesh: completions sampled by the parallel model's own generate, each scored once.
`ParallelRLOOTrainer(model, reward_funcs=..., args=ParallelRLOOConfig(...), train_dataset=...)` is TRL's
`RLOOTrainer` over a tp / sp / cp / dp mesh, on GRPO's parallel generation and scoring.
`ParallelKTOTrainer(model, args=ParallelKTOConfig(...), train_dataset=..., processing_class=...)` is TRL's
`KTOTrainer` over a tp / sp / cp / pp / dp mesh, its policy and reference both parallel (as DPO's).
`ParallelRewardTrainer(model, args=ParallelRewardConfig(...), train_dataset=..., processing_class=...)` is TRL's
`RewardTrainer` over a tp / sp / dp mesh: a one-label sequence-classification model, its value head whole on every
rank.
`ParallelDistillationTrainer(model, teacher_model=..., args=ParallelDistillationConfig(...), train_dataset=...)` is
TRL's `DistillationTrainer` over a tp / sp / dp mesh, the teacher parallel like DPO's reference."""

from .distillation import ParallelDistillationConfig, ParallelDistillationTrainer, check_distillation_options
from .dpo import ParallelDPOConfig, ParallelDPOTrainer, check_dpo_options
from .fused_head import install_fused_head
from .grpo import ParallelGRPOConfig, ParallelGRPOTrainer, check_grpo_options
from .kto import ParallelKTOConfig, ParallelKTOTrainer, check_kto_options
from .reward import ParallelRewardConfig, ParallelRewardTrainer, check_reward_options
from .rloo import ParallelRLOOConfig, ParallelRLOOTrainer, check_rloo_options
from .sft import ParallelSFTConfig, ParallelSFTTrainer, check_sft_options

__all__ = [
    "ParallelDistillationConfig",
    "ParallelDistillationTrainer",
    "ParallelDPOConfig",
    "ParallelDPOTrainer",
    "ParallelGRPOConfig",
    "ParallelGRPOTrainer",
    "ParallelKTOConfig",
    "ParallelKTOTrainer",
    "ParallelRewardConfig",
    "ParallelRewardTrainer",
    "ParallelRLOOConfig",
    "ParallelRLOOTrainer",
    "ParallelSFTConfig",
    "ParallelSFTTrainer",
    "check_distillation_options",
    "check_dpo_options",
    "check_grpo_options",
    "check_kto_options",
    "check_reward_options",
    "check_rloo_options",
    "check_sft_options",
    "install_fused_head",
]
