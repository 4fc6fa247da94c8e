"""What the RLOO tests share with the GRPO ones (`_grpo.py`: the tiny models, prompts, rewards, arguments and fixed
completions): TRL's `RLOOTrainer` on one process and `ParallelRLOOTrainer` on a rank, both with completions fixed by
the prompt, its place in the generation batch and the step (RLOO's `_generate_single_turn` returns the completion ids
only), and every figure they log per step."""

from __future__ import annotations

import torch
from _grpo import even_tokens, every_figure, fixed_completion, grpo_args, prompts, short


class FixedCompletions:
    """`_grpo.FixedCompletions` with RLOO's signature: the process (replica) index places the prompts in the batch."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        first = self.accelerator.process_index * len(prompt_ids)
        step = self.state.global_step
        return [fixed_completion(list(ids), first + i, step) for i, ids in enumerate(prompt_ids)]


def common(hf_dir: str) -> dict:
    from transformers import AutoTokenizer

    return dict(reward_funcs=[even_tokens, short], train_dataset=prompts(), eval_dataset=prompts(6),
                processing_class=AutoTokenizer.from_pretrained(hf_dir))  # fmt: skip


def trl_reference(hf_dir: str, output_dir: str, **options) -> dict[int, dict[str, float]]:
    """TRL's RLOOTrainer on this one process (fixed completions): every figure it logged per step."""
    from trl import RLOOConfig, RLOOTrainer

    class FixedRLOOTrainer(FixedCompletions, RLOOTrainer):
        pass

    trainer = FixedRLOOTrainer(hf_dir, args=RLOOConfig(**grpo_args(output_dir, **options)), **common(hf_dir))
    trainer.train()
    return every_figure(trainer.state.log_history)


def train_parallel(hf_dir: str, output_dir: str, fixed: bool = True, **options) -> dict:
    """ParallelRLOOTrainer on this rank (fixed completions unless `fixed=False`): every figure it logged per step and
    the completions it logged."""
    from optimum_parallel.integrations.trl import ParallelRLOOConfig, ParallelRLOOTrainer

    class FixedParallelRLOOTrainer(FixedCompletions, ParallelRLOOTrainer):
        pass

    args = ParallelRLOOConfig(**grpo_args(output_dir, **options))
    trainer = (FixedParallelRLOOTrainer if fixed else ParallelRLOOTrainer)(
        hf_dir, args=args, model_kwargs={"dtype": torch.float32}, **common(hf_dir)
    )
    trainer.train()
    return {"every": every_figure(trainer.state.log_history), "completions": list(trainer._logs["completion"])}
