"""A small training job for the several-hosts tests, run under torchrun (one host or several).

    torchrun ... _host_train.py HF_DIR OUT --dp 2 --tp 2 [--pp 1] [--steps 6] [--save-every 2] [--trainer]
                                [--async-save]

Custom loop (default): AdamW and a linear LR schedule, each step's global batch a function of the step (so a resumed
run sees the data it would have seen), every `--save-every` steps a sharded checkpoint `OUT/checkpoint-<step>`; at the
start it resumes from `op.find_last_checkpoint(OUT)` if there is one. `--trainer` runs the same through
`ParallelTrainer` (`resume_from_checkpoint="last"`). Each rank writes its losses to `OUT/losses-rank<r>.json`; the
final weights go to `OUT/final` (sharded).

`KILL_HOST_AT_STEP=s`, `KILL_HOST_IFNAME=dev`: in the first attempt (torchrun restart 0) the ranks of the host
whose gloo interface is `dev` SIGKILL themselves after step s, writing the time to `OUT/killed-rank<r>`; a survivor
whose collective fails writes the time and the error to `OUT/failed-rank<r>-attempt<a>` before it exits.

`KILL_RANK_AT_STEP=r:s`: in the first attempt rank r SIGKILLs itself after step s (one machine, `--standalone`).

`CRASH_IN_SAVE=point:n@r`: in the first attempt, rank r SIGKILLs itself the n-th time it reaches the crash point
`point` (`optimum_parallel.checkpoint.crash`) inside the save of the last checkpoint, or of step `CRASH_IN_SAVE_STEP`
(with `--async-save`, in its background write).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROWS, SEQ, LR = 4, 16, 1e-2


def batch_for(step: int, vocab: int) -> dict[str, torch.Tensor]:
    """The global batch of `step`: random tokens, some padding labels (-100)."""
    gen = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
    labels = input_ids.clone()
    labels[0, :3] = -100
    return {"input_ids": input_ids, "labels": labels}


def maybe_lose_this_host(out: Path, step: int) -> None:
    kill_at, host = os.environ.get("KILL_HOST_AT_STEP"), os.environ.get("KILL_HOST_IFNAME")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # a host whose ranks failed: >= 1
    this_host = kill_at and int(kill_at) == step and os.environ.get("GLOO_SOCKET_IFNAME") == host
    rank, _, at = os.environ.get("KILL_RANK_AT_STEP", "").partition(":")
    this_rank = rank and int(rank) == dist.get_rank() and int(at) == step
    if first_attempt and (this_host or this_rank):
        (out / f"killed-rank{dist.get_rank()}").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


def arm_crash_in_save(step: int, last_save: int) -> None:
    """In the first attempt, arm the crash point of `CRASH_IN_SAVE` in the save of step `CRASH_IN_SAVE_STEP`
    (default: the last save)."""
    point, _, rank = os.environ.get("CRASH_IN_SAVE", "").partition("@")
    at = int(os.environ.get("CRASH_IN_SAVE_STEP", last_save))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if point and first_attempt and step == at and int(rank) == dist.get_rank():
        from optimum_parallel.checkpoint.crash import CRASH_ENV

        os.environ[CRASH_ENV] = point


def custom_loop(args: argparse.Namespace) -> list[float]:
    from transformers import AutoModelForCausalLM

    import optimum_parallel as op
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    mesh = op.init_mesh(dp=args.dp, pp=args.pp, tp=args.tp, timeout=args.timeout)
    with op.lazy_load_for_parallelism(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp):
        model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32, attn_implementation="eager")
    optimizer = op.make_optimizer_constructor_lazy(torch.optim.AdamW)(model.parameters(), lr=LR, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2 if args.pp > 1 else 1)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    if args.dp > 1:
        model, optimizer = apply_data_parallel(model, optimizer, mesh, DataParallelConfig(sharding_level=0))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (2 * args.steps))
    start = 0
    last = op.find_last_checkpoint(args.out)
    if last is not None:  # the step is in the name; the schedule is a function of the step
        parallelizer.load_model_checkpoint(model, last, optimizer=optimizer)
        start = int(last.name.rpartition("-")[2])
        for _ in range(start):
            schedule.step()
    vocab = model.config.vocab_size
    losses = []
    dp_rank = mesh.rank("dp")
    for step in range(start + 1, args.steps + 1):
        batch = batch_for(step, vocab)
        if args.pp > 1:
            loss = model.run_train(**batch)
        else:
            rows = ROWS // args.dp
            local = {k: v[rows * dp_rank : rows * (dp_rank + 1)] for k, v in batch.items()}
            loss = model(**local).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
        if step % args.save_every == 0:
            arm_crash_in_save(step, args.steps - args.steps % args.save_every)
            path = Path(args.out) / f"checkpoint-{step}"
            parallelizer.save_model_checkpoint(model, path, optimizer=optimizer, async_save=args.async_save)
        maybe_lose_this_host(Path(args.out), step)
    parallelizer.save_model_checkpoint(model, Path(args.out) / "final")
    return losses


class Blocks(torch.utils.data.Dataset):
    def __init__(self, vocab: int, count: int) -> None:
        gen = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, vocab, (count, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def trainer_run(args: argparse.Namespace) -> list[float]:
    from transformers import AutoConfig, TrainerCallback

    from optimum_parallel import ParallelTrainer, ParallelTrainingArguments

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

        def on_step_end(self, targs, state, control, **kw):  # before the Trainer saves this step's checkpoint
            maybe_lose_this_host(Path(args.out), state.global_step)
            arm_crash_in_save(state.global_step, args.steps - args.steps % args.save_every)

    record = Record()
    targs = ParallelTrainingArguments(
        output_dir=args.out,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        pipeline_parallel_num_microbatches=2 if args.pp > 1 else 1,
        per_device_train_batch_size=ROWS // args.dp,
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_steps=args.save_every,
        save_strategy="steps",
        report_to=[],
        seed=3,
        ddp_timeout=30,
        disable_tqdm=True,
        async_save=args.async_save,
    )
    vocab = AutoConfig.from_pretrained(args.hf_dir).vocab_size
    trainer = ParallelTrainer(
        args.hf_dir,
        targs,
        model_kwargs={"dtype": torch.float32, "attn_implementation": "eager"},
        train_dataset=Blocks(vocab, ROWS * args.steps),
        callbacks=[record],
    )
    trainer.train(resume_from_checkpoint="last")
    trainer.parallelizer.save_model_checkpoint(trainer.model, Path(args.out) / "final")
    return record.losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hf_dir")
    parser.add_argument("out")
    for size in ("--dp", "--pp", "--tp"):
        parser.add_argument(size, type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--trainer", action="store_true")
    parser.add_argument("--async-save", action="store_true", help="checkpoints written in the background")
    parser.add_argument("--timeout", type=int, default=30, help="the mesh's collective timeout in seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        losses = trainer_run(args) if args.trainer else custom_loop(args)
    except Exception as err:
        rank, attempt = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        (out / f"failed-rank{rank}-attempt{attempt}").write_text(
            json.dumps({"time": time.time(), "error": str(err)[:2000]})
        )
        raise
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (out / f"losses-rank{dist.get_rank()}-attempt{attempt}.json").write_text(json.dumps(losses))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
