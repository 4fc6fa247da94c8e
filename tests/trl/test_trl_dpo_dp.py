"""TRL's DPOTrainer on a parallel model with data parallelism: dp=2 x tp=2 at sharding level 3 (FSDP2) and dp=2 x cp=2
(level 0), each replica half of TRL's batch, and pp=2 x tp=2 log, step by step, what TRL's DPOTrainer logs on one
process with the whole batch (sigmoid, ipo, apo_zero) (gloo, 4 ranks)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy, save_tiny, train_parallel_dpo, trl_reference  # noqa: E402

WORLD_SIZE = 4
TOL = 1e-5  # relative, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)
HALF_BATCH = {"per_device_train_batch_size": 2}  # per replica: TRL's batch of 4 over 2 replicas
DP_TP_L3 = {"tensor_parallel_size": 2, "sharding_level": 3, **HALF_BATCH}
DP_CP = {"context_parallel_size": 2, "sharding_level": 0, **HALF_BATCH}
PP_TP = {"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 2, "tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    hf_dir = save_tiny(tmp_path_factory.mktemp("hf") / "llama")
    perturbed = perturbed_copy(hf_dir, tmp_path_factory.mktemp("perturbed") / "llama")
    done: dict[str, tuple] = {}

    def run(loss_type: str) -> tuple[str, dict, dict]:
        if loss_type not in done:
            expected = trl_reference(hf_dir, str(tmp_path_factory.mktemp("ref")), loss_type=[loss_type])
            moved = trl_reference(perturbed, str(tmp_path_factory.mktemp("ref")), loss_type=[loss_type])
            done[loss_type] = expected, noise_floor(expected, moved)
        return (hf_dir, *done[loss_type])

    return run


@pytest.mark.parametrize("layout", [DP_TP_L3, DP_CP, PP_TP], ids=["dp2-tp2-level3", "dp2-cp2", "pp2-tp2"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "apo_zero"])
def test_dpo_with_data_parallelism_matches_trl_on_one_process(pool, reference, tmp_path, loss_type, layout):
    hf_dir, expected, noise = reference(loss_type)
    results = pool.run(train_parallel_dpo, hf_dir, str(tmp_path), {"loss_type": [loss_type]}, layout)
    for rank, got in enumerate(results):
        worst = check_against(got, expected, noise, TOL)
        print(loss_type, layout, rank, {k: f"{v:.1e}" for k, v in worst.items()})
