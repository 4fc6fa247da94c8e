"""Common steps of a custom training loop (issue 33: per-rank seeding with dropout, torch's clipping, a sampler over
the world, an optimizer made before parallelize, save_pretrained, a resume), written as a user writes them: each gives
one device's answer or raises naming the fix, on every rank, without a hang (4 ranks, gloo).

Randomness: with dropout on and every rank seeded differently before parallelize, replicated parameters stay
bit-identical over the tp ranks (they share the default stream), and the masks of a split region (attention over a
rank's heads) differ between tp ranks (their own streams), at tp=2, tp=2 + sp, dp=2 x tp=2 and pp=2.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _models import build_model, make_batch, rel_err, tiny_config, whole_logits
from test_families import AUTO, family_config, make_inputs

WORLD_SIZE = 4
DROPOUT = {  # dropout 0.1 everywhere the family has it
    "gpt2": dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
    "bert": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
    "t5": dict(dropout_rate=0.1),
    "llama": dict(attention_dropout=0.1),
}
TASK = {"gpt2": "causal", "bert": "mlm", "t5": "s2s", "llama": "causal"}


def _replicated_equal(model, group) -> tuple[int, int]:
    """(replicated parameters bit-identical over `group`, replicated parameters)."""
    from optimum_parallel.mesh.loaded import local_tensor

    same = total = 0
    for _, param in sorted(model.named_parameters()):
        if getattr(param, "shard_layout", None) is not None:
            continue
        mine = local_tensor(param).detach().contiguous()
        copies = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, mine, group=group)
        total += 1
        same += all(torch.equal(c, copies[0]) for c in copies)
    return same, total


def _split_masks(model, batch: dict, hidden: int) -> tuple[list, list]:
    """The dropout masks one training forward draws, as (split: attention over this rank's heads, or features that
    are not the `hidden` ones, e.g. T5's MLP between its column and row layers; replicated: hidden states)."""
    split, replicated = [], []
    original = torch.nn.functional.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = original(x, p, training, inplace)
        if training and p > 0:
            kind = split if x.dim() == 4 or x.shape[-1] != hidden else replicated
            kind.append((out == 0).flatten()[:4096].to(torch.uint8))
        return out

    torch.nn.functional.dropout = recording
    try:
        model(**batch)
    finally:
        torch.nn.functional.dropout = original
    return split, replicated


def check_dropout(family: str, layout: str) -> dict:
    import optimum_parallel as op

    sizes = {"tp2": dict(dp=2, tp=2), "tp2-sp": dict(dp=2, tp=2), "dp2-tp2": dict(dp=2, tp=2), "pp2": dict(pp=2, tp=2)}
    mesh = op.init_mesh(**sizes[layout])
    config = family_config(family, **DROPOUT[family]) if family != "llama" else tiny_config("llama", **DROPOUT[family])
    torch.manual_seed(0)
    model = AUTO[TASK[family]].from_config(config, attn_implementation="eager").float()
    torch.manual_seed(100 + dist.get_rank())  # every rank seeded its own way, as `seed + rank` scripts do
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kwargs = {"sequence_parallel_enabled": True} if layout == "tp2-sp" else {}
    if layout == "pp2":
        kwargs["pipeline_parallel_num_microbatches"] = 2
    model = parallelizer.parallelize(model, **kwargs)
    model.train()
    if layout == "dp2-tp2":
        model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    inputs = make_inputs(config, TASK[family], batch=4) if family != "llama" else make_batch(config, batch=4)
    if layout == "dp2-tp2":
        inputs = {k: v.chunk(2)[mesh.rank("dp")] for k, v in inputs.items()}
    result = {}
    if layout != "pp2":
        hidden = getattr(config, "hidden_size", None) or config.d_model
        split, replicated = _split_masks(model, inputs, hidden)
        masks = {
            "split": torch.cat(split) if split else None,
            "replicated": torch.cat(replicated) if replicated else None,
        }
        for kind, mask in masks.items():
            if mask is None:
                continue
            copies = [torch.empty_like(mask) for _ in range(mesh.size("tp"))]
            dist.all_gather(copies, mask, group=mesh.tp_group)
            result[f"{kind}_masks_equal"] = torch.equal(copies[0], copies[1])
    for _ in range(5):
        loss = model.run_train(**inputs) if layout == "pp2" else model(**inputs).loss
        if layout != "pp2":
            loss.backward()
        op.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    result["same"], result["total"] = _replicated_equal(model, mesh.tp_group)
    op.check_replicas(model, optimizer)  # raises if any copy drifted
    return result


DROPOUT_CASES = [
    ("gpt2", "tp2"),
    ("bert", "tp2"),
    ("t5", "tp2"),
    ("llama", "tp2-sp"),
    ("gpt2", "dp2-tp2"),
    ("llama", "pp2"),
]


@pytest.mark.parametrize("family,layout", DROPOUT_CASES, ids=[f"{f}-{lay}" for f, lay in DROPOUT_CASES])
def test_dropout_replicas_stay_identical_and_split_masks_differ(pool, family, layout):
    for rank, result in enumerate(pool.run(check_dropout, family, layout)):
        assert result["total"] > 0 and result["same"] == result["total"], f"rank {rank}: {result}"
        if layout != "pp2":
            assert result["split_masks_equal"] is False, f"rank {rank}: split regions drew the same masks: {result}"
            if "replicated_masks_equal" in result:
                assert result["replicated_masks_equal"] is True, f"rank {rank}: {result}"


# ----------------------------------------------------------------------------------------------- torch's clip


def torch_clip() -> str:
    import optimum_parallel as op

    op.init_mesh(dp=2, tp=2)
    config = tiny_config("llama")
    model = op.ParallelizersManager.parallelizer_for_model(build_model(config)).parallelize(build_model(config))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(3):
            model(**make_batch(config)).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # each rank's norm of its own shards
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_torch_clip_is_caught_on_every_rank(pool):
    for message in pool.run(torch_clip):
        assert "must be the same on ranks" in message and "op.clip_grad_norm_(model, max_norm)" in message, message


def perturbed_replica() -> tuple[str, str]:
    """check_replicas passes, then raises once one rank's copy of a replicated weight is nudged."""
    import optimum_parallel as op

    op.init_mesh(dp=2, tp=2)
    config = tiny_config("llama")
    model = op.ParallelizersManager.parallelizer_for_model(build_model(config)).parallelize(build_model(config))
    op.check_replicas(model)
    if dist.get_rank() == 3:
        with torch.no_grad():
            model.model.norm.weight[0] += 1e-6
    try:
        op.check_replicas(model)
    except RuntimeError as err:
        return "raised", str(err)
    return "passed", ""


def test_check_replicas_names_the_parameter_and_ranks(pool):
    for rank, (outcome, message) in enumerate(pool.run(perturbed_replica)):
        if rank in (2, 3):  # the tp group holding the nudged copy
            assert outcome == "raised" and "'model.norm.weight'" in message and "ranks [3]" in message, message
        else:
            assert outcome == "passed", message


# ----------------------------------------------------------------------------------------------- the batch


def sampler_over_the_world(mode: str) -> dict:
    """Each rank reads other rows (a DistributedSampler over the world): "check" raises; "broadcast" takes tp rank
    0's rows, and ranks other than tp rank 0 may pass None."""
    import optimum_parallel as op

    mesh = op.init_mesh(dp=2, tp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    model = op.ParallelizersManager.parallelizer_for_model(reference).parallelize(
        copy.deepcopy(reference), shared_batch=mode
    )
    rows = make_batch(config, batch=4)
    mine = {k: v[dist.get_rank() :: 4] for k, v in rows.items()}  # DistributedSampler(num_replicas=4)
    if mode == "broadcast" and mesh.rank("tp") != 0:
        mine = {k: None for k in mine}
    try:
        loss = model(**mine).loss.item()
    except ValueError as err:
        return {"error": str(err)}
    first = mesh.ranks("tp")[0]
    expected = reference(**{k: v[first::4] for k, v in rows.items()}).loss.item()
    return {"loss": loss, "expected": expected}


def test_a_sampler_over_the_world_raises_on_every_rank(pool):
    for result in pool.run(sampler_over_the_world, "check"):
        message = result.get("error", "")
        assert "must all be given the same batch" in message and "num_replicas=mesh.size('batch')" in message, result
        assert "shared_batch='broadcast'" in message, result


def test_broadcast_takes_the_first_ranks_batch(pool):
    for result in pool.run(sampler_over_the_world, "broadcast"):
        assert "loss" in result and rel_err(torch.tensor(result["loss"]), torch.tensor(result["expected"])) <= 1e-5


# ----------------------------------------------------------------------------------------------- an optimizer first


def optimizer_first(entry: str, kind: str, level: int | None = None) -> dict:
    """The optimizer built on model.parameters() before parallelize, and never rebuilt; 4 steps against one device."""
    import optimum_parallel as op

    mesh = op.init_mesh(dp=2, tp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    model = copy.deepcopy(reference)
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if kind == "adamw" else (lambda ps: torch.optim.SGD(ps, lr=0.5))
    optimizer, ref_optimizer = make(model.parameters()), make(reference.parameters())
    if entry == "parallelizer":
        model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    else:
        plan = op.ParallelizersManager.parallelizer_for_model(model).plan(model, mesh, True, False)
        config_ = {"mp_config": {"parallelize_plan": plan}}
        if level is not None:
            config_["dp_config"] = {"sharding_level": level}
        op.parallelize(model, optimizer, mesh, config_)  # the returned optimizer is dropped, as a user might
    batch = make_batch(config)
    losses, errors = [], []
    try:
        for _ in range(4):
            loss = model(**batch).loss
            ref_loss = reference(**batch).loss
            for o, value in ((optimizer, loss), (ref_optimizer, ref_loss)):
                value.backward()
                o.step()
                o.zero_grad()
            losses.append(loss.item())
            errors.append(rel_err(loss, ref_loss))
    except RuntimeError as err:
        return {"error": str(err)}
    return {"worst": max(errors), "losses": losses}


@pytest.mark.parametrize("entry,kind", [("parallelizer", "adamw"), ("parallelizer", "sgd"), ("paddle", "adamw")])
def test_an_optimizer_made_first_steps_the_parallel_model(pool, entry, kind):
    for result in pool.run(optimizer_first, entry, kind):
        assert result.get("worst", 1.0) <= 1e-5, result


def test_an_optimizer_made_first_that_fsdp_replaced_raises_naming_the_fix(pool):
    for result in pool.run(optimizer_first, "paddle", "adamw", 3):
        message = result.get("error", "")
        assert "built before parallelization" in message and "op.parallelize(model, optimizer" in message, result


# ----------------------------------------------------------------------------------------------- save_pretrained


def trained_and_saved(layout: str, directory: str) -> dict:
    """One training step at `layout`, then save_pretrained on every rank; the full logits to compare with."""
    import optimum_parallel as op

    sizes = {
        "tp2": dict(dp=2, tp=2),
        "tp2-sp": dict(dp=2, tp=2),
        "pp2": dict(pp=2, tp=2),
        "dp2-tp2-L3": dict(dp=2, tp=2),
        "dp4-L2": dict(dp=4, tp=1),
        "cp2-tp2": dict(cp=2, tp=2),
        "ep2": dict(dp=4, tp=1, ep=2),
    }[layout]
    mesh = op.init_mesh(**sizes)
    family = "mixtral" if layout == "ep2" else "llama"
    config = (
        tiny_config(family, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
        if family == "mixtral"
        else tiny_config(family)
    )
    model = build_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = make_batch(config)
    if layout in ("tp2", "tp2-sp", "pp2", "cp2-tp2"):
        kwargs = {"sequence_parallel_enabled": layout == "tp2-sp"}
        if layout == "pp2":
            kwargs["pipeline_parallel_num_microbatches"] = 2
        model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model, **kwargs)
        if layout == "cp2-tp2":
            model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    else:
        level = {"dp2-tp2-L3": 3, "dp4-L2": 2, "ep2": 0}[layout]
        dp_config = {"dp_config": {"sharding_level": level}}
        if layout == "dp2-tp2-L3":
            plan = op.ParallelizersManager.parallelizer_for_model(model).plan(model, mesh, True, False)
            dp_config["mp_config"] = {"parallelize_plan": plan}
        model, optimizer = op.parallelize(model, optimizer, mesh, dp_config)
    if layout == "pp2":
        model.run_train(**batch)
    else:
        model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.save_pretrained(directory)
    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        logits = model.run_eval(**inputs).logits if layout == "pp2" else model(**inputs).logits
    if logits is not None and logits.shape[-1] != config.vocab_size:  # a last stage's vocab slice
        logits = whole_logits(model, logits)
    return {"logits": logits, "files": sorted(os.listdir(directory))}


SAVE_LAYOUTS = ["tp2", "tp2-sp", "pp2", "dp2-tp2-L3", "dp4-L2", "cp2-tp2", "ep2"]


@pytest.mark.parametrize("layout", SAVE_LAYOUTS)
def test_save_pretrained_writes_what_one_device_loads(pool, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    directory = str(tmp_path / layout)
    results = pool.run(trained_and_saved, layout, directory)
    assert "config.json" in results[0]["files"] and any(f.endswith(".safetensors") for f in results[0]["files"])
    loaded = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").float().eval()
    config = loaded.config
    batch = make_batch(config)
    with torch.no_grad():
        logits = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    trained = next(r["logits"] for r in results if r["logits"] is not None)
    real = batch["attention_mask"].bool()  # padded positions' logits are no token's (cp's masked rows differ there)
    assert rel_err(logits[real], trained[real]) <= 1e-5, layout


def save_on_rank_zero_only(directory: str) -> str:
    import optimum_parallel as op
    from optimum_parallel.engine import full_model

    op.init_mesh(dp=2, tp=2)
    config = tiny_config("llama")
    model = op.ParallelizersManager.parallelizer_for_model(build_model(config)).parallelize(build_model(config))
    full_model.EVERY_RANK_TIMEOUT = 3.0
    if dist.get_rank() != 0:
        return "skipped"
    try:
        model.save_pretrained(directory)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_save_pretrained_on_some_ranks_raises_naming_the_fix(pool, tmp_path):
    directory = str(tmp_path / "partial")
    message = pool.run(save_on_rank_zero_only, directory)[0]
    assert "called on 1 of 4 ranks" in message and "call it on every rank" in message, message
    assert not os.path.exists(directory), "nothing is written before the error"


def full_state_dict_equals_one_device() -> float:
    import optimum_parallel as op

    op.init_mesh(dp=2, tp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    model = op.ParallelizersManager.parallelizer_for_model(reference).parallelize(copy.deepcopy(reference))
    whole = op.full_state_dict(model, tempfile.gettempdir())
    expected = reference.state_dict()
    assert set(whole) == set(expected), sorted(set(whole) ^ set(expected))
    return max(rel_err(whole[k], expected[k]) for k in expected)


def test_full_state_dict_is_the_single_device_one(pool):
    assert max(pool.run(full_state_dict_equals_one_device)) == 0.0


# ----------------------------------------------------------------------------------------------- resume with dropout


def resume_with_dropout(layout: str, directory: str) -> dict:
    """Llama with attention dropout (split over tp) and every rank seeded its own way: 2 steps, a sharded checkpoint
    (model, optimizer, every rank's generators), 2 more steps; a fresh model loading it takes the same 2 steps."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import load_model_checkpoint, save_model_checkpoint

    mesh = op.init_mesh(**({"dp": 2, "tp": 2} if layout == "tp2" else {"pp": 2, "tp": 2}))
    config = tiny_config("llama", attention_dropout=0.2)
    batch = make_batch(config, batch=4)
    if layout == "tp2":  # each dp replica its rows; data parallelism averages (dropout differs per replica, as DDP)
        batch = {k: v.chunk(2)[mesh.rank("dp")] for k, v in batch.items()}

    def build(seed: int):
        model = build_model(config, seed=seed)
        torch.manual_seed(100 + dist.get_rank() + seed)
        kwargs = {"pipeline_parallel_num_microbatches": 2} if layout == "pp2" else {}
        model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model, **kwargs)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if layout == "tp2":
            model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
        return model, optimizer

    def step(model, optimizer) -> float:
        loss = model.run_train(**batch) if layout == "pp2" else model(**batch).loss
        if layout != "pp2":
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    model, optimizer = build(0)
    for _ in range(2):
        step(model, optimizer)
    save_model_checkpoint(model, directory, optimizer=optimizer)
    straight = [step(model, optimizer) for _ in range(2)]
    fresh, fresh_optimizer = build(7)
    load_model_checkpoint(fresh, directory, optimizer=fresh_optimizer)
    resumed = [step(fresh, fresh_optimizer) for _ in range(2)]
    return {"straight": straight, "resumed": resumed}


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_resume_with_dropout_is_bit_identical(pool, tmp_path, layout):
    for result in pool.run(resume_with_dropout, layout, str(tmp_path / layout)):
        assert result["resumed"] == result["straight"], result
