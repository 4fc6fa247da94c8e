"""Data parallelism at sharding levels 0-3 composed with tensor parallelism (dp=2 x tp=2, gloo, 4 ranks),
against one process training on the whole global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _models import build_model, rel_err, tiny_config

STEPS = 5


def global_batch(config, rows: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    """Every row has the same number of labelled tokens, so the mean of per-rank means is the global mean."""
    input_ids = torch.randint(0, config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(3))
    labels = input_ids.clone()
    labels[:, 5] = -100
    return {"input_ids": input_ids, "labels": labels}


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if torch.is_tensor(t) and t.dim() > 0:
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def _optimizer_state(optimizer) -> list:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps this rank's optimizer there
    return [v for state in inner.state.values() for v in state.values()]


def check_sharding_level(level: int, sequence_parallel: bool) -> dict:
    import optimum_parallel as op
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    mesh = op.init_mesh(dp=2, tp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    model = copy.deepcopy(reference)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, sequence_parallel_enabled=sequence_parallel)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = apply_data_parallel(model, optimizer, mesh, DataParallelConfig(sharding_level=level))

    batch = global_batch(config)
    dp_rank = mesh.rank("dp")
    local = {k: v[2 * dp_rank : 2 * dp_rank + 2] for k, v in batch.items()}
    errors = []
    for _ in range(STEPS):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        loss = model(**local).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.group("dp"))
        errors.append(rel_err(mean / 2, ref_loss))
    return {
        "worst_step": max(errors),
        "optimizer_bytes": _local_bytes(_optimizer_state(optimizer)),
        "param_bytes": _local_bytes(model.parameters()),
    }


@pytest.fixture(scope="module")
def results(pool):
    return {level: pool.run(check_sharding_level, level, False) for level in (0, 1, 2, 3)}


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_loss_curve_matches_global_batch(results, level):
    for rank, result in enumerate(results[level]):
        assert result["worst_step"] <= 1e-5, f"level {level} rank {rank}: {result}"


def test_sharding_levels_cut_memory(results):
    for rank in range(4):
        full_state = results[0][rank]["optimizer_bytes"]
        full_params = results[0][rank]["param_bytes"]
        for level in (1, 2, 3):
            assert results[level][rank]["optimizer_bytes"] <= 0.6 * full_state, (level, rank, results)
        assert results[3][rank]["param_bytes"] <= 0.6 * full_params, results
        assert results[2][rank]["param_bytes"] <= 0.6 * full_params  # FSDP keeps shards between steps too


def test_sequence_parallel_composes_with_fsdp(pool):
    for result in pool.run(check_sharding_level, 3, True):
        assert result["worst_step"] <= 1e-5, result


@pytest.mark.parametrize("level", [1, 2, 3])
def test_xla_devices_allow_sharding_level_0_only(level):
    """The check `validate` runs on an XLA mesh (the XLA lane, `make test-xla`, runs it on devices): levels
    1-3 are refused at dp x cp > 1, naming the caller's key and the level XLA allows; at dp x cp = 1 no level acts."""
    from optimum_parallel.data_parallel.levels import DataParallelConfig
    from optimum_parallel.engine.checks import check_data_parallel
    from optimum_parallel.engine.request import PARALLELIZER_KEYS as keys

    config = DataParallelConfig(sharding_level=level)
    with pytest.raises(ValueError, match=rf"^sharding_level={level} is not supported on XLA .*; allowed on XLA: 0 "):
        check_data_parallel(config, None, keys, 2, "xla")
    check_data_parallel(config, None, keys, 1, "xla")
    check_data_parallel(config, None, keys, 2, "cpu")
    check_data_parallel(DataParallelConfig(sharding_level=0), None, keys, 2, "xla")
