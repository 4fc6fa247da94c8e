"""Pipeline parallelism on torch.distributed.pipelining schedules, composed with tp and dp (gloo, 4 ranks),
against one process on the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _checks import TOL
from _models import build_model, make_batch, rel_err, tiny_config
from torch.distributed.tensor import DTensor


def pipeline_batch(config, rows: int = 4) -> dict[str, torch.Tensor]:
    """Left padding of 1-7 tokens and -100 labels at different places in every row: micro-batches (and dp replicas)
    hold different numbers of labelled tokens, so only the token mean over the whole batch matches one device."""
    batch = make_batch(config, batch=rows)
    batch["attention_mask"][:] = 1
    batch["labels"] = batch["input_ids"].clone()
    for row in range(rows):
        pad = (3 * row) % 7 + 1
        batch["attention_mask"][row, :pad] = 0
        batch["labels"][row, : pad + 1] = -100  # padding, and the first token (its query row sees only padding)
        batch["labels"][row, 10 + row % 3 :] = -100 if row % 2 else batch["labels"][row, 10 + row % 3 :]
    return batch


def check_pipeline(
    *,
    pp: int,
    tp: int,
    schedule: str = "1f1b",
    microbatches: int = 2,
    steps: int = 3,
    overrides: dict | None = None,
    model_type: str = "llama",
    sequence_parallel: bool = False,
    sharding_level: int = 0,
) -> dict:
    """Loss and every gradient of the first step, then the loss over `steps` AdamW steps."""
    import optimum_parallel as op

    dp = dist.get_world_size() // (pp * tp)
    mesh = op.init_mesh(dp=dp, pp=pp, tp=tp)
    config = tiny_config(model_type, **{"num_hidden_layers": 4, **(overrides or {})})
    reference = build_model(config)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(
        model,
        sequence_parallel_enabled=sequence_parallel,
        pipeline_parallel_num_microbatches=microbatches,
        pipeline_parallel_schedule=schedule,
    )
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    if dp > 1:
        from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

        model, optimizer = apply_data_parallel(model, optimizer, mesh, DataParallelConfig(sharding_level))
    batch = pipeline_batch(config, rows=4 * dp)
    rows = slice(4 * mesh.rank("dp"), 4 * mesh.rank("dp") + 4)
    local = {k: v[rows] for k, v in batch.items()}

    losses, grads = [], {}
    ref_params = dict(reference.named_parameters(remove_duplicate=False))  # tied: lm_head.weight too
    for step in range(steps):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        loss = model.run_train(**local)
        if dp > 1:
            dist.all_reduce(loss, group=mesh.group("dp"))
            loss = loss / dp
        losses.append(rel_err(loss, ref_loss))
        if step == 0:
            for name, param in model.named_parameters():
                layout = getattr(param, "shard_layout", None)
                expected = ref_params[name].grad
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad  # FSDP: gather
                grads[name] = rel_err(grad, layout.slice(expected) if layout is not None else expected)
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
    evaluated = model.run_eval(**local)
    return {
        "loss": max(losses),
        "worst_grad": max(grads.values()),
        "n_params": len(grads),
        "eval_loss": (mesh.rank("dp"), round(evaluated.loss.item(), 6)),
        "has_logits": evaluated.logits is not None,
    }


CASES = [
    # pp, tp, schedule, micro-batches, steps, config overrides
    (2, 1, "gpipe", 2, 1, {}),
    (2, 1, "1f1b", 4, 1, {"tie_word_embeddings": True}),
    (2, 1, "interleaved_1f1b", 2, 1, {}),
    (2, 2, "zbv", 2, 1, {}),
    (4, 1, "1f1b", 4, 1, {}),
    (4, 1, "gpipe", 4, 1, {"tie_word_embeddings": True}),
    (4, 1, "interleaved_1f1b", 4, 1, {"num_hidden_layers": 8}),
    (4, 1, "zbv", 4, 1, {"num_hidden_layers": 8}),
    (2, 2, "interleaved_zb", 2, 1, {}),
    (2, 2, "1f1b", 2, 3, {}),  # pp=2 x tp=2
    (2, 1, "1f1b", 2, 3, {"num_key_value_heads": 4}),  # dp=2 x pp=2
]
FAMILIES = [  # the other pipelined families: q/k norms, scaled embeddings, soft-capping and sliding windows
    ("qwen3", 2, 2, "1f1b", 2, 1, {"head_dim": 16}),
    ("gemma", 2, 1, "1f1b", 2, 1, {"head_dim": 16, "tie_word_embeddings": True}),
    ("gemma2", 2, 2, "gpipe", 2, 1, {"head_dim": 16, "tie_word_embeddings": True, "sliding_window": 8}),
    ("gemma3_text", 2, 1, "1f1b", 2, 1, {"head_dim": 16, "sliding_window": 8}),
]


@pytest.mark.parametrize(
    "pp,tp,schedule,microbatches,steps,overrides",
    CASES,
    ids=[f"pp{c[0]}-tp{c[1]}-{c[2]}-m{c[3]}-{i}" for i, c in enumerate(CASES)],
)
def test_matches_single_device(pool, pp, tp, schedule, microbatches, steps, overrides):
    results = pool.run(
        check_pipeline, pp=pp, tp=tp, schedule=schedule, microbatches=microbatches, steps=steps, overrides=overrides
    )
    for rank, result in enumerate(results):
        assert result["loss"] <= TOL and result["worst_grad"] <= TOL, f"rank {rank}: {result}"
    assert sum(r["n_params"] for r in results) >= len(list(build_model(tiny_config("llama")).parameters()))
    eval_losses = {r["eval_loss"] for r in results}
    assert len(eval_losses) == len({dp for dp, _ in eval_losses}), f"one eval loss per pipeline: {eval_losses}"


@pytest.mark.parametrize(
    "model_type,pp,tp,schedule,microbatches,steps,overrides", FAMILIES, ids=[f[0] for f in FAMILIES]
)
def test_other_families_pipeline(pool, model_type, pp, tp, schedule, microbatches, steps, overrides):
    for rank, result in enumerate(
        pool.run(
            check_pipeline,
            pp=pp,
            tp=tp,
            schedule=schedule,
            microbatches=microbatches,
            steps=steps,
            overrides=overrides,
            model_type=model_type,
        )
    ):
        assert result["loss"] <= TOL and result["worst_grad"] <= TOL, f"rank {rank}: {result}"


@pytest.mark.parametrize(
    "sequence_parallel,sharding_level", [(True, 0), (False, 3)], ids=["pp2-tp2-sp", "dp2-pp2-fsdp"]
)
def test_pipeline_composes_with_sp_and_fsdp(pool, sequence_parallel, sharding_level):
    tp = 2 if sequence_parallel else 1
    results = pool.run(check_pipeline, pp=2, tp=tp, sequence_parallel=sequence_parallel, sharding_level=sharding_level)
    for rank, result in enumerate(results):
        assert result["loss"] <= TOL and result["worst_grad"] <= TOL, f"rank {rank}: {result}"


def check_pipeline_errors(case: str) -> str:
    import optimum_parallel as op

    op.init_mesh(dp=2, pp=2, tp=1)
    model = build_model(tiny_config("llama", num_hidden_layers=4))
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    try:
        if case == "forward":  # bad requests (schedule, micro-batches, tied zbv): tests/test_bad_requests.py
            model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2)
            model(**make_batch(model.config))
        if case == "classifier":  # its loss pools on one device: only ParallelRewardTrainer replaces it under pp
            from transformers import LlamaForSequenceClassification

            config = tiny_config("llama", num_hidden_layers=4, num_labels=3, pad_token_id=0)
            model = LlamaForSequenceClassification(config)
            model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(
                model, pipeline_parallel_num_microbatches=2
            )
            batch = make_batch(config)
            model.run_train(batch["input_ids"], labels=torch.zeros(batch["input_ids"].shape[0], dtype=torch.long))
    except (ValueError, RuntimeError) as err:  # NotImplementedError is a RuntimeError
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "case,words",
    [
        ("forward", ["run_train", "run_eval"]),
        ("classifier", ["LlamaForSequenceClassification", "score", "ParallelRewardTrainer", "allowed"]),
    ],
)
def test_pipeline_errors(pool, case, words):
    for message in pool.run(check_pipeline_errors, case):
        assert all(w in message for w in words), message


def check_accumulation(sharding_level: int) -> dict:
    """pp=2 x dp=2, tied embeddings: two run_train calls per optimizer step (gradient accumulation in a custom
    loop), each given the labelled-token count of both calls' global rows, against one process on the whole batch."""
    import optimum_parallel as op
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    mesh = op.init_mesh(dp=2, pp=2)
    config = tiny_config("llama", num_hidden_layers=4, tie_word_embeddings=True)
    reference = build_model(config)
    model = copy.deepcopy(reference)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2)
    optimizer = parallelizer.optimizer_for_mp(
        torch.optim.SGD(model.parameters(), lr=0.5), model.orig_param_to_parallel_param
    )
    model, optimizer = apply_data_parallel(model, optimizer, mesh, DataParallelConfig(sharding_level))
    batch = pipeline_batch(config, rows=8)
    count = (batch["labels"][:, 1:] != -100).sum()
    dp = mesh.rank("dp")
    calls = [
        {k: v[rows] for k, v in batch.items()} for rows in (slice(4 * dp, 4 * dp + 2), slice(4 * dp + 2, 4 * dp + 4))
    ]
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    worst, losses = 0.0, []
    for _ in range(2):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        loss = sum(model.run_train(**call, num_items_in_batch=count) for call in calls)
        losses.append(rel_err(loss, ref_loss))
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            worst = max(worst, rel_err(grad, ref_params[name].grad))
        for opt in (optimizer, torch.optim.SGD(reference.parameters(), lr=0.5)):
            opt.step()
            opt.zero_grad()
    return {"loss": max(losses), "worst_grad": worst}


@pytest.mark.parametrize("sharding_level", [0, 3])
def test_gradient_accumulation_over_calls_with_tied_embeddings(pool, sharding_level):
    for rank, result in enumerate(pool.run(check_accumulation, sharding_level)):
        assert result["loss"] <= TOL and result["worst_grad"] <= TOL, f"rank {rank}: {result}"
