"""Expert parallelism (ep): the mesh's expert groups, and the experts of a mixture-of-experts model split over the
dp ranks, tokens dispatched by all-to-all, against one process on the global batch (gloo, 4 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _models import build_model, rel_err, tiny_config

WORLD_SIZE = 4


def check_expert_mesh() -> dict:
    import optimum_parallel as op

    out = {}
    for name, sizes in {
        "dp4_ep2": dict(dp=4, ep=2),
        "dp2_tp2_ep2": dict(dp=2, tp=2, ep=2),
        "dp2_cp2_ep4": dict(dp=2, cp=2, ep=4),
    }.items():
        mesh = op.init_mesh(**sizes)
        out[name] = {
            "ep": (mesh.size("ep"), mesh.rank("ep")),
            "expert_group": dist.get_process_group_ranks(mesh.group("ep")),
            "replicas": dist.get_process_group_ranks(mesh.expert_replica_group),
        }
    plain = op.init_mesh(dp=4)
    out["plain_ep"] = plain.size("ep")
    errors = []
    for bad in (3, 8, 0, True, "2"):
        try:
            op.init_mesh(dp=4, ep=bad)
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    out["unchanged"] = op.get_mesh() is plain  # a refused request leaves the current mesh alone
    try:
        _ = plain.expert_group
    except ValueError as err:
        out["no_ep"] = str(err)
    return out


def test_expert_mesh_groups_and_errors(pool):
    for rank, result in enumerate(pool.run(check_expert_mesh)):
        assert result["dp4_ep2"] == {
            "ep": (2, rank % 2),
            "expert_group": [0, 1] if rank < 2 else [2, 3],
            "replicas": [0, 2] if rank % 2 == 0 else [1, 3],
        }
        # grid [dp, pp, cp, tp]: rank = 2 * dp + tp; an expert group is the dp ranks of one tp coordinate
        group = [rank % 2, rank % 2 + 2]
        assert result["dp2_tp2_ep2"] == {"ep": (2, rank // 2), "expert_group": group, "replicas": [rank]}
        assert result["dp2_cp2_ep4"] == {"ep": (4, rank), "expert_group": [0, 1, 2, 3], "replicas": [rank]}
        assert result["plain_ep"] == 1
        assert len(result["errors"]) == 5
        for message in result["errors"]:
            assert "ep=" in message and "allowed: 1, 2, 4" in message, message
        assert result["unchanged"]
        assert "ep=1" in result["no_ep"] and "allowed" in result["no_ep"]


@pytest.mark.parametrize("bad", [4, 0])
def test_expert_parallel_size_check_alone(bad):
    from optimum_parallel.mesh import check_expert_parallel_size

    with pytest.raises(ValueError, match=r"ep=.*allowed: 1, 2, 3, 6"):
        check_expert_parallel_size(bad, 3 * 2)


# Tiny MoE configs: 4 experts, top-2 (hidden 64, 2 layers, vocab 128 from _models.TINY)
MOE: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, mlp_only_layers=[]),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=16, sliding_window=8),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        num_key_value_heads=4,
    ),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
}


def replica_batch(config, replicas: int, seq: int = 16) -> dict[str, torch.Tensor]:
    """2 rows per dp x cp replica, padded and with -100 labels; every replica holds as many labelled tokens, so the
    mean of the replicas' losses is the global batch's loss."""
    rows = 2 * replicas
    input_ids = torch.randint(0, config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones(rows, seq, dtype=torch.long)
    attention_mask[0::2, :3] = 0  # the first row of every replica is left-padded
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[:, seq // 2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _reference_slice(param, full: torch.Tensor) -> torch.Tensor:
    from optimum_parallel.expert_parallel import expert_layout

    for layout in (expert_layout(param), getattr(param, "shard_layout", None)):
        if layout is not None:
            full = layout.slice(full)
    return full


def check_training(model_type: str, sizes: dict, steps: int = 3) -> dict:
    import optimum_parallel as op
    from optimum_parallel.expert_parallel import find_experts

    mesh = op.init_mesh(**sizes)
    config = tiny_config(model_type, **MOE[model_type])
    reference = build_model(config)
    model = copy.deepcopy(reference)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dp_config = {"dp_config": {"sharding_level": 0}}
    if mesh.tp_size > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = op.parallelize(model, optimizer, mesh, dp_config)

    replicas, replica = mesh.data_parallel_size, mesh.data_parallel_rank
    batch = replica_batch(config, replicas)
    local = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    loss = model(**local).loss
    loss.backward()
    errors = {"loss": rel_err(_replica_mean(loss, mesh), ref_loss)}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        errors[name] = rel_err(param.grad, _reference_slice(param, ref_params[name].grad))
    from optimum_parallel.engine.grad_norm import grad_norm

    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
    errors["grad_norm"] = rel_err(grad_norm(model), ref_norm)
    losses = []
    for _ in range(steps):
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
        ref_loss = reference(**batch).loss
        loss = model(**local).loss
        ref_loss.backward()
        loss.backward()
        losses.append(rel_err(_replica_mean(loss, mesh), ref_loss))
    errors["steps"] = max(losses)
    local_experts = {name: module.gate_up_proj.shape[0] for name, module in find_experts(model)}
    return {"errors": errors, "local_experts": local_experts, "global_experts": ref_params_count(reference)}


def ref_params_count(reference) -> int:
    from optimum_parallel.expert_parallel import find_experts

    return find_experts(reference)[0][1].num_experts


def _replica_mean(loss: torch.Tensor, mesh) -> torch.Tensor:
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.data_parallel_group)
    return total / mesh.data_parallel_size


TRAINING_CASES = [
    ("mixtral", dict(dp=4, ep=2)),
    ("qwen3_moe", dict(dp=4, ep=2)),
    ("mixtral", dict(dp=4, ep=4)),
    ("qwen2_moe", dict(dp=4, ep=2)),
    ("olmoe", dict(dp=4, ep=2)),
    ("granitemoe", dict(dp=4, ep=2)),
    ("gpt_oss", dict(dp=4, ep=2)),
    ("deepseek_v3", dict(dp=4, ep=2)),
    ("mixtral", dict(dp=2, tp=2, ep=2)),
    ("qwen3_moe", dict(dp=2, tp=2, ep=2)),
    ("qwen2_moe", dict(dp=2, tp=2, ep=2)),
    ("olmoe", dict(dp=2, tp=2, ep=2)),
    ("granitemoe", dict(dp=2, tp=2, ep=2)),
    ("deepseek_v3", dict(dp=2, tp=2, ep=2)),
    ("gpt_oss", dict(dp=2, tp=2, ep=2)),
]


@pytest.mark.parametrize("model_type,sizes", TRAINING_CASES, ids=[f"{m}-{s}" for m, s in TRAINING_CASES])
def test_training_matches_one_process(pool, model_type, sizes):
    for rank, result in enumerate(pool.run(check_training, model_type, sizes)):
        worst = {k: v for k, v in result["errors"].items() if v > 1e-5}
        assert not worst, f"rank {rank}: {worst}"
        ep = sizes["ep"]
        assert result["local_experts"] and all(
            n == result["global_experts"] // ep for n in result["local_experts"].values()
        ), result


def check_collectives(model_type: str = "mixtral") -> dict:
    """all_to_all_single calls of one forward and one backward at dp=4 x ep=2 (2 MoE blocks)."""
    import optimum_parallel as op

    mesh = op.init_mesh(dp=4, ep=2)
    config = tiny_config(model_type, **MOE[model_type])
    model, _ = op.parallelize(build_model(config), None, mesh, {"dp_config": {"sharding_level": 0}})
    batch = replica_batch(config, 1)
    calls, phase = [], ["forward"]
    original = dist.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        kind = "rows" if input.is_floating_point() else "counts"
        calls.append((phase[0], kind, input.shape[0], tuple(input_split_sizes or ())))
        return original(output, input, output_split_sizes, input_split_sizes, **kwargs)

    dist.all_to_all_single = recording
    try:
        loss = model(**batch).loss
        phase[0] = "backward"
        loss.backward()
    finally:
        dist.all_to_all_single = original
    return {"calls": calls, "tokens": batch["input_ids"].numel()}


def test_two_all_to_alls_per_moe_block_each_way(pool):
    for rank, result in enumerate(pool.run(check_collectives)):
        kinds = [(phase, kind) for phase, kind, _, _ in result["calls"]]
        # per MoE block forward: the counts (ep x local experts integers), the rows out, the rows back
        assert (
            kinds == [("forward", "counts"), ("forward", "rows"), ("forward", "rows")] * 2 + [("backward", "rows")] * 4
        ), (rank, result)
        counts = [n for phase, kind, n, _ in result["calls"] if kind == "counts"]
        assert counts == [4, 4]  # 2 ranks x 2 local experts
        sent = [sum(splits) for phase, kind, _, splits in result["calls"] if phase == "forward" and kind == "rows"]
        assert sent[0::2] == [2 * result["tokens"]] * 2  # every (token, expert) row of top-2 goes out: none dropped


def check_refusals() -> dict:
    """Bad ep requests raise one error naming the key before anything changes; training without the data-parallel
    reduction raises (checkpoints of an ep model: tests/test_expert_parallel_checkpoint.py)."""
    from _checks import error_and_whether_untouched

    import optimum_parallel as op

    mesh = op.init_mesh(dp=4, ep=2)
    out = {}
    dense = build_model(tiny_config("llama"))
    out["dense"] = error_and_whether_untouched(dense, lambda: op.parallelize(dense, None, mesh, {"dp_config": {}}))
    odd = build_model(tiny_config("mixtral", **{**MOE["mixtral"], "num_local_experts": 3}))
    out["odd"] = error_and_whether_untouched(odd, lambda: op.parallelize(odd, None, mesh, {"dp_config": {}}))
    moe = build_model(tiny_config("mixtral", **MOE["mixtral"]))
    level = {"dp_config": {"sharding_level": 2, "shard_size": 2}}  # hybrid sharding with ep: refused
    out["level"] = error_and_whether_untouched(moe, lambda: op.parallelize(moe, None, mesh, level))
    model = op.ParallelizersManager.parallelizer_for_model(moe).parallelize(moe)
    batch = replica_batch(moe.config, 1)
    try:
        model(**batch).loss.backward()
        out["no_reduction"] = "no error"
    except RuntimeError as err:
        out["no_reduction"] = str(err)
    with torch.no_grad():
        out["eval_ok"] = bool(torch.isfinite(model(**batch).loss))
    return out


def test_refusals(pool):
    for result in pool.run(check_refusals):
        assert result["dense"][0] == "ValueError" and result["dense"][2], result["dense"]
        assert "ep=2" in result["dense"][1] and "allowed for this model: ep=1" in result["dense"][1]
        assert result["odd"][0] == "ValueError" and result["odd"][2], result["odd"]
        assert "ep=2 does not divide the 3 experts" in result["odd"][1] and "allowed" in result["odd"][1]
        assert result["level"][0] == "ValueError" and result["level"][2], result["level"]
        assert "dp_config['shard_size']=2" in result["level"][1] and "allowed with ep > 1: -1" in result["level"][1]
        assert "ep > 1" in result["no_reduction"] and "dp_config" in result["no_reduction"]
        assert result["eval_ok"]


def test_trainer_argument_checks_ep_against_the_mesh():
    """ParallelTrainingArguments.expert_parallel_size: a positive int, dividing dp x cp (one process here: only 1)."""
    from optimum_parallel.integrations.transformers.trainer import _mesh_for
    from optimum_parallel.integrations.transformers.training_args import ParallelTrainingArguments, trainer_request

    with pytest.raises(ValueError, match="expert_parallel_size=0"):
        ParallelTrainingArguments(output_dir="/tmp/unused", use_cpu=True, expert_parallel_size=0)
    args = ParallelTrainingArguments(output_dir="/tmp/unused", use_cpu=True, expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 .* dp x cp = 1 x 1; allowed: 1"):
        _mesh_for(trainer_request(args), timeout=60)
