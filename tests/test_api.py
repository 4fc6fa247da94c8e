"""`op.parallelize(model, optimizer, mesh, config)`: Paddle's entry point, its config errors and the example."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _models import build_model, make_batch, rel_err, tiny_config

ROOT = Path(__file__).resolve().parents[1]


WORLD_SIZE = 2  # worker processes of this module's `pool` (conftest.py)


def llama_plan(sequence_parallel: bool = False, kv_heads: int = 2) -> dict:
    import optimum_parallel as op

    plan = {
        "model.embed_tokens": op.RowWiseParallel(),
        "model.layers.*.self_attn.q_proj": op.ColWiseParallel(units=4),
        "model.layers.*.self_attn.(k|v)_proj": op.ColWiseParallel(units=kv_heads),
        "model.layers.*.self_attn.o_proj": op.RowWiseParallel(),
        "model.layers.*.mlp.(gate|up)_proj": op.ColWiseParallel(),
        "model.layers.*.mlp.down_proj": op.RowWiseParallel(),
        "lm_head.weight": op.ColWiseParallel(),
    }
    if sequence_parallel:
        plan.update(
            {
                "model.layers.0": op.SequenceParallelBegin(on="input"),
                "model.layers.*.(self_attn|mlp)": op.SequenceParallelDisable(),
                "model.layers.*.(input|post_attention)_layernorm": op.SequenceParallelEnable(),
                "model.norm": op.SequenceParallelEnable(),
                "lm_head": op.SequenceParallelEnd(),
            }
        )
    return plan


def check_parallelize(sequence_parallel: bool, typed: bool, kv_heads: int = 2) -> dict:
    import optimum_parallel as op

    mesh = op.init_mesh(tp=2)
    config = tiny_config("llama", num_key_value_heads=kv_heads)
    reference = build_model(config)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # any torch optimizer
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    plan = llama_plan(sequence_parallel, kv_heads)
    parallel_config = (
        op.ParallelConfig(mp_config=op.TensorParallelConfig(parallelize_plan=plan))
        if typed
        else {"mp_config": {"parallelize_plan": plan}}
    )
    model, optimizer = op.parallelize(model, optimizer, mesh=mesh, config=parallel_config)
    batch = make_batch(config)
    errors = []
    for _ in range(3):
        ref_loss, loss = reference(**batch).loss, model(**batch).loss
        ref_loss.backward()
        loss.backward()
        errors.append(rel_err(loss, ref_loss))
        for opt in (ref_optimizer, optimizer):
            opt.step()
            opt.zero_grad()
    return {"worst": max(errors), "optimizer": type(optimizer).__name__}


@pytest.mark.parametrize("sequence_parallel,typed,kv_heads", [(False, False, 2), (True, True, 2), (False, False, 1)])
def test_parallelize_matches_single_device(pool, sequence_parallel, typed, kv_heads):
    """kv_heads=1 < tp: the one kv head is replicated and the attention's local kv groups are fixed up."""
    for result in pool.run(check_parallelize, sequence_parallel, typed, kv_heads):
        assert result["worst"] <= 1e-5 and result["optimizer"] == "SGD", result


def save_parallelize_checkpoint(path: str) -> None:
    import optimum_parallel as op
    from optimum_parallel.checkpoint import save_model_checkpoint

    mesh = op.init_mesh(tp=2)
    model = build_model(tiny_config("llama", num_key_value_heads=2))
    model, _ = op.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": llama_plan()}})
    save_model_checkpoint(model, path)


def test_parallelize_checkpoint_carries_head_counts_and_reshards_by_them(pool, tmp_path):
    """The styles' shard specs reach the index: at tp=4 the 2 kv heads are replicated, never cut in half."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import read_index

    pool.run(save_parallelize_checkpoint, str(tmp_path / "tp2"))
    saved = read_index(tmp_path / "tp2").tensors["model.layers.0.self_attn.k_proj.weight"]
    assert saved.parts == [[32, 2]], saved.parts
    op.reshard_checkpoint(tmp_path / "tp2", tmp_path / "tp4", tp=4, progress=False)
    resharded = read_index(tmp_path / "tp4").tensors["model.layers.0.self_attn.k_proj.weight"]
    assert [(s.tp_ranks, s.ranges, s.replicas) for s in resharded.shards] == [
        ([0, 1], [[0, 16]], 2),
        ([2, 3], [[16, 32]], 2),
    ]


def check_pipeline_parallelize() -> dict:
    import optimum_parallel as op

    mesh = op.init_mesh(pp=2, tp=1)
    config = tiny_config("llama", num_hidden_layers=4)
    reference = build_model(config)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    pp_config = {
        "split_spec": {"model.layers.2": op.SplitPoint.BEGINNING},
        "global_spec": "model.rotary_emb",
        "schedule": "gpipe",
        "num_microbatches": 2,
    }
    model, optimizer = op.parallelize(model, optimizer, mesh, {"pp_config": pp_config})
    batch = {"input_ids": make_batch(config)["input_ids"]}
    batch["labels"] = batch["input_ids"]
    errors = []
    for _ in range(3):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        errors.append(rel_err(model.run_train(**batch), ref_loss))
        for opt in (ref_optimizer, optimizer):
            opt.step()
            opt.zero_grad()
    kept = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if n.startswith("model.layers.")})
    return {
        "worst": max(errors),
        "layers": kept,
        "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
        "model_params": len(list(model.parameters())),
    }


def test_pipeline_parallelize(pool):
    first, last = pool.run(check_pipeline_parallelize)
    assert first["layers"] == [0, 1] and last["layers"] == [2, 3]
    for result in (first, last):
        assert result["worst"] <= 1e-5, result
        assert result["optimizer_params"] == result["model_params"], "the optimizer holds only this stage's params"


def test_empty_config_returns_inputs_with_a_warning():
    import optimum_parallel as op

    model = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="nothing to do"):
        assert op.parallelize(model, None, config={}) == (model, None)


def test_paddle_llama_example_runs_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        str(ROOT / "examples" / "parallelize_llama.py"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "step 4: loss" in result.stdout
