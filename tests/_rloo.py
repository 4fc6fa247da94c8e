"""What the RLOO tests share with the GRPO ones (`_grpo.py`: the tiny models, prompts, rewards, arguments and fixed
completions): TRL's `RLOOTrainer` on one process and `ParallelRLOOTrainer` on a rank, both with completions fixed by
the prompt, its place in the generation batch and the step (RLOO's `_generate_single_turn` returns the completion ids
only), and every figure they log per step; or both with TRL's real generation, the completion ids each drew recorded
(`fixed=False`: test_trl_rloo_sampling.py)."""

from __future__ import annotations

import torch
from _grpo import even_tokens, every_figure, fixed_completion, grpo_args, prompts, short


class FixedCompletions:
    """`_grpo.FixedCompletions` with RLOO's signature: the process (replica) index places the prompts in the batch."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        first = self.accelerator.process_index * len(prompt_ids)
        step = self.state.global_step
        return [fixed_completion(list(ids), first + i, step) for i, ids in enumerate(prompt_ids)]


class RecordedCompletions:
    """TRL's real generation, each call's completion ids kept in order (`self.drawn`): the tokens a layout sampled."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        out = super()._generate_single_turn(prompt_ids, images, multimodal_fields)
        self.__dict__.setdefault("drawn", []).append([list(map(int, ids)) for ids in out])
        return out


class RecordedEvalLosses:
    """Each evaluation batch's loss on this process, in order (`self.eval_losses`)."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        self.__dict__.setdefault("eval_losses", []).append(float(loss))
        return loss, logits, labels


def common(hf_dir: str) -> dict:
    from transformers import AutoTokenizer

    return dict(reward_funcs=[even_tokens, short], train_dataset=prompts(), eval_dataset=prompts(6),
                processing_class=AutoTokenizer.from_pretrained(hf_dir))  # fmt: skip


def trl_reference(hf_dir: str, output_dir: str, fixed: bool = True, **options):
    """TRL's RLOOTrainer on this process (fixed completions): every figure it logged per step. With `fixed=False`,
    TRL's real generation: {"every": those figures, "drawn": the completion ids of every generation, in order,
    "eval_losses": each evaluation batch's loss on this process}; on a pool's ranks (torch.distributed set up) TRL
    runs on that many processes."""
    from trl import RLOOConfig, RLOOTrainer

    class FixedRLOOTrainer(FixedCompletions, RLOOTrainer):
        pass

    class SampledRLOOTrainer(RecordedCompletions, RecordedEvalLosses, RLOOTrainer):
        pass

    args = RLOOConfig(**grpo_args(output_dir, **options))
    trainer = (FixedRLOOTrainer if fixed else SampledRLOOTrainer)(hf_dir, args=args, **common(hf_dir))
    trainer.train()
    if not fixed:
        history = trainer.state.log_history
        return {"every": every_figure(history), "drawn": trainer.drawn, "eval_losses": trainer.eval_losses}
    return every_figure(trainer.state.log_history)


def train_parallel(hf_dir: str, output_dir: str, fixed: bool = True, **options) -> dict:
    """ParallelRLOOTrainer on this rank (fixed completions unless `fixed=False`): every figure it logged per step, the
    completions it logged, the completion ids it drew (`fixed=False`) and its replica's index."""
    from optimum_parallel.integrations.trl import ParallelRLOOConfig, ParallelRLOOTrainer

    class FixedParallelRLOOTrainer(FixedCompletions, ParallelRLOOTrainer):
        pass

    class SampledParallelRLOOTrainer(RecordedCompletions, ParallelRLOOTrainer):
        pass

    args = ParallelRLOOConfig(**grpo_args(output_dir, **options))
    trainer = (FixedParallelRLOOTrainer if fixed else SampledParallelRLOOTrainer)(
        hf_dir, args=args, model_kwargs={"dtype": torch.float32}, **common(hf_dir)
    )
    trainer.train()
    return {"every": every_figure(trainer.state.log_history), "completions": list(trainer._logs["completion"]),
            "drawn": getattr(trainer, "drawn", None), "replica": trainer.mesh.rank("batch")}  # fmt: skip
