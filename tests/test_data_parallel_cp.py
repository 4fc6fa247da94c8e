"""Data parallelism and checkpoints on meshes with a cp dim (gloo, 4 ranks): every dp replica its own rows.

Each cp rank computes the loss of its load-balanced share of the sequence (ring attention over all of it) and
its backward is scaled by cp, so averaging gradients over dp x cp must give the single-device gradient of the
global batch, at every sharding level, with and without pp; checkpoints must not depend on cp.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from _checks import train_step
from _models import build_model, rel_err, tiny_config
from torch.distributed.tensor import DTensor

WORLD_SIZE = 4  # worker processes of this module's `pool` (conftest.py)
SEQ = 17  # not a multiple of 2 x cp: padded inside
TOL = 1e-5


def global_batch(config, rows: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, config.vocab_size, (rows, SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def local_batch(batch: dict, mesh, rows_per_replica: int) -> dict[str, torch.Tensor]:
    """This dp replica's rows (the cp ranks of a replica share them)."""
    start = rows_per_replica * mesh.rank("dp")
    return {k: v[start : start + rows_per_replica] for k, v in batch.items()}


def grad_errors(reference, model) -> dict[str, float]:
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    errors = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad  # FSDP2: over dp x cp
        layout = getattr(param, "shard_layout", None)
        expected = ref_params[name].grad
        errors[name] = rel_err(grad, layout.slice(expected) if layout is not None else expected)
    return errors


def parallel_copy(reference, pp: int = 1):
    import optimum_parallel as op

    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # plain SGD: a wrongly scaled gradient shows
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2 if pp > 1 else 1)
    return model, parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)


def check_gradients(dp: int, cp: int, tp: int, pp: int, level: int, steps: int = 2) -> dict:
    """Every gradient against one process on the global batch, for `steps` SGD steps."""
    import optimum_parallel as op
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    mesh = op.init_mesh(dp=dp, pp=pp, cp=cp, tp=tp)
    config = tiny_config("llama", num_hidden_layers=2 * pp)
    reference = build_model(config)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    model, optimizer = parallel_copy(reference, pp)
    model, optimizer = apply_data_parallel(model, optimizer, mesh, DataParallelConfig(sharding_level=level))
    batch = global_batch(config, rows=2 * dp)
    local = local_batch(batch, mesh, rows_per_replica=2)
    worst, loss_errors = {}, []
    for _ in range(steps):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        if pp > 1:
            loss = model.run_train(**local)
        else:
            loss = model(**local).loss
            loss.backward()
        mean = loss.detach().clone()  # every cp rank reports its replica's loss
        dist.all_reduce(mean, group=mesh.data_parallel_group)
        loss_errors.append(rel_err(mean / mesh.data_parallel_size, ref_loss))
        for name, error in grad_errors(reference, model).items():
            worst[name] = max(worst.get(name, 0.0), error)
        for opt in (ref_optimizer, optimizer):
            opt.step()
            opt.zero_grad()
    return {"worst_grad": max(worst.values()), "worst_name": max(worst, key=worst.get), "loss": max(loss_errors)}


CASES = [  # dp, cp, tp, pp
    (1, 2, 2, 1),
    (2, 2, 1, 1),
]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("dp,cp,tp,pp", CASES, ids=[f"dp{c[0]}-cp{c[1]}-tp{c[2]}" for c in CASES])
def test_gradients_average_over_dp_x_cp(pool, dp, cp, tp, pp, level):
    for rank, result in enumerate(pool.run(check_gradients, dp, cp, tp, pp, level)):
        assert result["worst_grad"] <= TOL and result["loss"] <= TOL, (rank, result)


@pytest.mark.parametrize("level", [0, 2])
def test_pipeline_gradients_average_over_dp_x_cp(pool, level):
    """pp=2 x cp=2: the pipeline's own all-reduce (level 0) and FSDP2 on its stages (level 2) over the cp ranks."""
    for rank, result in enumerate(pool.run(check_gradients, 1, 2, 1, 2, level)):
        assert result["worst_grad"] <= TOL and result["loss"] <= TOL, (rank, result)


def check_parallelize_without_dp_config() -> dict:
    """`parallelize` on a cp=2 x tp=2 mesh with only an mp_config: the cp ranks still average their gradients."""
    import optimum_parallel as op

    mesh = op.init_mesh(cp=2, tp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    model = copy.deepcopy(reference)
    plan = {
        "model.layers.*.self_attn.q_proj": op.ColWiseParallel(units=4),
        "model.layers.*.self_attn.(k|v)_proj": op.ColWiseParallel(units=2),
        "model.layers.*.self_attn.o_proj": op.RowWiseParallel(),
        "model.layers.*.mlp.(gate|up)_proj": op.ColWiseParallel(),
        "model.layers.*.mlp.down_proj": op.RowWiseParallel(),
    }
    model, _ = op.parallelize(model, None, mesh, {"mp_config": {"parallelize_plan": plan}})
    batch = global_batch(config, rows=2)
    reference(**batch).loss.backward()
    model(**local_batch(batch, mesh, rows_per_replica=2)).loss.backward()
    return {"worst_grad": max(grad_errors(reference, model).values())}


def test_paddle_parallelize_averages_over_cp_without_dp_config(pool):
    for result in pool.run(check_parallelize_without_dp_config):
        assert result["worst_grad"] <= TOL, result


# ----------------------------------------------------------------------------------------------- checkpoints


def _model_and_optimizer(layout: dict, level: int):
    import optimum_parallel as op
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    mesh = op.init_mesh(**layout)
    model = build_model(tiny_config("llama", tie_word_embeddings=True), seed=11)
    optimizer = op.make_optimizer_constructor_lazy(torch.optim.AdamW)(model.parameters(), lr=1e-2)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = apply_data_parallel(model, optimizer, mesh, DataParallelConfig(sharding_level=level))
    return parallelizer, model, optimizer


def save_untrained(layout: dict, level: int, directory: str) -> None:
    parallelizer, model, _ = _model_and_optimizer(layout, level)
    parallelizer.save_model_checkpoint(model, directory)


def save_trained(layout: dict, level: int, directory: str) -> dict:
    """A step, save with the optimizer state, another step: the loss of that step."""
    parallelizer, model, optimizer = _model_and_optimizer(layout, level)
    batch = global_batch(model.config, rows=2)
    train_step(model, optimizer, batch)
    parallelizer.save_model_checkpoint(model, directory, optimizer=optimizer)
    return {"next": train_step(model, optimizer, batch)}


def load_trained(layout: dict, level: int, directory: str) -> dict:
    parallelizer, model, optimizer = _model_and_optimizer(layout, level)
    parallelizer.load_model_checkpoint(model, directory, optimizer=optimizer)
    return {"next": train_step(model, optimizer, global_batch(model.config, rows=2))}


CP = {"dp": 1, "cp": 2, "tp": 2}
DP = {"dp": 2, "tp": 2}


def test_checkpoint_files_do_not_depend_on_cp(pool, tmp_path):
    """dp=1 x cp=2 x tp=2 (FSDP2 over the cp ranks) writes byte for byte what tp=2 on 2 processes writes."""
    from _pool import WorkerPool

    pool.run(save_untrained, CP, 3, str(tmp_path / "cp"))
    two = WorkerPool(2)
    try:
        two.run(save_untrained, {"tp": 2}, 0, str(tmp_path / "tp"))
    finally:
        two.close()

    def weights(directory):  # every rank's generator states (rng-*.pt) come one file per rank: not the weights'
        return sorted(p.name for p in directory.iterdir() if not p.name.startswith("rng-"))

    files = weights(tmp_path / "cp")
    assert files == weights(tmp_path / "tp") and "COMPLETE" in files, files
    for name in files:
        assert (tmp_path / "cp" / name).read_bytes() == (tmp_path / "tp" / name).read_bytes(), name
    index = json.loads((tmp_path / "cp" / "parallel_checkpoint.json").read_text())
    assert index["mesh"] == {"dp": 1, "pp": 1, "tp": 2} and index["model_class"] == "LlamaForCausalLM", index


def test_checkpoint_with_optimizer_loads_across_cp(pool, tmp_path):
    """Saved at cp=2 with ZeRO-1 over dp x cp: loads at dp=2 (replicated) and at cp=2 (FSDP2) and takes the same
    next step; saved at dp=2, loads at cp=2."""
    saved = pool.run(save_trained, CP, 1, str(tmp_path / "cp"))[0]["next"]
    for layout, level in ((DP, 0), (CP, 3)):
        for result in pool.run(load_trained, layout, level, str(tmp_path / "cp")):
            assert abs(result["next"] - saved) <= 1e-6 * abs(saved), (layout, level, result, saved)
    saved = pool.run(save_trained, DP, 0, str(tmp_path / "dp"))[0]["next"]
    for result in pool.run(load_trained, CP, 2, str(tmp_path / "dp")):
        assert abs(result["next"] - saved) <= 1e-6 * abs(saved), (result, saved)
