"""Shared by the distillation tests: GRPO's tiny Llama as the student and a teacher made from it (every weight moved by
a relative 0.5 x N(0, 1)), GRPO's prompts of several lengths, completions fixed by the prompt and the step (GRPO's
`fixed_completion`: 1-8 tokens, EOS at several places, some truncated, so rows are padded unevenly), TRL's
DistillationTrainer on one process as the reference and ParallelDistillationTrainer on a rank."""

from __future__ import annotations

from _grpo import COMPLETION_LENGTH, fixed_completion, prompts

IGNORED = ("learning_rate", "epoch", "step_time")  # the schedule's, the sampler's and the clock's, not the model's


def distillation_args(output_dir: str, **extra) -> dict:
    return dict(
        output_dir=output_dir, per_device_train_batch_size=4, max_steps=3, learning_rate=0.5, optim="sgd",
        logging_steps=1, seed=0, report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no",
        ddp_timeout=60, bf16=False, gradient_checkpointing=False, max_completion_length=COMPLETION_LENGTH,
        model_init_kwargs={"dtype": "float32"}, teacher_model_init_kwargs={"dtype": "float32"},
    ) | extra  # fmt: skip


class FixedCompletions:
    """Completions by `fixed_completion` of the prompt and the step: the same on every layout."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        return [fixed_completion(list(ids), 0, self.state.global_step) for ids in prompt_ids]


def figures(log_history: list[dict]) -> dict[int, dict[str, float]]:
    """Every figure logged per training step, but the schedule's and the clock's."""
    return {
        e["step"]: {k: v for k, v in e.items() if k not in (*IGNORED, "step")}
        for e in log_history
        if "loss" in e and "train_runtime" not in e
    }


def trl_reference(student: str, teacher: str, output_dir: str, **options) -> dict[int, dict[str, float]]:
    """TRL's DistillationTrainer on one process (fixed completions): its figures per step."""
    from transformers import AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    class Fixed(FixedCompletions, DistillationTrainer):
        pass

    trainer = Fixed(
        student, teacher_model=teacher, args=DistillationConfig(**distillation_args(output_dir, **options)),
        train_dataset=prompts(), processing_class=AutoTokenizer.from_pretrained(student),
    )  # fmt: skip
    trainer.train()
    return figures(trainer.state.log_history)


def train_parallel_distillation(
    student: str, teacher: str, output_dir: str, options: dict, layout: dict
) -> dict[int, dict[str, float]]:
    """ParallelDistillationTrainer on this rank (a pool task, fixed completions): its figures per step."""
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelDistillationConfig, ParallelDistillationTrainer

    class Fixed(FixedCompletions, ParallelDistillationTrainer):
        pass

    args = ParallelDistillationConfig(**distillation_args(output_dir, **options, **layout))
    trainer = Fixed(
        student, teacher_model=teacher, args=args, train_dataset=prompts(),
        processing_class=AutoTokenizer.from_pretrained(student),
    )  # fmt: skip
    trainer.train()
    return figures(trainer.state.log_history)
