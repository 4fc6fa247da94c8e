"""TRL's DistillationTrainer on a parallel student and teacher: ParallelDistillationTrainer at tp=2, tp=2 + sp and pp=2
logs, step by step, every figure TRL's DistillationTrainer logs on one process (loss, grad_norm, entropy, num_tokens,
the completion lengths) for the generalized JSD (beta 0.5), the forward KL (beta 0) and the reverse KL (beta 1), some
at a temperature of 0.7, on completions fixed by the prompt and the step (uneven lengths, padded); at cp=2 and pp=2
with the completions TRL's own sampling draws (through the cache-free generation: the same tokens as on one process);
pp with cp is refused by name before anything runs (gloo, 2 ranks). More cp: test_trl_distillation_cp.py; dp=2 x tp=2
at sharding level 3 and cp=2 x tp=2: test_trl_distillation_dp.py."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _distillation import train_parallel_distillation, trl_reference  # noqa: E402
from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import save_tiny  # noqa: E402

WORLD_SIZE = 2
TOL = 1e-5  # relative, per step and figure, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)

TP2 = {"tensor_parallel_size": 2}
SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
PP2 = {"pipeline_parallel_size": 2}
CASES = {
    "tp2-jsd": ({"beta": 0.5}, TP2),
    "sp-jsd": ({"beta": 0.5}, SP),
    "tp2-forward-kl": ({"beta": 0.0}, TP2),
    "sp-reverse-kl-t0.7": ({"beta": 1.0, "temperature": 0.7}, SP),
    "pp2-jsd": ({"beta": 0.5}, PP2),
    "pp2-reverse-kl-t0.7": ({"beta": 1.0, "temperature": 0.7}, PP2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The student, a teacher made from it and the student perturbed by relative 1e-7 (for the noise floor)."""
    student = save_tiny(str(tmp_path_factory.mktemp("hf") / "student"))
    return {
        "student": student,
        "teacher": perturbed_copy(student, tmp_path_factory.mktemp("hf") / "teacher", scale=0.5),
        "moved": perturbed_copy(student, tmp_path_factory.mktemp("perturbed") / "student"),
    }


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    done: dict[str, tuple] = {}

    def run(**options) -> tuple[dict, dict]:
        key = repr(sorted(options.items()))
        if key not in done:
            teacher = models["teacher"]
            expected = trl_reference(models["student"], teacher, str(tmp_path_factory.mktemp("ref")), **options)
            moved = trl_reference(models["moved"], teacher, str(tmp_path_factory.mktemp("ref")), **options)
            done[key] = expected, noise_floor(expected, moved)
            print("noise", options, {k: f"{v:.1e}" for k, v in done[key][1].items()})
        return done[key]

    return run


@pytest.mark.parametrize("case", list(CASES))
def test_distillation_matches_trl_on_one_process(pool, models, reference, tmp_path, case):
    options, layout = CASES[case]
    expected, noise = reference(**options)
    assert len(expected) == 3 and expected[1]["loss"] > 0, expected
    student, teacher = models["student"], models["teacher"]
    results = pool.run(train_parallel_distillation, student, teacher, str(tmp_path), options, layout)
    for rank, got in enumerate(results):
        worst = check_against(got, expected, noise, TOL)
        print(case, rank, {k: f"{v:.1e}" for k, v in worst.items()})


def sampled_trl_reference(student: str, teacher: str, output_dir: str, **options) -> dict[int, dict[str, float]]:
    """TRL's DistillationTrainer on one process, sampling its own completions."""
    from _distillation import distillation_args, figures
    from _grpo import prompts
    from transformers import AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    trainer = DistillationTrainer(
        student, teacher_model=teacher, args=DistillationConfig(**distillation_args(output_dir, **options)),
        train_dataset=prompts(), processing_class=AutoTokenizer.from_pretrained(student),
    )  # fmt: skip
    trainer.train()
    return figures(trainer.state.log_history)


def sampled_parallel(
    student: str, teacher: str, output_dir: str, options: dict, layout: dict
) -> dict[int, dict[str, float]]:
    """ParallelDistillationTrainer on this rank, sampling its own completions (a pool task)."""
    from _distillation import distillation_args, figures
    from _grpo import prompts
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelDistillationConfig, ParallelDistillationTrainer

    args = ParallelDistillationConfig(**distillation_args(output_dir, **options, **layout))
    trainer = ParallelDistillationTrainer(
        student, teacher_model=teacher, args=args, train_dataset=prompts(),
        processing_class=AutoTokenizer.from_pretrained(student),
    )  # fmt: skip
    trainer.train()
    return figures(trainer.state.log_history)


@pytest.fixture(scope="module")
def sampled_reference(models, tmp_path_factory) -> tuple[dict, dict]:
    """TRL's reverse KL on one process with its own sampling, and its fp32 noise floor."""
    teacher = models["teacher"]
    expected = sampled_trl_reference(models["student"], teacher, str(tmp_path_factory.mktemp("ref")), beta=1.0)
    moved = sampled_trl_reference(models["moved"], teacher, str(tmp_path_factory.mktemp("ref")), beta=1.0)
    return expected, noise_floor(expected, moved)


@pytest.mark.parametrize("layout", [{"context_parallel_size": 2}, PP2], ids=["cp2", "pp2"])
def test_sampled_completions_match_trl_on_one_process(pool, models, sampled_reference, tmp_path, layout):
    """The student samples (temperature 1) without a kv cache (every new token a forward of the whole rows: over
    the cp ranks, or through the pipeline's stages), from the seed TRL gives its process: the same completions as
    TRL's, so the same figures (the reverse KL)."""
    options, (expected, noise) = {"beta": 1.0}, sampled_reference
    results = pool.run(sampled_parallel, models["student"], models["teacher"], str(tmp_path), options, layout)
    assert results[0] == results[1]
    for rank, got in enumerate(results):
        worst = check_against(got, expected, noise, TOL)
        print("sampled", layout, rank, {k: f"{v:.1e}" for k, v in worst.items()})


EVALUATION = {"beta": 0.5, "eval_strategy": "steps", "eval_steps": 3, "per_device_eval_batch_size": 4}


def evaluated(student: str, teacher: str, output_dir: str, layout: dict | None) -> dict[str, float]:
    """The evaluation after step 3 (fixed completions; TRL's trainer on one process where `layout` is None, else
    ParallelDistillationTrainer on this rank): its model figures."""
    from _distillation import FixedCompletions, distillation_args
    from _grpo import prompts
    from transformers import AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    from optimum_parallel.integrations.trl import ParallelDistillationConfig, ParallelDistillationTrainer

    trainer_class, config = (
        (DistillationTrainer, DistillationConfig) if layout is None
        else (ParallelDistillationTrainer, ParallelDistillationConfig)
    )  # fmt: skip

    class Fixed(FixedCompletions, trainer_class):
        pass

    trainer = Fixed(
        student, teacher_model=teacher, args=config(**distillation_args(output_dir, **EVALUATION, **(layout or {}))),
        train_dataset=prompts(), eval_dataset=prompts(8), processing_class=AutoTokenizer.from_pretrained(student),
    )  # fmt: skip
    trainer.train()
    (logged,) = [e for e in trainer.state.log_history if "eval_loss" in e]
    return {k: v for k, v in logged.items() if k in ("eval_loss", "eval_entropy", "eval_num_tokens")}


@pytest.mark.parametrize("layout", [{"context_parallel_size": 2}, PP2], ids=["cp2", "pp2"])
def test_evaluation_matches_trl_on_one_process(pool, models, tmp_path, layout):
    """The evaluation loss on completions of the evaluation prompts (TRL's `prediction_step`: without a gradient,
    so under cp the logits come gathered over cp, under pp from the pipelines' forwards) after 3 steps."""
    expected = evaluated(models["student"], models["teacher"], str(tmp_path / "ref"), None)
    for got in pool.run(evaluated, models["student"], models["teacher"], str(tmp_path), layout):
        assert sorted(got) == sorted(expected), (got, expected)
        for key, value in expected.items():
            assert abs(got[key] - value) <= TOL * abs(value), (key, got, expected)


def refused(student: str, output_dir: str, layout: dict) -> str:
    from _distillation import distillation_args

    from optimum_parallel.integrations.trl import ParallelDistillationConfig, ParallelDistillationTrainer

    try:
        args = ParallelDistillationConfig(**distillation_args(output_dir, **layout))
        ParallelDistillationTrainer(student, teacher_model=student, args=args, train_dataset=None)
    except ValueError as err:
        return str(err)
    return "no error"


def test_pipeline_with_context_parallelism_is_refused_by_name_before_anything_runs(pool, models, tmp_path):
    """Refused before a model is loaded or the dataset read (no dataset is even given)."""
    layout = {"pipeline_parallel_size": 2, "context_parallel_size": 2}
    for message in pool.run(refused, models["student"], str(tmp_path), layout):
        assert "pipeline_parallel_size=2 with context_parallel_size=2 is not supported" in message, message
        assert "allowed with pp > 1: context_parallel_size=1" in message, message
