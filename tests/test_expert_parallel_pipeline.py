"""Expert parallelism under pipeline parallelism: pp=2 x dp=2 x ep=2 (gloo, 4 ranks) for mixtral and qwen3_moe with
gpipe and 1f1b, against one process on the whole batch: the loss (token mean over every micro-batch and replica,
which hold different numbers of labelled tokens), every gradient, and the loss after 3 AdamW steps. The router aux
loss cannot travel through the stages: it is refused before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _models import build_model, rel_err, tiny_config
from test_expert_parallel import MOE
from test_expert_parallel_layouts import reference_slice, whole
from test_pipeline import pipeline_batch

WORLD_SIZE = 4
TOL = 1e-5


def check_pipeline_ep(model_type: str, schedule: str, level: int = 0, steps: int = 3) -> dict:
    import optimum_parallel as op

    mesh = op.init_mesh(dp=2, pp=2, ep=2)
    config = tiny_config(model_type, **{**MOE[model_type], "num_hidden_layers": 4})
    reference = build_model(config)
    model = copy.deepcopy(reference)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2, pipeline_parallel_schedule=schedule)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})

    batch = pipeline_batch(config, rows=8)
    rows = slice(4 * mesh.rank("dp"), 4 * mesh.rank("dp") + 4)
    local = {k: v[rows] for k, v in batch.items()}
    errors, losses = {}, []
    ref_params = dict(reference.named_parameters())
    for step in range(steps + 1):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        loss = model.run_train(**local)  # the global batch's loss on every rank
        losses.append(rel_err(loss, ref_loss))
        if step == 0:
            for name, param in model.named_parameters():
                errors[f"grad {name}"] = rel_err(whole(param.grad), reference_slice(param, ref_params[name].grad))
            ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
            errors["grad_norm"] = rel_err(op.grad_norm(model), ref_norm)
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
    errors["loss"], errors["steps"] = losses[0], max(losses[1:])
    from optimum_parallel.expert_parallel import find_experts

    return {"errors": errors, "experts": len(find_experts(model)), "n_params": len(list(model.parameters()))}


CASES = [
    ("mixtral", "gpipe", 0),
    ("mixtral", "1f1b", 0),
    ("qwen3_moe", "gpipe", 0),
    ("qwen3_moe", "1f1b", 0),
    ("mixtral", "1f1b", 1),
    ("qwen3_moe", "1f1b", 2),
    ("qwen2_moe", "1f1b", 3),
]


@pytest.mark.parametrize("model_type,schedule,level", CASES, ids=[f"{m}-{s}-L{lv}" for m, s, lv in CASES])
def test_pipeline_with_expert_parallel_matches_one_process(pool, model_type, schedule, level):
    results = pool.run(check_pipeline_ep, model_type, schedule, level)
    for rank, result in enumerate(results):
        worst = {k: v for k, v in result["errors"].items() if v > TOL}
        assert not worst, f"rank {rank}: {worst}"
        assert result["experts"] >= 1  # each stage holds its layers' experts (split over ep)


def check_router_logits_refused() -> tuple:
    from _checks import error_and_whether_untouched

    import optimum_parallel as op

    op.init_mesh(dp=2, pp=2, ep=2)
    model = build_model(tiny_config("mixtral", **MOE["mixtral"], output_router_logits=True, num_hidden_layers=4))
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    return error_and_whether_untouched(
        model, lambda: parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2)
    ) + (dist.get_rank(),)


def test_router_aux_loss_is_refused_under_pp(pool):
    for kind, message, untouched, _ in pool.run(check_router_logits_refused):
        assert kind == "ValueError" and untouched, (kind, message)
        assert "output_router_logits=True with pp=2" in message, message
        assert "allowed with pp > 1: output_router_logits=False" in message, message
