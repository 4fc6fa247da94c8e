"""TRL (`pip install optimum-parallel[trl]`): its trainers with the parallel behaviour of `ParallelTrainer`.

`ParallelSFTTrainer(model, args=ParallelSFTConfig(...), train_dataset=..., processing_class=...)` is TRL's
`SFTTrainer` (dataset preparation, packing, padding-free collation, checkpoints) over a tp / sp / pp / cp / dp / ep
mesh; packed rows keep every document to itself on every layout (`optimum_parallel.packing`)."""

from .grpo import ParallelGRPOConfig, ParallelGRPOTrainer, check_grpo_options
from .sft import ParallelSFTConfig, ParallelSFTTrainer, check_sft_options

__all__ = ["ParallelSFTConfig", "ParallelSFTTrainer", "check_sft_options"]
__all__ += ["ParallelGRPOConfig", "ParallelGRPOTrainer", "check_grpo_options"]
