"""Sharded checkpoints against the real single-device transformers model (gloo, 4 ranks): save -> consolidate ->
from_pretrained, reshard tp=2 -> 4 / 1 with optimizer state, resume, SIGKILL mid-save, corrupted files, CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _checks import train_step
from _killed_run import mark_reached, run_until_reached_then_kill
from _models import build_model, make_batch, rel_err, tiny_config, whole_logits
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import optimum_parallel.checkpoint  # noqa: F401  (`op.checkpoint` below: a test run alone has not imported it yet)

TOL = 1e-5
LR = 1e-2
LOAD = dict(dtype=torch.float32, attn_implementation="eager")
# tied embeddings, a vocabulary tp=4 splits unevenly, 2 kv heads that tp=4 replicates
CONFIG = dict(tie_word_embeddings=True, vocab_size=130, num_key_value_heads=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hf") / "llama"
    build_model(tiny_config("llama", **CONFIG), seed=7).save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------------------------- worker helpers


def _setup(hf_dir: str, tp: int, seed: int | None = None, new_mesh: bool = True):
    """Parallel model (lazily loaded from `hf_dir`, or random with `seed`) and its AdamW (two param groups)."""
    import optimum_parallel as op

    if new_mesh:
        op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    if seed is None:
        with op.lazy_load_for_parallelism(tensor_parallel_size=tp):
            model = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD)
    else:
        model = build_model(tiny_config("llama", **CONFIG), seed=seed)
    model.eval()
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = op.make_optimizer_constructor_lazy(torch.optim.AdamW)(groups, lr=LR, betas=(0.9, 0.95))
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    return parallelizer, model, parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)


def _full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter in full, gathered from the tp ranks by their layouts (independently of the checkpoint code)."""
    import optimum_parallel as op

    group = op.get_mesh().tp_group
    state = {}
    for name, param in model.named_parameters():
        layout = getattr(param, "shard_layout", None)
        local = param.detach().full_tensor() if hasattr(param, "full_tensor") else param.detach()  # FSDP2: over dp
        held: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(held, (layout, local.clone()), group=group)
        if layout is None or layout.dim is None:
            state[name] = held[0][1]
            continue
        full = torch.empty(layout.global_shape, dtype=param.dtype)
        for shard_layout, tensor in held:
            offset = 0
            for start, end in shard_layout.ranges:
                full.narrow(layout.dim, start, end - start).copy_(tensor.narrow(layout.dim, offset, end - start))
                offset += end - start
        state[name] = full
    return state


def _probe(model, optimizer, batch) -> dict:
    """Logits and loss now, then the loss after one more optimizer step (which needs the optimizer state)."""
    out = model(**batch)
    logits = whole_logits(model, out.logits).detach()
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return {"logits": logits, "loss": out.loss.item(), "next_loss": model(**batch).loss.item()}


# ----------------------------------------------------------------------------------------------- save / consolidate


def train_and_save(hf_dir: str, ckpt: str, tp: int, steps: int) -> dict:
    parallelizer, model, optimizer = _setup(hf_dir, tp)
    batch = make_batch(model.config)
    losses = [train_step(model, optimizer, batch) for _ in range(steps)]
    parallelizer.save_model_checkpoint(model, ckpt, optimizer=optimizer, as_regular=True)
    state = _full_state(model)
    return {"losses": losses, "state": state, **_probe(model, optimizer, batch)}


@pytest.fixture(scope="module")
def saved(pool, hf_dir, tmp_path_factory) -> dict:
    """A tp=2 (x dp=2) checkpoint after 2 AdamW steps, and what the parallel model looked like then."""
    ckpt = str(tmp_path_factory.mktemp("saved") / "step2")
    results = pool.run(train_and_save, hf_dir, ckpt, 2, 2)
    return {"ckpt": ckpt, **results[0]}


def test_consolidate_is_bit_identical_and_loads_in_transformers(saved, tmp_path):
    import optimum_parallel as op

    out = op.consolidate_checkpoint(saved["ckpt"], tmp_path / "hf", max_shard_size="60KB", progress=False)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    tensors = {k: v for f in files for k, v in load_file(out / f).items()}
    assert "lm_head.weight" not in tensors  # tied: stored once, as save_pretrained does
    for name, full in saved["state"].items():
        if name != "lm_head.weight":
            assert torch.equal(tensors[name], full), f"{name} differs from the trained parallel weights"
    model = AutoModelForCausalLM.from_pretrained(out, **LOAD)
    assert rel_err(model(**make_batch(model.config)).logits, saved["logits"]) <= TOL
    # as_regular=True wrote the same standard checkpoint next to the shards
    regular = AutoModelForCausalLM.from_pretrained(saved["ckpt"], **LOAD)
    assert all(torch.equal(a, b) for a, b in zip(regular.parameters(), model.parameters(), strict=True))


def test_config_is_saved_unmodified(saved, hf_dir):
    config = json.loads((Path(saved["ckpt"]) / "config.json").read_text())
    assert config == json.loads((Path(hf_dir) / "config.json").read_text())


# ----------------------------------------------------------------------------------------------- reshard / resume


def load_and_probe(hf_dir: str, ckpt: str, tp: int, with_optimizer: bool = True, seed: int | None = 99) -> dict:
    """Load `ckpt` into a parallel model with other weights (random with `seed`, or lazily loaded from `hf_dir`:
    file mappings) and probe it; `mapped`: how many parameters were file mappings before and after the load."""
    from optimum_parallel.io.file_mapping import is_file_mapping

    parallelizer, model, optimizer = _setup(hf_dir, tp, seed=seed)  # the checkpoint must replace the weights
    before = sum(is_file_mapping(p) for p in model.parameters())
    parallelizer.load_model_checkpoint(model, ckpt, optimizer=optimizer if with_optimizer else None)
    after = sum(is_file_mapping(p) for p in model.parameters())
    return {**_probe(model, optimizer, make_batch(model.config)), "mapped": (before, after)}


def test_load_into_lazily_loaded_weights_maps_the_checkpoint(pool, hf_dir, saved):
    """Weights still mapped from the HF files (just lazily loaded) are given mappings of the checkpoint's bytes
    instead of having every page copied and overwritten; the values, and the step after, are the saved ones, and
    that step writes into private pages, never into the checkpoint (its files still verify)."""
    from optimum_parallel.checkpoint import verify_checkpoint

    for rank, result in enumerate(pool.run(load_and_probe, hf_dir, saved["ckpt"], 2, True, None)):
        before, after = result["mapped"]
        assert before > 0 and after >= before, (rank, result["mapped"])
        assert rel_err(result["logits"], saved["logits"]) <= TOL, f"rank {rank}: logits"
        assert abs(result["next_loss"] - saved["next_loss"]) <= TOL * abs(saved["next_loss"]), f"rank {rank}: step"
    verify_checkpoint(saved["ckpt"])


@pytest.mark.parametrize("tp", [4, 1])
def test_reshard_keeps_logits_and_next_step(pool, hf_dir, saved, tmp_path, tp):
    import optimum_parallel as op

    target = op.reshard_checkpoint(saved["ckpt"], tmp_path / f"tp{tp}", tp=tp, progress=False)
    assert op.checkpoint.read_index(target).mesh["tp"] == tp
    for rank, result in enumerate(pool.run(load_and_probe, hf_dir, str(target), tp)):
        assert rel_err(result["logits"], saved["logits"]) <= TOL, f"rank {rank}: logits"
        assert abs(result["loss"] - saved["loss"]) <= TOL * abs(saved["loss"]), f"rank {rank}: loss"
        assert abs(result["next_loss"] - saved["next_loss"]) <= TOL * abs(saved["next_loss"]), f"rank {rank}: step"
    if tp == 4:  # the negative control: without the optimizer state the next step is clearly different
        fresh = pool.run(load_and_probe, hf_dir, str(target), tp, False)[0]
        assert abs(fresh["next_loss"] - saved["next_loss"]) > 1e-3


def resume_curve(hf_dir: str, ckpt: str, steps: int, stop: int) -> dict:
    """Losses of `steps` uninterrupted steps, and of `stop` steps + save + a fresh lazy model resumed from it."""
    parallelizer, model, optimizer = _setup(hf_dir, 2)
    batch = make_batch(model.config)
    straight = [train_step(model, optimizer, batch) for _ in range(steps)]
    parallelizer, model, optimizer = _setup(hf_dir, 2, new_mesh=False)
    resumed = [train_step(model, optimizer, batch) for _ in range(stop)]
    parallelizer.save_model_checkpoint(model, ckpt, optimizer=optimizer)
    del model, optimizer
    import optimum_parallel as op
    import optimum_parallel.engine.materialize as lazy

    with op.lazy_load_for_parallelism(tensor_parallel_size=2):
        model = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = op.make_optimizer_constructor_lazy(torch.optim.AdamW)(groups, lr=LR, betas=(0.9, 0.95))
    reads, original = [], lazy.read_slice
    lazy.read_slice = lambda *args: reads.append(args[1]) or original(*args)
    try:
        model = parallelizer.parallelize(model, checkpoint_dir=ckpt)  # the HF weights are not read as well
    finally:
        lazy.read_slice = original
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    parallelizer.load_model_checkpoint(model, ckpt, optimizer=optimizer)
    resumed += [train_step(model, optimizer, batch) for _ in range(steps - stop)]
    return {"straight": straight, "resumed": resumed, "hf_reads": reads}


def test_resume_gives_the_same_loss_curve(pool, hf_dir, tmp_path):
    for result in pool.run(resume_curve, hf_dir, str(tmp_path / "resume"), 6, 3):
        assert result["resumed"] == result["straight"] and result["hf_reads"] == [], result


def data_parallel_round_trip(hf_dir: str, ckpt: str, consolidated: str, level: int) -> dict:
    """dp=2 x tp=2 at sharding level 1 (ZeRO-1), 2 or 3 (FSDP2): 2 steps, save with the optimizer, one more step.
    A fresh model at that level loading the checkpoint holds the same weights and takes the same step, one at
    the next level (1 -> 2 -> 3 -> 0) too; consolidating gives the trained weights bit for bit."""
    import optimum_parallel as op
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    def build(new_mesh: bool, at: int = level):
        parallelizer, model, optimizer = _setup(hf_dir, 2, new_mesh=new_mesh)
        config = DataParallelConfig(sharding_level=at)
        return (parallelizer, *apply_data_parallel(model, optimizer, op.get_mesh(), config))

    def resume(at: int) -> tuple[dict, float]:
        parallelizer, model, optimizer = build(new_mesh=False, at=at)
        parallelizer.load_model_checkpoint(model, ckpt, optimizer=optimizer)
        return _full_state(model), train_step(model, optimizer, batch)

    parallelizer, model, optimizer = build(new_mesh=True)
    batch = make_batch(model.config)
    for _ in range(2):
        train_step(model, optimizer, batch)
    parallelizer.save_model_checkpoint(model, ckpt, optimizer=optimizer)
    trained = _full_state(model)
    continued = train_step(model, optimizer, batch)
    if dist.get_rank() == 0:
        op.consolidate_checkpoint(ckpt, consolidated, progress=False)
    dist.barrier()
    stored = {k: v for f in sorted(Path(consolidated).glob("*.safetensors")) for k, v in load_file(f).items()}
    dtensors = {hasattr(p, "full_tensor") for p in model.parameters()}
    loaded, resumed = resume(level)
    loaded_elsewhere, resumed_elsewhere = resume((level + 1) % 4)
    return {
        "dtensors": dtensors,
        "loaded_exact": all(torch.equal(trained[n], loaded[n]) for n in trained),
        "loaded_elsewhere_exact": all(torch.equal(trained[n], loaded_elsewhere[n]) for n in trained),
        "consolidated_exact": all(torch.equal(trained[n], stored[n]) for n in trained if n in stored),
        "consolidated_names": set(stored) <= set(trained) and len(set(trained) - set(stored)) <= 1,  # tied head
        "continued": continued,
        "resumed": resumed,
        "resumed_elsewhere": resumed_elsewhere,
    }


@pytest.mark.parametrize("level", [1, 2, 3])
def test_data_parallel_checkpoint_round_trip(pool, hf_dir, tmp_path, level):
    results = pool.run(data_parallel_round_trip, hf_dir, str(tmp_path / "ckpt"), str(tmp_path / "hf"), level)
    for rank, result in enumerate(results):
        assert result["dtensors"] == {level >= 2}, (rank, result)
        assert result["loaded_exact"] and result["loaded_elsewhere_exact"], (rank, result)
        assert result["consolidated_exact"] and result["consolidated_names"], (rank, result)
        assert result["resumed"] == result["continued"], (rank, result)
        assert abs(result["resumed_elsewhere"] - result["continued"]) <= 1e-6 * abs(result["continued"]), result


def _equal_token_batch(config) -> dict[str, torch.Tensor]:
    """Every row with the same number of labelled tokens: the mean over pipeline micro-batches is the batch mean."""
    batch = make_batch(config, batch=4)
    batch["attention_mask"][:] = 1
    batch["labels"] = batch["input_ids"].clone()
    batch["labels"][:, :2] = -100
    return batch


def pipeline_save(hf_dir: str, ckpt: str) -> dict:
    """pp=2 x tp=2 (tied embedding / LM head on the first / last stage): a step, save, another step."""
    import optimum_parallel as op

    op.init_mesh(pp=2, tp=2)
    with op.lazy_load_for_parallelism(tensor_parallel_size=2, pipeline_parallel_size=2):
        model = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD)
    optimizer = op.make_optimizer_constructor_lazy(torch.optim.AdamW)(model.parameters(), lr=LR)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    batch = _equal_token_batch(model.config)
    model.run_train(**batch)
    optimizer.step()
    optimizer.zero_grad()
    parallelizer.save_model_checkpoint(model, ckpt, optimizer=optimizer)
    loss = model.run_train(**batch)
    optimizer.step()
    return {"loss": loss.item(), "next_loss": model.run_eval(**batch).loss}


def pipeline_resume(hf_dir: str, ckpt: str) -> dict:
    """Load the pp=2 checkpoint, resharded to pp=1, on dp=2 x tp=2: the same two losses."""
    parallelizer, model, _ = _setup(hf_dir, 2, seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    parallelizer.load_model_checkpoint(model, ckpt, optimizer=optimizer)
    batch = _equal_token_batch(model.config)
    return {"loss": train_step(model, optimizer, batch), "next_loss": model(**batch).loss.item()}


def test_pipeline_checkpoint_reshards_to_one_stage(pool, hf_dir, tmp_path):
    import optimum_parallel as op

    saved = [r for r in pool.run(pipeline_save, hf_dir, str(tmp_path / "pp2")) if r["next_loss"] is not None][0]
    index = op.checkpoint.read_index(tmp_path / "pp2")
    assert index.tied == {"lm_head.weight": "model.embed_tokens.weight"} and "lm_head.weight" not in index.tensors
    assert {e.pp_rank for e in index.tensors.values()} == {0, 1} and set(index.optimizer["param_groups"]) == {"0", "1"}
    for layer in (0, 1):  # head counts known on both stages (resharding to tp=4 replicates the 2 kv heads)
        assert index.tensors[f"model.layers.{layer}.self_attn.k_proj.weight"].parts == [[32, 2]]
    op.consolidate_checkpoint(tmp_path / "pp2", tmp_path / "hf", progress=False)  # every stage, one HF checkpoint
    consolidated = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", **LOAD)
    with torch.no_grad():
        loss = consolidated(**_equal_token_batch(consolidated.config)).loss.item()
    assert abs(loss - saved["loss"]) <= TOL * saved["loss"], (loss, saved)
    op.reshard_checkpoint(tmp_path / "pp2", tmp_path / "pp1", tp=2, pp=1, progress=False)
    for result in pool.run(pipeline_resume, hf_dir, str(tmp_path / "pp1")):
        assert abs(result["loss"] - saved["loss"]) <= TOL * saved["loss"], (result, saved)
        assert abs(result["next_loss"] - saved["next_loss"].item()) <= TOL * saved["loss"], (result, saved)


# ----------------------------------------------------------------------------------------------- damaged checkpoints


def _damaged(saved: dict, tmp_path: Path, how: str) -> Path:
    ckpt = tmp_path / how
    shutil.copytree(saved["ckpt"], ckpt)
    victim = ckpt / "model-pp00-tp01.safetensors"
    if how == "truncated":
        os.truncate(victim, victim.stat().st_size - 100)
    elif how.startswith("altered"):  # the last tensor's bytes, or the first's (consolidate copies some in-kernel)
        data = bytearray(victim.read_bytes())
        data[-200 if how == "altered" else 8 + int.from_bytes(data[:8], "little") + 16] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif how == "missing":
        victim.unlink()
    elif how == "index":
        index = ckpt / "parallel_checkpoint.json"
        index.write_text(index.read_text().replace('"tp": 2', '"tp": 4', 1))
    return ckpt


@pytest.mark.parametrize(
    "how,message",
    [
        ("truncated", r"model-pp00-tp01\.safetensors: file has \d+ bytes, the checkpoint metadata expects"),
        ("altered", r"model-pp00-tp01\.safetensors: tensor '.*' does not match its checksum"),
        ("altered-first", r"model-pp00-tp01\.safetensors: tensor '.*' does not match its checksum"),
        ("missing", r"model-pp00-tp01\.safetensors: checkpoint file is missing"),
        ("index", r"parallel_checkpoint\.json: does not match the checksum in .*COMPLETE"),
    ],
)
def test_damaged_checkpoint_is_rejected(saved, tmp_path, how, message):
    import optimum_parallel as op
    from optimum_parallel.checkpoint import CheckpointError

    ckpt = _damaged(saved, tmp_path, how)
    with pytest.raises(CheckpointError, match=message):
        op.consolidate_checkpoint(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=message if not how.startswith("altered") else "sha256 does not match"):
        op.checkpoint.verify_checkpoint(ckpt)


def load_error(hf_dir: str, ckpt: str, tp: int) -> str:
    """The error this rank gets loading `ckpt` (caught here, so the pool keeps its processes)."""
    try:
        load_and_probe(hf_dir, ckpt, tp)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_damaged_or_mismatched_checkpoint_fails_every_rank(pool, hf_dir, saved, tmp_path):
    errors = pool.run(load_error, hf_dir, str(_damaged(saved, tmp_path, "truncated")), 2)
    for rank, error in enumerate(errors):
        if rank % 2:  # the tp rank 1 ranks read the truncated file ...
            assert error.startswith("CheckpointError: ") and "model-pp00-tp01.safetensors: file has" in error
        else:  # ... and the others stop as well, rather than train on or wait for them
            assert error.startswith("RuntimeError: loading") and "failed on other ranks: rank 1: Checkpoint" in error
    for error in pool.run(load_error, hf_dir, saved["ckpt"], 4):
        assert "saved at tp=2, pp=1, but the running mesh has tp=4, pp=1; convert it first" in error


# ----------------------------------------------------------------------------------------------- async saves


def async_against_blocking(hf_dir: str, out: str, level: int) -> dict:
    """dp=2 x tp=2 at sharding `level`: 2 steps, a blocking save and an async one of the same state, its background
    copy slowed down (OPTIMUM_PARALLEL_SLOW_AT) so that the next step's forward and backward run beside it and its
    optimizer step must wait for it; training goes on (steps that change every weight) while the async save is
    written, then its handle is waited for. The next async save waits for this one (one in flight) and both are
    complete once `wait_for_pending_save` returns."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import AsyncCheckpoint, wait_for_pending_save
    from optimum_parallel.checkpoint.crash import SLOW_ENV
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    parallelizer, model, optimizer = _setup(hf_dir, 2)
    model, optimizer = apply_data_parallel(model, optimizer, op.get_mesh(), DataParallelConfig(sharding_level=level))
    batch = make_batch(model.config)
    for _ in range(2):
        train_step(model, optimizer, batch)
    parallelizer.save_model_checkpoint(model, f"{out}/blocking", optimizer=optimizer)
    weight = next(model.parameters()).detach()
    weight = (weight.to_local() if hasattr(weight, "to_local") else weight).clone()
    os.environ[SLOW_ENV] = "copy:0.03"  # per tensor: far slower than the tiny model's forward and backward
    try:
        handle = parallelizer.save_model_checkpoint(model, f"{out}/async", optimizer=optimizer, async_save=True)
        assert isinstance(handle, AsyncCheckpoint)
        copying = [not handle.copy_done()]
        loss = model(**batch).loss
        loss.backward()
        copying.append(not handle.copy_done())
        optimizer.step()  # waits for the copy
        copying.append(not handle.copy_done())
        optimizer.zero_grad()
    finally:
        del os.environ[SLOW_ENV]
    after = next(model.parameters()).detach()
    changed = not torch.equal(weight, after.to_local() if hasattr(after, "to_local") else after)
    losses = [loss.item(), train_step(model, optimizer, batch)]  # while the files are written
    path = handle.wait()
    first = parallelizer.save_model_checkpoint(model, f"{out}/next", optimizer=optimizer, async_save=True)
    second = parallelizer.save_model_checkpoint(model, f"{out}/after", optimizer=optimizer, async_save=True)
    in_flight = [first.done(), wait_for_pending_save() == second.path, second.done()]
    return {
        "path": str(path),
        "losses": losses,
        "in_flight": in_flight,
        "snapshot": handle.snapshot_bytes,
        "copy_bytes": handle.copy_bytes,
        "copying": copying,
        "waited": handle.copy_waited,
        "changed": changed,
        "hooks": len(handle._hooks),
    }


@pytest.mark.parametrize("level", [0, 1, 3])
def test_async_save_writes_the_blocking_save_bytes(pool, hf_dir, tmp_path, level):
    """The same files, index and checksums, byte for byte, at every sharding level (ZeRO-1 consolidated, FSDP2
    gathered in the step), though the weights and optimizer state were copied in the background while the next
    step's forward and backward ran (a slowed copy: the optimizer step waited for it, and the weights it changed are
    not in the checkpoint); FSDP2's gathers are kept as made (only AdamW's step counts, plain tensors, are copied).
    The largest snapshot is what the memory planner counts for async saves (plus each tensor's 64-byte alignment)."""
    from optimum_parallel.checkpoint import verify_checkpoint
    from optimum_parallel.memory_planner.estimate import estimate_memory

    results = pool.run(async_against_blocking, hf_dir, str(tmp_path), level)
    assert all(r["path"] == str(tmp_path / "async") and r["in_flight"] == [True, True, True] for r in results), results
    assert all(r["changed"] and r["hooks"] == 0 for r in results), results
    writers = [r for r in results if r["snapshot"]]
    assert len(writers) == 2, results  # dp rank 0 of each tp rank
    for r in writers:
        assert r["copy_bytes"]["step"] == 0 and (r["copy_bytes"]["kept"] > 0) == (level == 3), r
    # at level 3 the tp rank 1 writer holds no plain tensor (AdamW's replicated step counts are tp rank 0's to write)
    copied = [r for r in results if r["copy_bytes"]["background"]]
    assert len(copied) == (1 if level == 3 else 2), results
    for r in results:
        overlapped = [True, True, False] if r in copied else [False, False, False]
        assert r["copying"] == overlapped and (r["waited"] > 0) == (r in copied), r
    blocking, written = tmp_path / "blocking", tmp_path / "async"
    verify_checkpoint(written)
    names = sorted(p.name for p in blocking.iterdir())
    assert names == sorted(p.name for p in written.iterdir()) and "optimizer-pp00-tp01.safetensors" in names
    assert all((blocking / n).read_bytes() == (written / n).read_bytes() for n in names), "bytes differ"
    assert (tmp_path / "next" / "COMPLETE").exists() and (tmp_path / "after" / "COMPLETE").exists()
    assert not list(tmp_path.glob(".*.partial"))
    planned = estimate_memory(tiny_config("llama", **CONFIG), tp=2, dp=2, sharding_level=level, dtype="fp32",
                              async_save=True).snapshot  # fmt: skip
    assert planned <= max(r["snapshot"] for r in results) <= planned * 1.01, (planned, results)


def async_copy_guards(hf_dir: str, out: str) -> dict:
    """What else waits for a slowed background copy before changing the tensors in place: `load_model_checkpoint`
    into the same model and optimizer, and `model.load_state_dict`; a save with no optimizer copies in the call."""
    from optimum_parallel.checkpoint import load_model_checkpoint, save_model_checkpoint
    from optimum_parallel.checkpoint.crash import SLOW_ENV

    parallelizer, model, optimizer = _setup(hf_dir, 2)
    batch = make_batch(model.config)
    train_step(model, optimizer, batch)
    parallelizer.save_model_checkpoint(model, f"{out}/a", optimizer=optimizer)
    train_step(model, optimizer, batch)
    parallelizer.save_model_checkpoint(model, f"{out}/b", optimizer=optimizer)
    state_b = {k: v.clone() for k, v in model.state_dict().items()}
    os.environ[SLOW_ENV] = "copy:0.02"
    try:
        loading = parallelizer.save_model_checkpoint(model, f"{out}/b-then-load", optimizer=optimizer, async_save=True)
        copying = [not loading.copy_done()]
        load_model_checkpoint(model, f"{out}/a", optimizer=optimizer)  # back to state a: waits for the copy first
        copying.append(not loading.copy_done())
        waited = [loading.copy_waited]
        by_hand = parallelizer.save_model_checkpoint(model, f"{out}/a-then-set", optimizer=optimizer, async_save=True)
        copying.append(not by_hand.copy_done())
        model.load_state_dict(state_b)  # the model back to state b (not its optimizer): waits for the copy first
        copying.append(not by_hand.copy_done())
        waited.append(by_hand.copy_waited)
    finally:
        del os.environ[SLOW_ENV]
    without = save_model_checkpoint(model, f"{out}/no-optimizer", async_save=True)
    copying.append(not without.copy_done())
    bytes_in_call = without.copy_bytes["step"]
    without.wait()
    return {"copying": copying, "waited": waited, "in_call": bytes_in_call, "snapshot": without.snapshot_bytes}


def test_async_copy_is_waited_for_before_loads(pool, hf_dir, tmp_path):
    results = pool.run(async_copy_guards, hf_dir, str(tmp_path))
    writers = [r for r in results if r["snapshot"]]
    assert len(writers) == 2, results
    for r in writers:
        assert r["copying"] == [True, False, True, False, False] and min(r["waited"]) > 0, r
        assert r["in_call"] > 0, r
    for name, same_as in (("b-then-load", "b"), ("a-then-set", "a")):
        names = sorted(p.name for p in (tmp_path / same_as).iterdir() if p.suffix == ".safetensors")
        assert names and names == sorted(p.name for p in (tmp_path / name).iterdir() if p.suffix == ".safetensors")
        for n in names:
            assert (tmp_path / same_as / n).read_bytes() == (tmp_path / name / n).read_bytes(), (name, n)


def async_error(hf_dir: str, out: str) -> dict:
    """An async save whose background write fails on rank 1 only (an extra file it cannot create): its error is
    raised on every rank by the next save (never lost), once; that save is not made, the one after is. Then one whose
    background copy fails on rank 1: the optimizer step after it goes on, the error is raised on every rank."""
    from optimum_parallel.checkpoint import wait_for_pending_save

    parallelizer, model, optimizer = _setup(hf_dir, 2)
    train_step(model, optimizer, make_batch(model.config))
    parallelizer.save_model_checkpoint(model, f"{out}/good", optimizer=optimizer)
    extra = {"missing-dir/file": b"x"} if dist.get_rank() == 1 else {}
    from optimum_parallel.checkpoint import save_model_checkpoint

    handle = save_model_checkpoint(model, f"{out}/good", optimizer=optimizer, async_save=True, extra_files=extra)
    errors = []
    for attempt in ("next save", "handle"):
        try:
            if attempt == "next save":
                parallelizer.save_model_checkpoint(model, f"{out}/not-made", optimizer=optimizer, async_save=True)
            else:
                handle.wait()
        except Exception as err:  # noqa: BLE001
            errors.append(f"{type(err).__name__}: {err}")
    after = parallelizer.save_model_checkpoint(model, f"{out}/after", optimizer=optimizer, async_save=True).wait()
    from optimum_parallel.checkpoint.crash import SLOW_ENV

    if dist.get_rank() == 1:  # a negative delay makes time.sleep raise: an error inside rank 1's background copy
        os.environ[SLOW_ENV] = "copy:-1"
    try:
        failing = parallelizer.save_model_checkpoint(model, f"{out}/copy-failed", optimizer=optimizer, async_save=True)
        train_step(model, optimizer, make_batch(model.config))  # its optimizer step does not wait forever
    finally:
        os.environ.pop(SLOW_ENV, None)
    try:
        failing.wait()
        errors.append("no error")
    except Exception as err:  # noqa: BLE001
        errors.append(f"{type(err).__name__}: {err}")
    return {"errors": errors, "after": str(after), "pending": wait_for_pending_save()}


def test_async_save_error_is_raised_on_every_rank(pool, hf_dir, tmp_path):
    from optimum_parallel.checkpoint import find_last_checkpoint, verify_checkpoint

    results = pool.run(async_error, hf_dir, str(tmp_path))
    for rank, result in enumerate(results):
        assert len(result["errors"]) == 3, (rank, result)
        written, copied = result["errors"][:2], result["errors"][2]
        if rank == 1:
            assert all(e.startswith("FileNotFoundError: ") and "missing-dir/file" in e for e in written)
            assert copied.startswith("ValueError: sleep length must be non-negative"), copied
        else:
            assert all(e.startswith("RuntimeError: writing shards into") and "rank 1: FileNotFoundError" in e
                       for e in written), result  # fmt: skip
            assert copied.startswith("RuntimeError: writing shards into") and "rank 1: ValueError" in copied, copied
        assert result["after"] == str(tmp_path / "after") and result["pending"] is None
    verify_checkpoint(tmp_path / "good")  # the failed save into the same name left the previous one whole
    assert not (tmp_path / "not-made").exists() and not (tmp_path / "copy-failed").exists()
    assert not list(tmp_path.glob(".*.partial"))
    assert find_last_checkpoint(tmp_path) is None  # no checkpoint-<step> here: only the names above


# ----------------------------------------------------------------------------------------------- SIGKILL mid-save


def _kill_target(hf_dir: str, ckpt: str, reference: str, marker: str) -> None:
    """Run under torchrun (2 ranks): save `ckpt`, keep a consolidated copy, then re-save `ckpt` and hang mid-write."""
    import optimum_parallel as op
    from optimum_parallel.io import safetensors_io

    torch.set_num_threads(1)
    op.init_mesh(tp=2)
    parallelizer, model, optimizer = _setup(hf_dir, 2, new_mesh=False)
    batch = make_batch(model.config)
    train_step(model, optimizer, batch)
    parallelizer.save_model_checkpoint(model, ckpt, optimizer=optimizer)
    if dist.get_rank() == 0:
        op.consolidate_checkpoint(ckpt, reference, progress=False)
    dist.barrier()
    train_step(model, optimizer, batch)
    write = safetensors_io.SafetensorsWriter.write

    def write_then_hang(self, name, tensor):
        crc = write(self, name, tensor)
        mark_reached(marker)
        time.sleep(600)
        return crc

    safetensors_io.SafetensorsWriter.write = write_then_hang
    parallelizer.save_model_checkpoint(model, ckpt, optimizer=optimizer)


def test_sigkill_mid_save_keeps_previous_checkpoint(hf_dir, tmp_path):
    import optimum_parallel as op
    from optimum_parallel.checkpoint import CheckpointError, verify_checkpoint

    ckpt, reference, marker = tmp_path / "ckpt", tmp_path / "reference", tmp_path / "mid-save"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    command += [hf_dir, str(ckpt), str(reference), str(marker)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    run_until_reached_then_kill(command, env, marker, ranks=2)  # both saving ranks mid-write, and torchrun
    verify_checkpoint(ckpt)  # the previous checkpoint is whole ...
    after = op.consolidate_checkpoint(ckpt, tmp_path / "after", progress=False)
    for f in reference.glob("*.safetensors"):  # ... and unchanged
        expected, actual = load_file(f), load_file(after / f.name)
        assert expected.keys() == actual.keys() and all(torch.equal(expected[k], actual[k]) for k in expected)
    partial = tmp_path / ".ckpt.partial"
    assert partial.is_dir() and any(partial.glob("*.safetensors"))
    with pytest.raises(CheckpointError, match="did not complete"):
        op.consolidate_checkpoint(partial, tmp_path / "from-partial", progress=False)


# ----------------------------------------------------------------------------------------------- command line


def _cli(*args: str) -> tuple[int, str, str]:
    from click.testing import CliRunner

    from optimum_parallel.cli import main

    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_cli(saved, tmp_path):
    code, out, err = _cli("reshard", saved["ckpt"], str(tmp_path / "tp4"), "--tp", "4", "--no-progress")
    assert code == 0 and "tp=4" in out, err
    code, out, err = _cli("consolidate", str(tmp_path / "tp4"), str(tmp_path / "hf"), "--no-progress")
    assert code == 0 and (tmp_path / "hf" / "model.safetensors.index.json").exists(), err
    code, out, err = _cli("reshard", saved["ckpt"], str(tmp_path / "tp3"), "--tp", "3")
    assert code == 1 and err.strip().count("\n") == 0 and "q_proj.weight: cannot be split over tp=3" in err
    code, out, err = _cli("inspect", str(tmp_path / "hf"))
    assert code == 1 and "is a regular Hugging Face checkpoint" in err
    code, out, err = _cli("reshard", saved["ckpt"], str(tmp_path / "x"))
    assert code == 2 and "Missing option '--tp'" in err
    for command in ("consolidate", "reshard", "inspect"):
        code, out, err = _cli(command, "--help")
        assert code == 0 and "CHECKPOINT" in out


def test_cli_entry_point_inspects_and_verifies(saved):
    command = [sys.executable, "-m", "optimum_parallel.cli", "inspect", saved["ckpt"], "--verify"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr
    assert "saved at dp=2, pp=1, tp=2" in result.stdout and "verified: every file matches its sha256" in result.stdout


if __name__ == "__main__":
    _kill_target(*sys.argv[1:])
