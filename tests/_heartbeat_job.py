"""A ParallelTrainer job at tp=2 with the package's defaults (tiny Llama, 4 steps, an evaluation and a checkpoint
after step 2) for test_heartbeat.py:

    torchrun --standalone --nproc-per-node 2 _heartbeat_job.py HF_DIR OUT

One fault, from FAULT="what:where:rank[:seconds]", on global rank `rank`:

- what: `kill` (SIGKILL), `stop` (SIGSTOP: the process and all its threads frozen, as on a host that stopped
  answering), `sleep` (alive and `seconds` late);
- where: `load` (inside from_pretrained, before parallelize), `train` (after step 3's optimizer step: the other rank
  waits in step 4's forward), `save` (inside the checkpoint save after step 2, at its first exchange of results),
  `evaluate` (in the evaluation loop, at its first prediction step), `on_evaluate` / `on_save` (in a callback after
  the evaluation / the save, as logging sample generations or uploading a checkpoint does), `end` (after training,
  once the other rank may have exited: a rank still at work alone).

The rank writes OUT/fault-rank<r> (the time) just before its fault; every rank writes OUT/pid-rank<r> when it starts
(for the test's clean-up) and OUT/done-rank<r> (the time) when training ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

from optimum_parallel import ParallelTrainer, ParallelTrainingArguments

ROWS, SEQ, STEPS, AT_STEP = 4, 16, 4, 2


def parse_fault() -> tuple[str, str, int, float]:
    what, where, rank, *seconds = os.environ["FAULT"].split(":")
    return what, where, int(rank), float(seconds[0]) if seconds else 0.0


WHAT, WHERE, RANK, SECONDS = parse_fault()
OUT = Path(sys.argv[2])


def fault(where: str) -> None:
    """The fault, if it is this rank's and this is its place (once)."""
    if where != WHERE or int(os.environ["RANK"]) != RANK or (OUT / f"fault-rank{RANK}").exists():
        return
    (OUT / f"fault-rank{RANK}").write_text(str(time.time()))
    if WHAT == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif WHAT == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(SECONDS)


class Loader:
    """AutoModelForCausalLM whose from_pretrained runs the `load` fault first (the Trainer loads after init_mesh)."""

    @staticmethod
    def from_pretrained(path, **kwargs):
        fault("load")
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)


class Faults(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == AT_STEP + 1:
            fault("train")
        if state.global_step == AT_STEP:
            arm_save_fault()

    def on_prediction_step(self, args, state, control, **kwargs):
        fault("evaluate")

    def on_evaluate(self, args, state, control, **kwargs):
        fault("on_evaluate")

    def on_save(self, args, state, control, **kwargs):
        fault("on_save")


def arm_save_fault() -> None:
    """The `save` fault at the save's first exchange of results (every rank has one; checkpoint/rank_info.py)."""
    from optimum_parallel.checkpoint import rank_info

    point = rank_info.crash_point

    def at(name: str) -> None:
        if name == "gather":
            fault("save")
        point(name)

    rank_info.crash_point = at


class Blocks(torch.utils.data.Dataset):
    def __init__(self, vocab: int, count: int, seed: int) -> None:
        self.ids = torch.randint(0, vocab, (count, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def main() -> None:
    torch.set_num_threads(1)
    (OUT / f"pid-rank{os.environ['RANK']}").write_text(str(os.getpid()))  # torchrun puts each in a session of its own
    hf_dir = sys.argv[1]
    args = ParallelTrainingArguments(
        output_dir=str(OUT),
        tensor_parallel_size=2,
        per_device_train_batch_size=ROWS,
        per_device_eval_batch_size=2,
        max_steps=STEPS,
        eval_strategy="steps",
        eval_steps=AT_STEP,
        save_strategy="steps",
        save_steps=AT_STEP,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
    )
    vocab = AutoConfig.from_pretrained(hf_dir).vocab_size
    trainer = ParallelTrainer(
        hf_dir,
        args,
        model_class=Loader,
        model_kwargs={"dtype": torch.float32, "attn_implementation": "eager"},
        train_dataset=Blocks(vocab, ROWS * STEPS, 5),
        eval_dataset=Blocks(vocab, 4, 6),
        callbacks=[Faults()],
    )
    trainer.train()
    (OUT / f"done-rank{dist.get_rank()}").write_text(str(time.time()))
    fault("end")


if __name__ == "__main__":
    main()
