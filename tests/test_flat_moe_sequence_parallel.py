"""Llama 4 under sequence parallelism (issue 47): its MoE block returns the tokens flattened ([batch x seq, hidden]),
so the replicated block's output is given back in its input's shape before the sequence is split again
(`autoplan/sequence_plan.py`). The family matrix's tiny llama4_text at tp=2 with sp, alone and with its experts
split over ep=2 (expert-major rows exchanged whole), at data-parallel levels 0 and 3, against one process on the whole
batch: loss, every gradient, the loss after 3 AdamW steps."""

from __future__ import annotations

import copy

import pytest
import torch
from family_matrix import LR, _compare, batch_for, build, family_config

WORLD_SIZE = 4
TOL = 1e-5
CASES = [(dict(dp=2, tp=2), 0), (dict(dp=2, tp=2, ep=2), 0), (dict(dp=2, tp=2, ep=2), 3)]


def check(sizes: dict, level: int) -> dict:
    import optimum_parallel as op

    op.init_mesh(**sizes, timeout=60)
    config = family_config("llama4_text")
    reference = build(config)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, sequence_parallel_enabled=True)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    seen = []  # the sequence length the first MoE block and the norm before it see
    for name in ("model.layers.0.post_attention_layernorm", "model.layers.0.feed_forward"):
        leaf = name.rpartition(".")[2]
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, leaf=leaf: seen.append((leaf, args[0].shape[1]))
        )
    model, optimizer = op.parallelize(model, optimizer, None, {"dp_config": {"sharding_level": level}})
    errors = _compare(reference, model, optimizer, batch_for(config), pipeline=False)
    return {"errors": errors, "seen": seen[:2]}


@pytest.mark.parametrize(
    "sizes,level", CASES, ids=[f"{'_'.join(f'{k}{v}' for k, v in s.items())}-L{lv}" for s, lv in CASES]
)
def test_llama4_sequence_parallel_matches_one_process(pool, sizes, level):
    for rank, result in enumerate(pool.run(check, sizes, level)):
        errors = result["errors"]
        worst = max(errors["loss"], errors["grad"], errors["steps"])
        assert worst <= TOL, f"rank {rank}: {errors}"
        assert result["seen"] == [("post_attention_layernorm", 8), ("feed_forward", 16)], result["seen"]
