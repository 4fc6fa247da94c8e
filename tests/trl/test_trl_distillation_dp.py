"""TRL's DistillationTrainer on a parallel student and teacher with data parallelism: dp=2 x tp=2 at sharding level 3
(FSDP2 on the student; the teacher replicated over dp, frozen), each replica half of TRL's batch, logs step by step
every figure TRL's DistillationTrainer logs on one process with the whole batch (generalized JSD, fixed completions;
gloo, 4 ranks)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _distillation import train_parallel_distillation, trl_reference  # noqa: E402
from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import save_tiny  # noqa: E402

WORLD_SIZE = 4
TOL = 1e-5  # relative, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)
DP_TP_L3 = {"tensor_parallel_size": 2, "sharding_level": 3, "per_device_train_batch_size": 2}


def test_distillation_with_data_parallelism_matches_trl_on_one_process(pool, tmp_path_factory):
    student = save_tiny(str(tmp_path_factory.mktemp("hf") / "student"))
    teacher = perturbed_copy(student, tmp_path_factory.mktemp("hf") / "teacher", scale=0.5)
    moved = perturbed_copy(student, tmp_path_factory.mktemp("perturbed") / "student")
    expected = trl_reference(student, teacher, str(tmp_path_factory.mktemp("ref")), beta=0.5)
    noise = noise_floor(expected, trl_reference(moved, teacher, str(tmp_path_factory.mktemp("ref")), beta=0.5))
    print("noise", {k: f"{v:.1e}" for k, v in noise.items()})
    out = str(tmp_path_factory.mktemp("out"))
    for rank, got in enumerate(pool.run(train_parallel_distillation, student, teacher, out, {"beta": 0.5}, DP_TP_L3)):
        worst = check_against(got, expected, noise, TOL)
        print("dp2-tp2-level3", rank, {k: f"{v:.1e}" for k, v in worst.items()})
