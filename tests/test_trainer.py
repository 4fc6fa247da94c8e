"""ParallelTrainer end to end against the single-device transformers `Trainer` on the same text and seed: logged
losses, gradient norms and eval losses; a run that ends after its step-3 save and resumes (at dp=2 x tp=2, and at
pp=2 x tp=2 through reshard); ZeRO-1 and FSDP; and the example script under torchrun at tp=2, SIGKILLed after the
step-3 save and resumed, whose final consolidated checkpoint loads with `from_pretrained`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _killed_run import mark_reached, run_until_reached_then_kill
from _models import build_model, rel_err, tiny_config
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

TOL = 1e-4
SAVE_AT = 3  # 24 blocks, 4 per step: 6 steps; saves and evaluations at steps 3 and 6
LOAD = {"dtype": torch.float32}
EXAMPLE = Path(__file__).parent.parent / "examples" / "finetune_trainer.py"
TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold. Actions speak louder than words. Where there is a will, there is a way. "
    "Knowledge is power, and time is money. Practice makes perfect. Better late than never, they say. "
    "Fortune favours the bold, and the early bird catches the worm. Rome was not built in a day. "
    "When in Rome, do as the Romans do. Every cloud has a silver lining. Two heads are better than one."
)
METRICS = ("loss", "grad_norm", "eval_loss", "eval_accuracy")
BLOCK, TRAIN_BLOCKS, EVAL_BLOCKS = 16, 24, 6  # 480 byte tokens; 6 eval blocks over dp=2 x 2 leave a remainder


def datasets():
    sys.path.insert(0, str(EXAMPLE.parent))
    from finetune_trainer import Blocks

    ids = torch.tensor(list(TEXT.encode()[: (TRAIN_BLOCKS + EVAL_BLOCKS) * BLOCK])).view(-1, BLOCK)
    return Blocks(ids[:TRAIN_BLOCKS]), Blocks(ids[TRAIN_BLOCKS:])


def common_args(output_dir: str, per_device: int) -> dict:
    """fp32, no dropout, one seed, gradient clipping on (max_grad_norm=1 < the norms seen), warmup + linear decay."""
    return dict(
        output_dir=output_dir, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
        learning_rate=5e-3, weight_decay=0.1, warmup_steps=2, num_train_epochs=1, logging_steps=1, seed=0,
        save_strategy="steps", save_steps=SAVE_AT, eval_strategy="steps", eval_steps=SAVE_AT, report_to="none",
        disable_tqdm=True, use_cpu=True, ddp_timeout=60,
    )  # fmt: skip


def token_accuracy(prediction) -> dict[str, float]:
    """compute_metrics: next-token accuracy from the full logits (gathered over the vocabulary, dp and pp)."""
    predicted = prediction.predictions[:, :-1].argmax(-1)
    return {"accuracy": float((predicted == prediction.label_ids[:, 1:]).mean())}


def curve(log_history: list[dict]) -> dict[int, dict]:
    """{step: {loss, grad_norm, eval_loss, eval_accuracy}} from a Trainer's log history."""
    out: dict[int, dict] = {}
    for entry in log_history:
        values = {k: entry[k] for k in METRICS if k in entry}
        out.setdefault(entry["step"], {}).update(values)
    return {step: values for step, values in out.items() if values}


def worst_difference(actual: dict[int, dict], expected: dict[int, dict], steps, keys=METRICS) -> float:
    """max |actual - expected| of `keys` over the given steps; every expected value must be there."""
    worst = 0.0
    for step in steps:
        for key, value in expected[step].items():
            if key in keys:
                worst = max(worst, abs(actual[step][key] - value))
    return worst


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hf") / "llama"
    build_model(tiny_config("llama"), seed=3).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory) -> dict:
    """The single-device Trainer on the global batch (4 blocks), in this process."""
    train, evaluation = datasets()
    args = TrainingArguments(**common_args(str(tmp_path_factory.mktemp("reference")), per_device=4))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD)
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=evaluation, compute_metrics=token_accuracy)
    trainer.train()
    probe = train[0]["input_ids"][None]
    with torch.no_grad():
        logits = trainer.model(input_ids=probe).logits
    return {"curve": curve(trainer.state.log_history), "logits": logits, "probe": probe}


# ----------------------------------------------------------------------------------------------- in the pool


class StopAfterSave(TrainerCallback):
    """Ends the run right after the checkpoint at `step` is written (a later run resumes from it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class CopyWaits(TrainerCallback):
    """{step: seconds its optimizer step and those before it waited for the background copy of the async save in
    flight}, read at each step's end."""

    def __init__(self) -> None:
        self.waited: dict[int, float] = {}

    def on_step_end(self, args, state, control, **kwargs):
        from optimum_parallel.checkpoint import async_save

        if async_save._PENDING is not None:
            self.waited[state.global_step] = async_save._PENDING.copy_waited


def train_parallel(
    hf_dir: str,
    output_dir: str,
    tp: int,
    pp: int = 1,
    *,
    resume: str | None = None,
    stop_at: int | None = None,
    consolidate: bool = False,
    lazy_optimizer: bool = False,
    slow_copy: str | None = None,
    **extra,
) -> dict:
    """One ParallelTrainer run on this rank (the global batch is 4 blocks whatever the layout). With
    `lazy_optimizer` the user loads the model lazily and passes a lazy AdamW with the Trainer's param groups. With
    `slow_copy` (OPTIMUM_PARALLEL_SLOW_AT) async saves copy slowly: {"curve", "copy_waited": CopyWaits.waited}."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint.crash import SLOW_ENV
    from optimum_parallel.integrations.transformers.trainer import ParallelTrainer
    from optimum_parallel.integrations.transformers.training_args import ParallelTrainingArguments

    per_device = 4 * tp * pp * extra.get("context_parallel_size", 1) // int(os.environ["WORLD_SIZE"])
    args = ParallelTrainingArguments(
        **{**common_args(output_dir, per_device), "tensor_parallel_size": tp, "pipeline_parallel_size": pp, **extra}
    )
    model, optimizers = hf_dir, (None, None)
    if lazy_optimizer:
        with op.lazy_load_for_parallelism(tensor_parallel_size=tp, pipeline_parallel_size=pp):
            model = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD)
        params = list(model.parameters())  # Llama: the Trainer decays exactly the matrices
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay}]
        groups.append({"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0})
        optimizers = (op.make_optimizer_constructor_lazy(torch.optim.AdamW)(groups, lr=args.learning_rate), None)
    train, evaluation = datasets()
    waits = CopyWaits()
    callbacks = [StopAfterSave(stop_at)] if stop_at else []
    callbacks = (callbacks + [waits] if slow_copy else callbacks) or None
    if slow_copy:
        os.environ[SLOW_ENV] = slow_copy
    trainer = ParallelTrainer(model, args, model_kwargs=LOAD, optimizers=optimizers, train_dataset=train,
                              eval_dataset=evaluation, callbacks=callbacks, compute_metrics=token_accuracy)  # fmt: skip
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        os.environ.pop(SLOW_ENV, None)
    if consolidate:
        trainer.save_model()
    if slow_copy:
        return {"curve": curve(trainer.state.log_history), "copy_waited": waits.waited}
    return curve(trainer.state.log_history)


@pytest.fixture(scope="module")
def runs(pool, hf_dir, tmp_path_factory) -> dict:
    """dp=2 x tp=2: uninterrupted; ending after the step-3 save; resumed from it at dp=2 x tp=2 and at pp=2 x tp=2."""
    out = tmp_path_factory.mktemp("runs")
    results = {"uninterrupted": pool.run(train_parallel, hf_dir, str(out / "full"), 2, consolidate=True)}
    results["first_part"] = pool.run(train_parallel, hf_dir, str(out / "part"), 2, stop_at=SAVE_AT)
    checkpoint = str(out / "part" / f"checkpoint-{SAVE_AT}")
    results["resumed"] = pool.run(train_parallel, hf_dir, str(out / "resumed"), 2, resume=checkpoint)
    results["resumed_pp"] = pool.run(
        train_parallel, hf_dir, str(out / "resumed_pp"), 2, 2, resume=checkpoint, pipeline_parallel_num_microbatches=2
    )
    return {"dir": out, "checkpoint": checkpoint, **results}


def test_dp2_tp2_matches_single_device_trainer(runs, reference):
    expected = reference["curve"]
    assert sorted(expected) == list(range(1, 7)) and all("eval_accuracy" in expected[s] for s in (SAVE_AT, 6))
    for rank, result in enumerate(runs["uninterrupted"]):
        assert result == runs["uninterrupted"][0], f"rank {rank} logged something else than rank 0"
        assert worst_difference(result, expected, range(1, 7)) <= TOL, (result, expected)


def test_consolidated_checkpoint_loads_with_from_pretrained(runs, reference):
    model = AutoModelForCausalLM.from_pretrained(runs["dir"] / "full", **LOAD)
    with torch.no_grad():
        logits = model(input_ids=reference["probe"]).logits
    assert rel_err(logits, reference["logits"]) <= TOL
    assert not any(p.name.startswith(".") for p in (runs["dir"] / "full").iterdir())  # no staging left behind


def test_resume_after_the_step_3_save(runs, reference):
    checkpoint = Path(runs["checkpoint"])
    assert (checkpoint / "COMPLETE").exists() and (checkpoint / "scheduler.pt").exists()
    assert sorted(p.name for p in checkpoint.glob("rng_state_*.pth")) == [f"rng_state_{r}.pth" for r in range(4)]
    first = runs["first_part"][0]
    assert max(first) == SAVE_AT and worst_difference(first, reference["curve"], range(1, SAVE_AT + 1)) <= TOL
    uninterrupted = runs["uninterrupted"][0]
    for name in ("resumed", "resumed_pp"):
        resumed = runs[name][0]
        assert worst_difference(resumed, reference["curve"], range(SAVE_AT + 1, 7)) <= TOL, (name, resumed)
        assert abs(resumed[6]["loss"] - uninterrupted[6]["loss"]) <= 1e-6, (name, resumed[6], uninterrupted[6])
    assert not list(Path(runs["dir"] / "resumed_pp").glob(".checkpoint-*"))  # the resharded copy is removed


def _checkpoint_files(directory: Path) -> dict[str, object]:
    """A checkpoint's files, `trainer_state.json` without the timings its evaluations log."""
    files: dict[str, object] = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
    state = json.loads(files.pop("trainer_state.json"))
    for entry in state["log_history"]:
        for key in [k for k in entry if k.endswith(("_runtime", "_per_second"))]:
            del entry[key]
    return {**files, "trainer_state.json": state}


def test_async_save_writes_the_same_checkpoints(pool, hf_dir, runs, tmp_path):
    """async_save=True: the step-3 and step-6 checkpoints (model and optimizer shards, RNG, scheduler, trainer state)
    are the blocking run's files, byte for byte, though the shards were copied in the background (slowed down) and
    step 4's optimizer step waited for the copy; the curve is the same; `train()` returns with the last one in place
    and `save_model()` writes the same consolidated checkpoint."""
    out = tmp_path / "async"
    results = pool.run(train_parallel, hf_dir, str(out), 2, consolidate=True, async_save=True, slow_copy="copy:0.02")
    assert results[0]["curve"] == runs["uninterrupted"][0]
    writers = [r["copy_waited"] for r in results if r["copy_waited"].get(SAVE_AT + 1)]
    assert len(writers) == 2, [r["copy_waited"] for r in results]  # dp rank 0 of each tp rank waited
    for step in (SAVE_AT, 2 * SAVE_AT):
        name = f"checkpoint-{step}"
        assert _checkpoint_files(out / name) == _checkpoint_files(runs["dir"] / "full" / name), name
    consolidated = sorted(p.name for p in (runs["dir"] / "full").glob("*.safetensors"))
    assert consolidated and all((out / n).read_bytes() == (runs["dir"] / "full" / n).read_bytes() for n in consolidated)
    assert not list(out.glob(".*"))  # no partial directory left


VARIANTS = {
    "zero1": {"sharding_level": 1, "save_strategy": "no"},
    "fsdp": {"sharding_level": 3, "save_strategy": "no"},
    "sequence_parallel": {"sequence_parallel": True, "save_strategy": "no"},
    "lazy_optimizer": {"lazy_optimizer": True, "save_strategy": "no"},
    # cp=2 x tp=2: one dp replica, both cp ranks get its batch; the gradient norm counts their copy once
    "context_parallel": {"context_parallel_size": 2, "save_strategy": "no"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_single_device(pool, hf_dir, reference, tmp_path, variant):
    for result in pool.run(train_parallel, hf_dir, str(tmp_path / "out"), 2, **VARIANTS[variant]):
        assert worst_difference(result, reference["curve"], range(1, 7)) <= TOL, result


def test_hybrid_sharding_matches_single_device(pool, hf_dir, reference, tmp_path):
    """dp=4 (tp=1) as 2 sharding groups of 2 at level 3, the norms (below 1 KB) replicated: the curve of one device;
    the clipped gradient norm counts each FSDP shard once (not once per group)."""
    extra = {"sharding_level": 3, "shard_size": 2, "sharding_threshold_kb": 1, "save_strategy": "no"}
    for result in pool.run(train_parallel, hf_dir, str(tmp_path / "out"), 1, **extra):
        assert worst_difference(result, reference["curve"], range(1, 7)) <= TOL, result


# ----------------------------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"sharding_level": 4}, ["sharding_level=4", "0, 1, 2, 3"]),
        ({"pipeline_schedule": "2f2b"}, ["pipeline_schedule='2f2b'", "1f1b", "interleaved_1f1b", "zbv"]),
        ({"tensor_parallel_size": 0}, ["tensor_parallel_size=0", "positive integer"]),
        ({"context_parallel_size": 0}, ["context_parallel_size=0", "positive integer"]),
        ({"context_parallel_strategy": "zigzag"}, ["context_parallel_strategy='zigzag'", "ring", "all_to_all"]),
        ({"shard_size": 0}, ["shard_size=0", "allowed: -1"]),
        ({"shard_size": 2}, ["shard_size=2", "sharding_level 0"]),
        ({"sharding_level": 3, "sharding_threshold_kb": -1}, ["sharding_threshold_kb=-1", ">= 0"]),
        ({"pipeline_parallel_num_microbatches": 2}, ["pipeline_parallel_num_microbatches=2", "allowed", ": 1"]),
        ({"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 3}, ["per_device_train_batch_size=4"]),
        ({"pipeline_parallel_size": 2, "per_device_train_batch_size": 1, "per_device_eval_batch_size": 1},
         ["pipeline_parallel_size=2 needs at least 2 micro-batches", "train 1, eval 1"]),
    ],
)  # fmt: skip
def test_arguments_are_validated(tmp_path, overrides, words):
    from optimum_parallel.integrations.transformers.training_args import ParallelTrainingArguments

    with pytest.raises(ValueError) as error:
        ParallelTrainingArguments(**{**common_args(str(tmp_path), 4), **overrides})
    assert all(w in str(error.value) for w in words), str(error.value)


@pytest.mark.parametrize("level", [1, 3])
def test_sharded_optimizer_saves_and_resumes_to_the_same_curve(pool, hf_dir, reference, tmp_path, level):
    """ZeRO-1 / FSDP2 at dp=2 x tp=2: stopped after the step-3 save, resumed from it: the reference curve."""
    part = pool.run(train_parallel, hf_dir, str(tmp_path / "part"), 2, stop_at=SAVE_AT, sharding_level=level)[0]
    checkpoint = str(tmp_path / "part" / f"checkpoint-{SAVE_AT}")
    resumed = pool.run(train_parallel, hf_dir, str(tmp_path / "resumed"), 2, resume=checkpoint, sharding_level=level)
    resumed = resumed[0]
    assert max(part) == SAVE_AT and worst_difference(part, reference["curve"], range(1, SAVE_AT + 1)) <= TOL, part
    assert worst_difference(resumed, reference["curve"], range(SAVE_AT + 1, 7)) <= TOL, resumed


# ----------------------------------------------------------------------------------------------- torchrun + SIGKILL


class PauseAfterSave(TrainerCallback):
    """In the killed run: once every rank has written the step-N checkpoint, mark it and wait to be killed."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == SAVE_AT:
            torch.distributed.barrier()
            mark_reached(os.environ["MARKER"])
            time.sleep(600)


def _example_argv(hf_dir: str, text: Path, out: Path) -> list[str]:
    args = common_args(str(out), per_device=4)
    argv = ["--model_name_or_path", hf_dir, "--text_file", str(text), "--block_size", str(BLOCK), "--byte_tokens"]
    argv += ["--eval_blocks", str(EVAL_BLOCKS), "--tensor_parallel_size", "2"]
    for key, value in args.items():
        argv += [f"--{key}", str(value)]
    return argv


def test_example_tp2_killed_after_save_resumes_to_the_same_losses(hf_dir, reference, tmp_path):
    text, out, marker = tmp_path / "text.txt", tmp_path / "out", tmp_path / "saved"
    text.write_text(TEXT[: (TRAIN_BLOCKS + EVAL_BLOCKS) * BLOCK])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(EXAMPLE.parent.parent), "MARKER": str(marker)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    argv = _example_argv(hf_dir, text, out)
    run_until_reached_then_kill(torchrun + [__file__] + argv, env, marker, ranks=2)  # both ranks and torchrun
    assert not (out / f"checkpoint-{2 * SAVE_AT}").exists()
    resume = ["--resume_from_checkpoint", str(out / f"checkpoint-{SAVE_AT}")]
    done = subprocess.run(torchrun + [str(EXAMPLE)] + argv + resume, env=env, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / f"checkpoint-{2 * SAVE_AT}" / "trainer_state.json").read_text())
    logged = curve(state["log_history"])
    assert worst_difference(logged, reference["curve"], range(1, 7), keys=METRICS[:3]) <= TOL, logged
    model = AutoModelForCausalLM.from_pretrained(out, **LOAD)  # the consolidated checkpoint
    with torch.no_grad():
        assert rel_err(model(input_ids=reference["probe"]).logits, reference["logits"]) <= TOL


if __name__ == "__main__":  # the killed run of the torchrun test: the example, paused after its step-3 save
    sys.path.insert(0, str(EXAMPLE.parent))
    from finetune_trainer import main

    main(sys.argv[1:], callbacks=[PauseAfterSave()])
