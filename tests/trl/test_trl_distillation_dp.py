"""TRL's DistillationTrainer on a parallel student and teacher on 4 ranks (gloo): dp=2 x tp=2 at sharding level 3
(FSDP2 on the student; the teacher replicated over dp, frozen), each replica half of TRL's batch; cp=2 x tp=2 (each
rank both models' logits of its chunks of the rows and its vocabulary slice; the per-token divergences summed over
the slices, then gathered over cp); pp=2 x tp=2 (both models' pipelines, the divergence on the last stage's
vocabulary slices); cp=2 x dp=2 and pp=2 x dp=2 (each replica half of TRL's batch): each logs step by step every
figure TRL's DistillationTrainer logs on one process with the whole batch (generalized JSD, fixed completions)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _distillation import train_parallel_distillation, trl_reference  # noqa: E402
from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import save_tiny  # noqa: E402

WORLD_SIZE = 4
TOL = 1e-5  # relative, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)
LAYOUTS = {
    "dp2-tp2-level3": {"tensor_parallel_size": 2, "sharding_level": 3, "per_device_train_batch_size": 2},
    "cp2-tp2": {"tensor_parallel_size": 2, "context_parallel_size": 2},
    "pp2-tp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    "cp2-dp2": {"context_parallel_size": 2, "per_device_train_batch_size": 2},
    "pp2-dp2": {"pipeline_parallel_size": 2, "per_device_train_batch_size": 2},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[str, str, dict, dict]:
    """The student, its teacher, TRL's figures on one process and their fp32 noise floor (TRL from the student x
    (1 + 1e-7 N))."""
    student = save_tiny(str(tmp_path_factory.mktemp("hf") / "student"))
    teacher = perturbed_copy(student, tmp_path_factory.mktemp("hf") / "teacher", scale=0.5)
    moved = perturbed_copy(student, tmp_path_factory.mktemp("perturbed") / "student")
    expected = trl_reference(student, teacher, str(tmp_path_factory.mktemp("ref")), beta=0.5)
    noise = noise_floor(expected, trl_reference(moved, teacher, str(tmp_path_factory.mktemp("ref")), beta=0.5))
    print("noise", {k: f"{v:.1e}" for k, v in noise.items()})
    return student, teacher, expected, noise


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_distillation_on_four_ranks_matches_trl_on_one_process(pool, setup, tmp_path, layout):
    student, teacher, expected, noise = setup
    results = pool.run(train_parallel_distillation, student, teacher, str(tmp_path), {"beta": 0.5}, LAYOUTS[layout])
    for rank, got in enumerate(results):
        worst = check_against(got, expected, noise, TOL)
        print(layout, rank, {k: f"{v:.1e}" for k, v in worst.items()})
