"""TRL (`pip install optimum-parallel[trl]`): its trainers with the parallel behaviour of `ParallelTrainer`.

`ParallelSFTTrainer`, `ParallelDPOTrainer`, `ParallelKTOTrainer`, `ParallelGRPOTrainer`, `ParallelRLOOTrainer`,
`ParallelRewardTrainer` and `ParallelDistillationTrainer`, each with its `Parallel...Config` and `check_..._options`,
are TRL's trainers of the same names on a parallel mesh (each module says which layouts); `install_fused_head` gives a
parallel model TRL's fused LM head. Calls and layouts: docs/module_notes.md."""

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
