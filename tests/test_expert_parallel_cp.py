"""Expert parallelism composed with context parallelism (gloo, 4 ranks): the experts split over ep ranks of dp x cp
(ep over cp alone, over dp x cp, or over both), the sequence over cp, against one process on the whole batch.

Every dp replica trains its own rows (the cp ranks of a replica share them and each keeps its load-balanced chunks);
rows are padded and carry -100 labels so that replicas hold different numbers of labelled tokens: each replica's loss
is its token sum over (the global count / dp), so the mean over dp x cp of the ranks' losses is the global loss. The
dispatch sends every (token, expert) row of a rank's chunks to the rank holding the expert; each expert's gradient
must come out as the mean over dp x cp (DDP's semantics), at sharding levels 0-3. The router aux loss is one
device's on the replica's whole rows. Checkpoints save, load and resume at dp=2 x cp=2 x ep=2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _models import build_model, rel_err, tiny_config
from test_expert_parallel import MOE
from test_expert_parallel_checkpoint_levels import assemble, full_view, local_snapshot
from test_expert_parallel_layouts import reference_slice, replica_mean, whole
from transformers import AutoModelForCausalLM

WORLD_SIZE = 4
SEQ = 17  # not a multiple of 2 x cp: padded inside with masked, ignored tokens
TOL = 1e-5


def cp_batch(config, rows: int) -> dict[str, torch.Tensor]:
    """`rows` rows: even rows left-padded, odd rows right-padded (by 0-4 tokens), and 0-3 more -100 labels. After
    left padding the first real token's label is -100 too: under cp a padding query that sees no key gets 0 where
    transformers attends it to masked keys (README, context parallelism), and its logits predict that token."""
    gen = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, config.vocab_size, (rows, SEQ), generator=gen)
    attention_mask = torch.ones(rows, SEQ, dtype=torch.long)
    labels = input_ids.clone()
    for i in range(rows):
        pad = (3 * i + 1) % 5
        if i % 2 == 0:
            attention_mask[i, :pad] = 0
            labels[i, : pad + 1] = -100
        elif pad:
            attention_mask[i, -pad:] = 0
            labels[i, -pad:] = -100
        if i % 3:
            labels[i, SEQ // 2 - (i % 4) : SEQ // 2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def labelled(labels: torch.Tensor) -> int:
    return int((labels[..., 1:] != -100).sum())


def check_cp_training(model_type: str, sizes: dict, level: int, steps: int = 3) -> dict:
    """This rank's worst relative errors against the single-device model on the whole batch, per quantity."""
    import optimum_parallel as op
    from optimum_parallel.expert_parallel import find_experts

    mesh = op.init_mesh(**sizes)
    config = tiny_config(model_type, **MOE[model_type])
    reference = build_model(config)
    model = copy.deepcopy(reference)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if mesh.tp_size > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})

    dp, replica = mesh.size("dp"), mesh.rank("dp")
    batch = cp_batch(config, 2 * dp)
    local = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
    share = torch.tensor(labelled(batch["labels"]) / dp)  # each dp replica: its token sum / (global count / dp)
    counts = [labelled(batch["labels"][2 * r : 2 * r + 2]) for r in range(dp)]

    seen = []  # the sequence length each MoE block sees (this rank's chunks) and the rows it dispatches
    for _, module in find_experts(model):
        module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
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
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
    errors["loss"] = losses[0]
    if steps:
        errors["steps"] = max(losses[1:])
    local_experts = {whole(m.gate_up_proj).shape[0] for _, m in find_experts(model)}
    return {"errors": errors, "counts": counts, "tokens": sorted(set(seen)), "local_experts": local_experts}


CASES = [  # model_type, mesh, sharding level
    ("mixtral", dict(dp=2, cp=2, ep=2), 0),  # an expert group is the cp pair of a dp replica
    ("qwen3_moe", dict(dp=2, cp=2, ep=2), 0),
    ("mixtral", dict(dp=2, cp=2, ep=2), 2),
    ("qwen3_moe", dict(dp=2, cp=2, ep=2), 3),
    ("mixtral", dict(dp=2, cp=2, ep=4), 0),  # ep over dp x cp: one rank per replica group
    ("qwen3_moe", dict(dp=2, cp=2, ep=4), 3),
    ("mixtral", dict(cp=4, ep=2), 0),  # ep over cp alone (dp=1)
    ("qwen3_moe", dict(cp=4, ep=2), 2),
    ("mixtral", dict(cp=2, tp=2, ep=2), 0),  # dp=1 x cp=2 x ep=2, with tp
    ("qwen2_moe", dict(dp=2, cp=2, ep=2), 0),  # a shared expert beside the routed ones
    ("olmoe", dict(dp=2, cp=2, ep=2), 2),
]


def _id(model_type: str, sizes: dict, level: int) -> str:
    return f"{model_type}-{'_'.join(f'{k}{v}' for k, v in sizes.items())}-L{level}"


@pytest.mark.parametrize("model_type,sizes,level", CASES, ids=[_id(*case) for case in CASES])
def test_cp_x_ep_training_matches_one_process(pool, model_type, sizes, level):
    results = pool.run(check_cp_training, model_type, sizes, level)
    cp, ep = sizes["cp"], sizes["ep"]
    padded = -(-SEQ // (2 * cp)) * 2 * cp
    for rank, result in enumerate(results):
        worst = {k: v for k, v in result["errors"].items() if v > TOL}
        assert not worst, f"rank {rank}: {worst}"
        # each rank's MoE blocks route only its chunks of the sequence (2 rows x padded / cp tokens)
        assert result["tokens"] == [2 * padded // cp], result["tokens"]
        assert result["local_experts"] == {4 // ep}
    if sizes.get("dp", 1) > 1:  # the replicas hold different numbers of labelled tokens
        assert len(set(results[0]["counts"])) > 1, results[0]["counts"]


# ----------------------------------------------------------------------------------------------- checkpoints

ROWS = 4  # the global batch: 2 rows per dp replica at dp=2, 1 at dp=4
LR = 1e-2


def _parallel(sizes: dict, model_type: str, seed: int, level: int):
    """A tiny MoE (random with `seed`) and its AdamW on a mesh of `sizes` at sharding `level`; its batch rows."""
    import optimum_parallel as op

    mesh = op.init_mesh(**sizes)
    model = build_model(tiny_config(model_type, **MOE[model_type]), seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})
    dp, rows = mesh.size("dp"), ROWS // mesh.size("dp")
    batch = cp_batch(model.config, ROWS)
    local = {k: v[rows * mesh.rank("dp") : rows * (mesh.rank("dp") + 1)] for k, v in batch.items()}
    local["num_items_in_batch"] = torch.tensor(labelled(batch["labels"]) / dp)

    def step() -> float:
        loss = model(**local).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return replica_mean(loss, mesh).item()

    return model, optimizer, step


def cp_save_resume(model_type: str, sizes: dict, level: int, ckpt: str, before: int = 2, after: int = 2) -> dict:
    """`before` steps, save with the optimizer, `after` more steps; a fresh model (other weights, a step of its own)
    loads it and trains `after` steps; one at dp=4 x ep=2 (no cp, the same global batch) loads it and takes a step.
    Rank 0 also trains the single model on the whole batch `before` steps."""
    from optimum_parallel.checkpoint import load_model_checkpoint, save_model_checkpoint

    model, optimizer, step = _parallel(sizes, model_type, 0, level)
    for _ in range(before):
        step()
    save_model_checkpoint(model, ckpt, optimizer=optimizer)
    saved, view = local_snapshot(model, optimizer), full_view(model, optimizer)
    straight = [step() for _ in range(after)]

    fresh, fresh_optimizer, fresh_step = _parallel(sizes, model_type, 99, level)
    fresh_step()  # state of its own, which the checkpoint must replace
    load_model_checkpoint(fresh, ckpt, optimizer=fresh_optimizer)
    loaded = local_snapshot(fresh, fresh_optimizer)
    resumed = [fresh_step() for _ in range(after)]
    differ = sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k]))

    no_cp, no_cp_optimizer, no_cp_step = _parallel(dict(dp=4, ep=2), model_type, 99, 0)
    load_model_checkpoint(no_cp, ckpt, optimizer=no_cp_optimizer)
    out = {"view": view, "differ": differ, "keys": (sorted(saved), sorted(loaded)), "straight": straight}
    out.update(resumed=resumed, no_cp=no_cp_step())
    if dist.get_rank() == 0:
        reference = build_model(tiny_config(model_type, **MOE[model_type]), seed=0)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
        whole_batch = cp_batch(reference.config, ROWS)
        for _ in range(before):
            reference(**whole_batch).loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        out["reference"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        with torch.no_grad():
            out["reference_logits"] = reference(**whole_batch).logits
    return out


CKPT_CASES = [("mixtral", dict(dp=2, cp=2, ep=2), 0), ("qwen3_moe", dict(dp=2, cp=2, ep=2), 2)]


@pytest.mark.parametrize("model_type,sizes,level", CKPT_CASES, ids=[_id(*case) for case in CKPT_CASES])
def test_cp_x_ep_checkpoint_saves_loads_and_resumes(pool, tmp_path, model_type, sizes, level):
    """Bit-identical load and the uninterrupted run's losses; the files are cp's usual ones (experts written by the
    first replica of each expert group: the cp pair of dp rank 0), they consolidate to the single model trained alike
    and load without cp (dp=4 x ep=2) to take the same step."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import verify_checkpoint

    ckpt = tmp_path / "ckpt"
    results = pool.run(cp_save_resume, model_type, sizes, level, str(ckpt))
    for rank, result in enumerate(results):
        assert result["keys"][0] == result["keys"][1] and any("/exp_avg" in k for k in result["keys"][0]), rank
        assert result["differ"] == [], f"rank {rank}: loaded tensors differ: {result['differ'][:5]}"
        assert result["resumed"] == result["straight"], f"rank {rank}: {result['resumed']} != {result['straight']}"
        assert rel_err(torch.tensor(result["no_cp"]), torch.tensor(result["straight"][0])) <= TOL, result
    index = verify_checkpoint(ckpt)
    assert index.mesh == {"dp": 2, "pp": 1, "tp": 1, "ep": 2}, index.mesh
    for name, entry in ((n, e) for n, e in index.tensors.items() if e.experts):
        blocks = sorted({(s.ep_rank, tuple(s.experts)) for s in entry.shards})
        assert blocks == [(0, (0, 2)), (1, (2, 4))], (name, blocks)
    names = sorted(p.name for p in ckpt.glob("*-pp*.safetensors"))
    assert names == sorted(f"{k}-pp00-tp00{e}.safetensors" for k in ("model", "optimizer") for e in ("", "-ep01"))

    full = assemble([r["view"] for r in results])
    out = op.consolidate_checkpoint(ckpt, tmp_path / "hf", progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    state = model.state_dict()
    assert all(torch.equal(state[n], full[n]) for n in state), "consolidated weights differ from the trained ones"
    reference = results[0]["reference"]
    # AdamW turns last-bit gradient differences of near-zero gradients into updates of up to lr
    assert max(rel_err(state[n], reference[n]) for n in reference) <= 1e-3
    with torch.no_grad():
        logits = model(**cp_batch(model.config, ROWS)).logits
    assert rel_err(logits, results[0]["reference_logits"]) <= TOL


# ----------------------------------------------------------------------------------------------- the router aux loss


def check_cp_router_aux_loss(model_type: str, sizes: dict, level: int, steps: int = 3) -> dict:
    """`output_router_logits=True`: each dp replica's loss is what one device computes on the replica's rows (the
    language-model mean + coef x the load-balancing loss of all its real tokens' routing, although each cp rank routes
    only its chunks); the averaged gradients are the mean of those single-device gradients over the replicas."""
    import optimum_parallel as op

    mesh = op.init_mesh(**sizes)
    config = tiny_config(model_type, **MOE[model_type], output_router_logits=True, router_aux_loss_coef=0.1)
    reference = build_model(config)
    model = copy.deepcopy(reference)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})
    dp = mesh.size("dp")
    batch = cp_batch(config, 2 * dp)
    rows = [{k: v[2 * r : 2 * r + 2] for k, v in batch.items()} for r in range(dp)]
    errors, aux = {}, []
    with torch.no_grad():  # evaluation: the aux loss of the whole rows too, and this rank's routers' logits
        out = model(**rows[mesh.rank("dp")])
        ref = reference(**rows[mesh.rank("dp")])
    errors["eval aux"] = rel_err(out.aux_loss, ref.aux_loss)
    errors["eval loss"] = rel_err(out.loss, ref.loss)
    layers = len(out.router_logits)
    ref_params = dict(reference.named_parameters())
    for step in range(steps + 1):
        ref_losses, ref_aux = [], []
        for part in rows:  # one device, replica by replica: the mean of their gradients
            out = reference(**part)
            (out.loss / dp).backward()
            ref_losses.append(out.loss.detach())
            ref_aux.append(out.aux_loss.detach())
        out = model(**rows[mesh.rank("dp")])
        out.loss.backward()
        errors[f"loss {step}"] = rel_err(out.loss, ref_losses[mesh.rank("dp")])
        errors[f"aux {step}"] = rel_err(out.aux_loss, ref_aux[mesh.rank("dp")])
        aux.append(out.aux_loss.item())
        if step == 0:
            for name, param in model.named_parameters():
                errors[f"grad {name}"] = rel_err(whole(param.grad), reference_slice(param, ref_params[name].grad))
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
    return {"errors": errors, "aux": min(aux), "layers": layers}


AUX_CASES = [
    ("mixtral", dict(dp=2, cp=2, ep=2), 0),
    ("mixtral", dict(cp=4, ep=2), 2),
    ("qwen2_moe", dict(dp=2, cp=2, ep=2), 0),
    ("olmoe", dict(dp=2, cp=2, ep=2), 0),
]
# qwen3_moe with the aux loss: only the first step, its fp32 noise floor being above 1e-5 after AdamW steps (one process
# against itself with weights perturbed by relative 1e-7: the loss drifts 7e-6, 2.4e-5, 2.3e-5 after steps 1-3; here
# 6e-6, 2.1e-5, 1.9e-5, with the first step's loss, aux loss and every gradient within 1e-6)
FIRST_STEP_CASES = [("qwen3_moe", dict(dp=2, cp=2, ep=2), 2), ("qwen3_moe", dict(cp=4, ep=2), 0)]


@pytest.mark.parametrize(
    "model_type,sizes,level,steps",
    [(*case, 3) for case in AUX_CASES] + [(*case, 0) for case in FIRST_STEP_CASES],
    ids=[_id(*case) for case in AUX_CASES] + [_id(*case) + "-first_step" for case in FIRST_STEP_CASES],
)
def test_router_aux_loss_is_one_devices_on_the_replicas_rows(pool, model_type, sizes, level, steps):
    for rank, result in enumerate(pool.run(check_cp_router_aux_loss, model_type, sizes, level, steps)):
        moe_layers = 1 if model_type == "qwen2_moe" else 2  # qwen2_moe's MOE config: layer 1 is a dense MLP
        assert result["aux"] > 0 and result["layers"] == moe_layers, result
        worst = {k: v for k, v in result["errors"].items() if v > TOL}
        assert not worst, f"rank {rank}: {worst}"
