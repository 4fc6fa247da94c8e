"""TRL's DistillationTrainer on a parallel student and teacher: ParallelDistillationTrainer at tp=2 and tp=2 + sp logs,
step by step, every figure TRL's DistillationTrainer logs on one process (loss, grad_norm, entropy, num_tokens, the
completion lengths) for the generalized JSD (beta 0.5), the forward KL (beta 0) and the reverse KL (beta 1, a
temperature of 0.7), on completions fixed by the prompt and the step (uneven lengths, padded); cp and pp are refused
by name before anything runs (gloo, 2 ranks). dp=2 x tp=2 at sharding level 3: test_trl_distillation_dp.py."""

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
CASES = {
    "tp2-jsd": ({"beta": 0.5}, TP2),
    "sp-jsd": ({"beta": 0.5}, SP),
    "tp2-forward-kl": ({"beta": 0.0}, TP2),
    "sp-reverse-kl-t0.7": ({"beta": 1.0, "temperature": 0.7}, SP),
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


def refused(student: str, output_dir: str, layout: dict) -> str:
    from _distillation import distillation_args

    from optimum_parallel.integrations.trl import ParallelDistillationConfig, ParallelDistillationTrainer

    try:
        args = ParallelDistillationConfig(**distillation_args(output_dir, **layout))
        ParallelDistillationTrainer(student, teacher_model=student, args=args, train_dataset=None)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "layout,words",
    [
        ({"context_parallel_size": 2}, "context_parallel_size=2 is not supported by ParallelDistillationTrainer"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not supported by ParallelDistillationTrainer"),
    ],
    ids=["cp2", "pp2"],
)
def test_layouts_it_cannot_run_are_refused_by_name_before_anything_runs(pool, models, tmp_path, layout, words):
    """Refused before a model is loaded or the dataset read (no dataset is even given)."""
    for message in pool.run(refused, models["student"], str(tmp_path), layout):
        assert words in message and "allowed: 1" in message, message
