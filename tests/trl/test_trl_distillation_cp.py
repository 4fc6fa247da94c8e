"""TRL's DistillationTrainer on a context-parallel student and teacher (cp=2, gloo, 2 ranks): each cp rank runs both
models on its chunks of every row, the per-token divergences and entropies are gathered over cp (the gradient: this
rank's part, times cp, averaged over dp x cp), so ParallelDistillationTrainer logs, step by step, every figure TRL's
DistillationTrainer logs on one process (loss, grad_norm, entropy, num_tokens, the completion lengths): the
generalized JSD and the forward KL at a temperature of 0.7 on completions fixed by the prompt and the step (uneven
lengths, left-padded prompts). Sampled completions at cp=2: test_trl_distillation.py; cp=2 x tp=2:
test_trl_distillation_dp.py."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _distillation import train_parallel_distillation, trl_reference  # noqa: E402
from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import save_tiny  # noqa: E402

WORLD_SIZE = 2
TOL = 1e-5  # relative, per step and figure, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)
CP2 = {"context_parallel_size": 2}
CASES = {
    "cp2-jsd": {"beta": 0.5},
    "cp2-forward-kl-t0.7": {"beta": 0.0, "temperature": 0.7},
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


def expected_and_noise(models: dict, tmp_path, **options) -> tuple[dict, dict]:
    expected = trl_reference(models["student"], models["teacher"], str(tmp_path / "ref"), **options)
    moved = trl_reference(models["moved"], models["teacher"], str(tmp_path / "moved"), **options)
    noise = noise_floor(expected, moved)
    print("noise", options, {k: f"{v:.1e}" for k, v in noise.items()})
    return expected, noise


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_matches_trl_on_one_process(pool, models, tmp_path, case):
    options = CASES[case]
    expected, noise = expected_and_noise(models, tmp_path, **options)
    assert len(expected) == 3 and expected[1]["loss"] > 0, expected
    results = pool.run(train_parallel_distillation, models["student"], models["teacher"], str(tmp_path), options, CP2)
    for rank, got in enumerate(results):
        worst = check_against(got, expected, noise, TOL)
        print(case, rank, {k: f"{v:.1e}" for k, v in worst.items()})
