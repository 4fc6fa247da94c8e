"""Expert parallelism with the data-parallel sharding levels 1-3 (ZeRO-1, FSDP2 grads, FSDP2 params): loss, every
gradient, the global gradient norm and clipping, and the loss after 3 AdamW steps against one process on the whole
batch (gloo, 4 ranks). Every dp replica trains its own rows, padded and with -100 labels so that the replicas hold
different numbers of labelled tokens: each replica's loss is its token sum over (the global count / replicas)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _models import build_model, rel_err, tiny_config
from test_expert_parallel import MOE

WORLD_SIZE = 4
TOL = 1e-5


def uneven_batch(config, rows: int, seq: int = 16) -> dict[str, torch.Tensor]:
    """`rows` rows, left-padded by 0-6 tokens and with 0-3 more -100 labels each: the labelled tokens differ from row
    to row (and so from replica to replica)."""
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, config.vocab_size, (rows, seq), generator=gen)
    pad = [(3 * i) % 7 for i in range(rows)]
    attention_mask = (torch.arange(seq)[None, :] >= torch.tensor(pad)[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    for i in range(rows):
        if i % 3:
            labels[i, seq - 1 - (i % 4) :] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def labelled(labels: torch.Tensor) -> int:
    return int((labels[..., 1:] != -100).sum())


def reference_slice(param, full: torch.Tensor) -> torch.Tensor:
    """The part of the single-device tensor `full` this rank's (possibly FSDP2-wrapped) `param` holds, whole."""
    from optimum_parallel.expert_parallel import expert_layout

    for layout in (expert_layout(param), getattr(param, "shard_layout", None)):
        if layout is not None:
            full = layout.slice(full)
    return full


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) gathered over its mesh (a collective on that mesh), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def replica_mean(value: torch.Tensor, mesh) -> torch.Tensor:
    total = value.detach().clone()
    dist.all_reduce(total, group=mesh.data_parallel_group)
    return total / mesh.data_parallel_size


def random_biases(model: torch.nn.Module) -> None:
    """Give the biases transformers initialises to zero (gpt_oss's attention and expert biases) random values, so the
    first step already checks how each is added, not only the steps after the optimizer moved them."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and not param.any():
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))


def check_level(model_type: str, sizes: dict, level: int, steps: int = 3, sequence_parallel: bool = False):
    """This rank's worst relative errors against the single-device model, per quantity."""
    import optimum_parallel as op

    mesh = op.init_mesh(**sizes)
    config = tiny_config(model_type, **MOE[model_type])
    reference = build_model(config)
    random_biases(reference)
    model = copy.deepcopy(reference)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if mesh.tp_size > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model, sequence_parallel_enabled=sequence_parallel)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})

    replicas, replica = mesh.data_parallel_size, mesh.data_parallel_rank
    batch = uneven_batch(config, 2 * replicas)
    local = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
    share = torch.tensor(labelled(batch["labels"]) / replicas)  # each replica: token sum / (global count / replicas)
    counts = [labelled(batch["labels"][2 * r : 2 * r + 2]) for r in range(replicas)]

    seen = []  # the sequence length the first decoder layer's MLP / MoE block and its input norm see
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith(("layers.0.post_attention_layernorm", "layers.0.mlp", "layers.0.block_sparse_moe")):
            module.register_forward_pre_hook(lambda m, args, leaf=leaf: seen.append((leaf, args[0].shape[1])))
    errors: dict[str, float] = {}
    ref_params = dict(reference.named_parameters())
    losses = []
    for step in range(steps + 1):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        loss = model(**local, num_items_in_batch=share).loss
        loss.backward()
        losses.append(rel_err(replica_mean(loss, mesh), ref_loss))
        if step == 0:
            for name, param in model.named_parameters():
                errors[f"grad {name}"] = rel_err(whole(param.grad), reference_slice(param, ref_params[name].grad))
            ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
            errors["grad_norm"] = rel_err(op.grad_norm(model), ref_norm)
        ref_clipped = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        errors[f"clip norm {step}"] = rel_err(op.clip_grad_norm_(model, 0.5), ref_clipped)
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
    errors["loss"] = losses[0]
    if steps:
        errors["steps"] = max(losses[1:])
    out = {"errors": errors, "counts": counts, "optimizer": type(optimizer).__name__, "seen": sorted(set(seen))}
    if level == 1:  # the two ZeRO-1 parts' state, consolidated on dp x cp rank 0: a plain AdamW's over its params
        try:
            optimizer.state_dict()
            out["state_dict"] = "no error"
        except RuntimeError as err:
            out["state_dict"] = str(err)
        optimizer.consolidate_state_dict(to=0)
        if replica == 0:
            state = optimizer.state_dict()
            params = [p for group in optimizer.source_param_groups for p in group["params"]]
            names = {id(p): n for n, p in model.named_parameters()}
            out["groups"] = [len(g["params"]) for g in state["param_groups"]]
            out["params"], out["state_errors"] = len(list(model.parameters())), {}
            out["stated"] = len(state["state"])
            for i, values in state["state"].items():
                name = names[id(params[i])]
                for key, value in values.items():
                    expected = ref_optimizer.state[ref_params[name]][key]
                    if key != "step":
                        expected = reference_slice(params[i], expected)
                    out["state_errors"][f"{name}/{key}"] = rel_err(value, expected)
    if level >= 2:
        from optimum_parallel.expert_parallel import find_experts

        _, experts = find_experts(model)[0]
        out["expert_mesh"] = dist.get_process_group_ranks(experts.gate_up_proj.device_mesh.get_group())
    return out


CASES = [
    ("mixtral", dict(dp=4, ep=2), 1),
    ("mixtral", dict(dp=4, ep=2), 2),
    ("mixtral", dict(dp=4, ep=2), 3),
    ("qwen3_moe", dict(dp=4, ep=2), 1),
    ("qwen3_moe", dict(dp=4, ep=2), 3),
    ("mixtral", dict(dp=4, ep=4), 3),  # one rank per replica group
    ("mixtral", dict(dp=2, tp=2, ep=2), 1),
    ("mixtral", dict(dp=2, tp=2, ep=2), 2),
    ("mixtral", dict(dp=2, tp=2, ep=2), 3),
    ("deepseek_v3", dict(dp=4, ep=2), 2),
    # gpt_oss under tp: expert biases (gate_up split in whole gate/up pairs, down added once), attention sinks per head
    ("gpt_oss", dict(dp=2, tp=2), 0),
    ("gpt_oss", dict(dp=2, tp=2, ep=2), 0),
    ("gpt_oss", dict(dp=2, tp=2, ep=2), 3),
]
# The loss after AdamW steps is below fp32's noise floor here, so only the first step is checked. One process started
# from weights perturbed by relative 1e-7 drifts as far: a few gradient elements cancel to ~1e-9, and AdamW's first
# update (lr x sign) flips with them. qwen3_moe at tp=2 (4 rows): ~2.5e-5 at ep=1 and level 0 already, noise floor
# 1.9e-5 (loss), 1.2e-4 (clip norm); gpt_oss at dp=4 (8 rows, biases random): 4e-5 (clip norm after 3 steps), noise
# floor 2e-5 (loss), 4.6e-4 (clip norm). gpt_oss's 3 steps are checked at dp=2 (4 rows; noise floor 2.6e-7, 2e-6).
STEP_ZERO_CASES = [("qwen3_moe", dict(dp=2, tp=2, ep=2), 2), ("gpt_oss", dict(dp=4, ep=2), 3)]


def _id(model_type: str, sizes: dict, level: int) -> str:
    return f"{model_type}-{'_'.join(f'{k}{v}' for k, v in sizes.items())}-L{level}"


@pytest.mark.parametrize(
    "model_type,sizes,level,steps",
    [(*case, 3) for case in CASES] + [(*case, 0) for case in STEP_ZERO_CASES],
    ids=[_id(*case) for case in CASES] + [_id(*case) + "-first_step" for case in STEP_ZERO_CASES],
)
def test_sharding_level_matches_one_process(pool, model_type, sizes, level, steps):
    results = pool.run(check_level, model_type, sizes, level, steps)
    assert len(set(map(tuple, (r["counts"] for r in results)))) == 1 and len(set(results[0]["counts"])) > 1
    for rank, result in enumerate(results):
        worst = {k: v for k, v in result["errors"].items() if v > TOL}
        assert not worst, f"rank {rank}: {worst}"
        if level == 1:
            assert result["optimizer"] == "ExpertSplitOptimizer"
            assert "consolidate_state_dict(to=0)" in result["state_dict"], result["state_dict"]
            if rank < sizes.get("tp", 1):  # dp x cp rank 0: every parameter's state, in the caller's one group
                assert result["groups"] == [result["params"]] and result["stated"] == result["params"], result
                # the state after 4 AdamW steps: last-bit gradient differences grow as in the weights (a wrong slice
                # or parameter would be off by O(1))
                assert max(result["state_errors"].values()) <= 1e-3, result["state_errors"]
        if level >= 2:  # the experts are sharded over the ranks holding the same experts only
            dp_rank = rank // sizes.get("tp", 1)
            ep = sizes["ep"]
            replicas = [r for r in range(sizes["dp"]) if r % ep == dp_rank % ep]
            assert result["expert_mesh"] == [r * sizes.get("tp", 1) + rank % sizes.get("tp", 1) for r in replicas]


def check_router_aux_loss(model_type: str, sizes: dict, level: int, steps: int = 3) -> dict:
    """`output_router_logits=True`: each replica's loss is what one device computes on that replica's rows (language
    model mean + coef x the load-balancing loss of its routing); the gradients, once data parallelism averages them,
    are the mean of those single-device gradients over the replicas."""
    import optimum_parallel as op

    mesh = op.init_mesh(**sizes)
    config = tiny_config(model_type, **MOE[model_type], output_router_logits=True, router_aux_loss_coef=0.1)
    reference = build_model(config)
    model = copy.deepcopy(reference)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if mesh.tp_size > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})
    replicas, replica = mesh.data_parallel_size, mesh.data_parallel_rank
    batch = uneven_batch(config, 2 * replicas)
    rows = [{k: v[2 * r : 2 * r + 2] for k, v in batch.items()} for r in range(replicas)]
    errors, aux = {}, []
    ref_params = dict(reference.named_parameters())
    for step in range(steps + 1):
        ref_losses = []
        for part in rows:  # one device, replica by replica: the mean of their gradients
            out = reference(**part)
            (out.loss / replicas).backward()
            ref_losses.append(out.loss.detach())
            aux.append(float(out.aux_loss))
        out = model(**rows[replica])
        out.loss.backward()
        errors[f"loss {step}"] = rel_err(out.loss, ref_losses[replica])
        if step == 0:
            for name, param in model.named_parameters():
                errors[f"grad {name}"] = rel_err(whole(param.grad), reference_slice(param, ref_params[name].grad))
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
    return {"errors": errors, "aux": min(aux)}


AUX_CASES = [
    ("mixtral", dict(dp=4, ep=2), 0),
    ("qwen3_moe", dict(dp=4, ep=2), 2),
    ("mixtral", dict(dp=2, tp=2, ep=2), 1),
]


@pytest.mark.parametrize("model_type,sizes,level", AUX_CASES, ids=[_id(*case) for case in AUX_CASES])
def test_router_aux_loss_per_replica(pool, model_type, sizes, level):
    for rank, result in enumerate(pool.run(check_router_aux_loss, model_type, sizes, level)):
        assert result["aux"] > 0  # the load-balancing loss is in the loss
        worst = {k: v for k, v in result["errors"].items() if v > TOL}
        assert not worst, f"rank {rank}: {worst}"
