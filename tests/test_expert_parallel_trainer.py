"""ParallelTrainer with `expert_parallel_size=2` (dp=4, gloo) at sharding levels 0, 1 and 2: the logged loss and
gradient norm of every step equal the single-process `transformers.Trainer`'s on the global batch, on rows whose
labelled tokens differ (right padding, -100 labels), with clipping on."""

from __future__ import annotations

import pytest
from _models import build_model, tiny_config
from test_expert_parallel import MOE
from test_trainer_contract import GLOBAL_BATCH, TOL, common_args, single_process, train_parallel, worst_relative

WORLD_SIZE = 4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hf") / "mixtral"
    build_model(tiny_config("mixtral", **MOE["mixtral"]), seed=3).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory) -> dict:
    args = common_args(str(tmp_path_factory.mktemp("reference")))
    return single_process(hf_dir, {**args, "per_device_train_batch_size": GLOBAL_BATCH})


@pytest.mark.parametrize("level", [0, 1, 2])
def test_trainer_with_expert_parallelism_matches_transformers(pool, hf_dir, reference, tmp_path, level):
    args = {**common_args(str(tmp_path / "out")), "expert_parallel_size": 2, "sharding_level": level}
    args.update(per_device_train_batch_size=GLOBAL_BATCH // WORLD_SIZE, per_device_eval_batch_size=2)
    results = pool.run(train_parallel, hf_dir, args)
    assert len(reference["curve"]) >= 8  # 2 epochs of 4 steps, each with loss and grad_norm
    for result in results:
        worst = worst_relative(result["curve"], reference["curve"])
        assert worst <= TOL, (worst, result["curve"], reference["curve"])
        assert abs(result["eval"] - reference["eval"]) <= TOL * reference["eval"], (result["eval"], reference["eval"])
