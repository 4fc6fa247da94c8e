"""ParallelGRPOTrainer at dp=2 x tp=2 (gloo, 4 ranks) logs, step by step, the loss, kl, reward and entropy TRL's
GRPOTrainer logs on one process on the same global batch (completions fixed by the prompt and its place in the
generation batch). Each replica holds 6 of the 12 completions, so the second prompt's group of 4 straddles the two
replicas: its advantages need the rewards of both, gathered over the replicas only (a gather over the 4 processes
would count each completion twice). dp=2 x cp=2: each replica's rows cut over its 2 cp ranks, the gradients averaged
over the 4 dp x cp ranks."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _grpo import print_table, save_tiny_llama, train_parallel, trl_reference, worst_errors  # noqa: E402

WORLD_SIZE = 4
TOL = 1e-5  # relative, per step and metric (fp32; seen: up to 1.4e-6)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("hf") / "llama"))


@pytest.mark.parametrize("sharding_level", [0, 3], ids=["ddp", "fsdp2"])
def test_dp2_tp2_matches_trl_on_one_process(pool, hf_dir, tmp_path, sharding_level):
    reference = trl_reference(hf_dir, str(tmp_path / "reference"))
    layout = {"tensor_parallel_size": 2, "per_device_train_batch_size": 6, "sharding_level": sharding_level}
    results = pool.run(train_parallel, hf_dir, str(tmp_path / "parallel"), **layout)
    for rank, result in enumerate(results):
        got = result["logged"]
        assert sorted(got) == sorted(reference) == [1, 2, 3], (rank, got)
        worst = worst_errors(got, reference)
        if rank == 0:
            print_table(f"dp=2 x tp=2 level {sharding_level}", got, reference)
        assert max(worst.values()) <= TOL, (rank, worst, got, reference)


def test_dp2_cp2_matches_trl_on_one_process(pool, hf_dir, tmp_path):
    reference = trl_reference(hf_dir, str(tmp_path / "reference"))
    layout = {"context_parallel_size": 2, "per_device_train_batch_size": 6}
    results = pool.run(train_parallel, hf_dir, str(tmp_path / "parallel"), **layout)
    for rank, result in enumerate(results):
        got = result["logged"]
        assert sorted(got) == sorted(reference) == [1, 2, 3], (rank, got)
        worst = worst_errors(got, reference)
        if rank == 0:
            print_table("dp=2 x cp=2", got, reference)
        assert max(worst.values()) <= TOL, (rank, worst, got, reference)
