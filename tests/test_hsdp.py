"""Hybrid sharded data parallelism (dp_config shard_size / threshold, gloo, 4 ranks): shard inside groups of
`shard_size` dp x cp ranks, replicate across the groups, against one process on the whole global batch.

Each dp replica trains on its own rows; rows carry left padding and -100 labels, with the same number of labelled
tokens in every replica (a replica's loss is its token mean and data parallelism averages the replicas).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from _models import build_model, rel_err, tiny_config
from torch.distributed.tensor import DTensor

WORLD_SIZE = 4  # worker processes of this module's `pool` (conftest.py)
SEQ = 16
ROWS = 2  # per dp replica
TOL = 1e-5
LABELLED = 12  # next-token targets per row


def global_batch(config, rows: int) -> dict[str, torch.Tensor]:
    """Row r: r % 3 left-padding tokens, then -100 from the end until every row has LABELLED next-token targets."""
    input_ids = torch.randint(0, config.vocab_size, (rows, SEQ), generator=torch.Generator().manual_seed(7))
    attention_mask = torch.ones(rows, SEQ, dtype=torch.long)
    labels = input_ids.clone()
    for r in range(rows):
        attention_mask[r, : r % 3] = 0
        labels[r, : r % 3] = -100
        end = SEQ
        while (labels[r, 1:] != -100).sum() > LABELLED:  # position 0 is never a target (shifted out)
            end -= 1
            labels[r, end] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def local_batch(batch: dict, mesh) -> dict[str, torch.Tensor]:
    start = ROWS * mesh.rank("dp")
    return {k: v[start : start + ROWS] for k, v in batch.items()}


def _parallel(layout: dict, level: int, shard_size: int, threshold: float = 0, seed: int = 0, momentum: float = 0):
    """(mesh, reference, model, optimizer): the reference on one process, and its copy made data-parallel."""
    import optimum_parallel as op

    mesh = op.init_mesh(**layout)
    reference = build_model(tiny_config("llama"), seed=seed)
    model = copy.deepcopy(reference)
    # plain SGD: a wrongly scaled gradient shows (AdamW's first step is lr x sign(gradient): rounding flips it)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    config = {"dp_config": {"sharding_level": level, "shard_size": shard_size, "threshold": threshold}}
    model, optimizer = op.parallelize(model, optimizer, mesh, config)
    return mesh, reference, model, optimizer


def _full_grad(param) -> torch.Tensor:
    return param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad


def check_gradients(layout: dict, level: int, shard_size: int, threshold: float = 0, steps: int = 2) -> dict:
    """Every gradient and the loss against one process on the global batch, for `steps` SGD steps; what each
    parameter is (placements, or plain) and this rank's bytes of parameters."""
    mesh, reference, model, optimizer = _parallel(layout, level, shard_size, threshold)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    batch = global_batch(reference.config, rows=ROWS * mesh.size("dp"))
    if mesh.size("cp") > 1:  # cp with a padding attention_mask does not match one process, hybrid or not
        batch.pop("attention_mask")
    local = local_batch(batch, mesh)
    ref_params = dict(reference.named_parameters())
    worst, loss_errors = {}, []
    for _ in range(steps):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        loss = model(**local).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.data_parallel_group)
        loss_errors.append(rel_err(mean / mesh.data_parallel_size, ref_loss))
        for name, param in model.named_parameters():
            layout_ = getattr(param, "shard_layout", None)
            expected = ref_params[name].grad
            error = rel_err(_full_grad(param), layout_.slice(expected) if layout_ is not None else expected)
            worst[name] = max(worst.get(name, 0.0), error)
        for opt in (ref_optimizer, optimizer):
            opt.step()
            opt.zero_grad()
    kinds = {
        name: [str(p) for p in param.placements] if isinstance(param, DTensor) else "plain"
        for name, param in model.named_parameters()
    }
    local_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
    )
    return {
        "worst_grad": max(worst.values()),
        "worst_name": max(worst, key=worst.get),
        "loss": max(loss_errors),
        "kinds": kinds,
        "param_bytes": local_bytes,
    }


HYBRID = {"dp": 4}


@pytest.mark.parametrize("level", [1, 2, 3])
def test_two_groups_of_two_match_the_global_batch(pool, level):
    for rank, result in enumerate(pool.run(check_gradients, HYBRID, level, 2)):
        assert result["worst_grad"] <= TOL and result["loss"] <= TOL, (rank, result)
        if level >= 2:  # sharded over the group of 2, replicated over the 2 groups
            kinds = set(map(tuple, result["kinds"].values()))
            assert kinds == {("R", "S(0)")}, (rank, kinds)


def test_composes_with_cp(pool):
    """dp=2 x cp=2 with groups of 2 (the cp ranks of one dp replica shard; the replicas replicate); -100 labels
    but no attention_mask: cp with a left-padding mask is off the single-device result at shard_size -1 too."""
    for level in (1, 3):
        for rank, result in enumerate(pool.run(check_gradients, {"dp": 2, "cp": 2}, level, 2)):
            assert result["worst_grad"] <= TOL and result["loss"] <= TOL, (level, rank, result)


def test_threshold_leaves_small_parameters_replicated(pool):
    """threshold=1 KB: the norms' weights (64 fp32 = 0.25 KB) stay plain tensors, their gradients still averaged
    over all 4 ranks; everything else is sharded in the groups."""
    for rank, result in enumerate(pool.run(check_gradients, HYBRID, 3, 2, 1)):
        assert result["worst_grad"] <= TOL and result["loss"] <= TOL, (rank, result)
        plain = sorted(name for name, kind in result["kinds"].items() if kind == "plain")
        assert plain and all(name.endswith("norm.weight") for name in plain), (rank, plain)
        assert len(plain) == 2 * 2 + 1, plain  # two per layer and the final norm


# ----------------------------------------------------------------------------------------------- collectives

COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")
COLLECTIVES += ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def count_collectives(level: int, shard_size: int, threshold: float = 0) -> dict:
    """(collective, ranks of its group) of every torch.distributed call of one forward + backward."""
    mesh, reference, model, _ = _parallel(HYBRID, level, shard_size, threshold)
    local = local_batch(global_batch(reference.config, rows=ROWS * mesh.size("dp")), mesh)
    calls = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def recording(name, fn):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            calls.append((name, tuple(dist.get_process_group_ranks(group)) if group is not None else "world"))
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, recording(name, fn))
    try:
        model(**local).loss.backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    shard = tuple(dist.get_process_group_ranks(mesh.sharding_group(shard_size)))
    return {"calls": calls, "shard": shard}


def test_collectives_gather_and_scatter_in_the_group_and_all_reduce_across(pool):
    for rank, result in enumerate(pool.run(count_collectives, 3, 2)):
        calls, shard = result["calls"], result["shard"]
        across = tuple(sorted({rank, rank ^ 2}))  # the rank at the same place in the other group
        gathers = [c for c in calls if c[0] == "all_gather_single"]
        scatters = [c for c in calls if c[0] == "reduce_scatter_single"]
        reduces = [c for c in calls if c[0] == "all_reduce"]
        assert shard == tuple(sorted({rank, rank ^ 1})), (rank, shard)
        assert gathers and all(group == shard for _, group in gathers), (rank, calls)
        assert scatters and all(group == shard for _, group in scatters), (rank, calls)
        # one all-reduce across the groups per reduce-scatter inside one (per FSDP unit: each layer and the root)
        assert len(reduces) == len(scatters) == 3 and all(group == across for _, group in reduces), (rank, calls)
        assert len(calls) == len(gathers) + len(scatters) + len(reduces), (rank, calls)


def test_threshold_parameters_take_one_all_reduce_over_all_ranks(pool):
    for rank, result in enumerate(pool.run(count_collectives, 3, 2, 1)):
        everyone = [c for c in result["calls"] if c == ("all_reduce", (0, 1, 2, 3))]
        assert len(everyone) == 1, (rank, result["calls"])


# ----------------------------------------------------------------------------------------------- checkpoints


def _train_step(model, optimizer, batch) -> float:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def save_trained(level: int, shard_size: int, directory: str) -> dict:
    """An SGD step with momentum, save with the optimizer state, another step: that step's loss."""
    from optimum_parallel.checkpoint import save_model_checkpoint

    mesh, _, model, optimizer = _parallel(HYBRID, level, shard_size, seed=11, momentum=0.9)
    batch = local_batch(global_batch(model.config, rows=ROWS * mesh.size("dp")), mesh)
    _train_step(model, optimizer, batch)
    save_model_checkpoint(model, directory, optimizer=optimizer)
    return {"next": _train_step(model, optimizer, batch)}


def load_trained(level: int, shard_size: int, directory: str) -> dict:
    from optimum_parallel.checkpoint import load_model_checkpoint

    mesh, _, model, optimizer = _parallel(HYBRID, level, shard_size, seed=12, momentum=0.9)  # other weights
    load_model_checkpoint(model, directory, optimizer=optimizer)
    batch = local_batch(global_batch(model.config, rows=ROWS * mesh.size("dp")), mesh)
    return {"next": _train_step(model, optimizer, batch)}


def save_untrained(shard_size: int, directory: str) -> None:
    from optimum_parallel.checkpoint import save_model_checkpoint

    _, _, model, optimizer = _parallel(HYBRID, 3, shard_size, seed=11, momentum=0.9)
    save_model_checkpoint(model, directory)


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{p.name}:{k}": v for p in sorted(directory.glob("*.safetensors")) for k, v in load_file(p).items()}


def test_checkpoint_files_do_not_depend_on_shard_size(pool, tmp_path):
    """Level 3 in groups of 2 writes byte for byte what level 3 over all 4 ranks writes."""
    for size in (-1, 2):
        pool.run(save_untrained, size, str(tmp_path / str(size)))
    files = sorted(p.name for p in (tmp_path / "-1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "2").iterdir()) and "COMPLETE" in files, files
    differ = [n for n in files if (tmp_path / "-1" / n).read_bytes() != (tmp_path / "2" / n).read_bytes()]
    assert not differ, differ
    index = json.loads((tmp_path / "2" / "parallel_checkpoint.json").read_text())
    assert index["mesh"] == {"dp": 4, "pp": 1, "tp": 1}, index["mesh"]


def test_trained_checkpoint_loads_at_another_shard_size(pool, tmp_path):
    """After a step, groups of 2 and all 4 ranks save the same weights and momentum (up to the order of the gradient
    sums: reduce-scatter in 2 then all-reduce across, or reduce-scatter over 4); the all-ranks
    checkpoint loads in groups of 2 (levels 1 and 3) and takes the same next step."""
    runs = {size: [r["next"] for r in pool.run(save_trained, 3, size, str(tmp_path / str(size)))] for size in (-1, 2)}
    assert max(abs(a - b) for a, b in zip(runs[2], runs[-1], strict=True)) <= 1e-5, runs
    every, groups = _tensors(tmp_path / "-1"), _tensors(tmp_path / "2")
    assert every.keys() == groups.keys() and any(k.startswith("optimizer") for k in every), sorted(every)
    errors = {k: rel_err(groups[k], every[k]) for k in every if every[k].is_floating_point()}
    assert max(errors.values()) <= TOL, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    for level in (1, 3):
        loaded = [r["next"] for r in pool.run(load_trained, level, 2, str(tmp_path / "-1"))]
        assert max(abs(a - b) for a, b in zip(loaded, runs[-1], strict=True)) <= 1e-5, (level, loaded, runs[-1])


# ----------------------------------------------------------------------------------------------- errors


def check_errors() -> dict:
    import optimum_parallel as op

    mesh = op.init_mesh(dp=4)
    model = build_model(tiny_config("llama"))
    messages = {}
    for key, dp_config in {
        "divides": {"sharding_level": 3, "shard_size": 3},
        "negative": {"sharding_level": 3, "shard_size": -2},
        "level0": {"sharding_level": 0, "shard_size": 2},
        "threshold": {"sharding_level": 3, "threshold": -1},
        "unknown": {"sharding_level": 3, "shard": 2},
    }.items():
        try:
            op.parallelize(copy.deepcopy(model), None, mesh, {"dp_config": dp_config})
            messages[key] = "no error"
        except ValueError as err:
            messages[key] = str(err)
    return messages


def test_errors_name_the_key_and_the_allowed_values(pool):
    messages = pool.run(check_errors)[0]
    assert "shard_size" in messages["divides"] and "allowed: -1, 1, 2, 4" in messages["divides"], messages
    assert "shard_size" in messages["negative"] and "allowed: -1" in messages["negative"], messages
    assert "sharding_level 0" in messages["level0"], messages
    assert "threshold" in messages["threshold"] and ">= 0" in messages["threshold"], messages
    assert "shard_size" in messages["unknown"] and "threshold" in messages["unknown"], messages
