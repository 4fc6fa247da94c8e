"""A small training job with the mesh's default timeouts, for the slow-rank and dead-rank tests (test_hosts.py):

    torchrun ... _host_slow.py HF_DIR OUT [--dp 1] [--tp 2] [--steps 3] [--save-at 2]

AdamW on a tiny Llama, a sharded checkpoint after step `--save-at`; `init_mesh` gets no timeout (the defaults of
optimum_parallel/mesh/timeouts.py). One fault, from the environment, on one rank (global rank r):

- `LATE=parallelize:r:s`: rank r sleeps s seconds before `parallelize` (a cold disk);
- `LATE=save:r:s`: rank r sleeps s seconds inside the save, before its second exchange of results with the others
  (the others wait for it in that all_gather: a slow disk);
- `KILL=step:r`: rank r SIGKILLs itself after step 1 (training runs: the others wait with the train timeout);
- `KILL=save:r`: rank r SIGKILLs itself inside that save, at its first exchange (the init timeout is on);
- `STOP=step:r`, `STOP=save:r`: the same places, SIGSTOP instead (frozen, threads and all: the heartbeat finds it).

A rank about to die writes the time to OUT/killed-rank<r>; a rank that finishes writes OUT/done-rank<r> (JSON: time,
losses); a rank whose collective fails writes OUT/failed-rank<r> (JSON: time, error) and re-raises.
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

ROWS, SEQ = 4, 16


def fault(kind: str) -> tuple[str, int, float] | None:
    """(where, rank, seconds) of the LATE or KILL fault when it is this rank's."""
    value = os.environ.get(kind, "")
    if not value:
        return None
    where, rank, *seconds = value.split(":")
    if int(rank) != dist.get_rank():
        return None
    return where, int(rank), float(seconds[0]) if seconds else 0.0


def die(out: Path, how: signal.Signals = signal.SIGKILL) -> None:
    (out / f"killed-rank{dist.get_rank()}").write_text(str(time.time()))
    os.kill(os.getpid(), how)


def sleep_late(out: Path, seconds: float) -> None:
    """Sleep, and leave OUT/late-rank<r> (the seconds slept) behind for the test to see that it happened."""
    started = time.monotonic()
    time.sleep(seconds)
    (out / f"late-rank{dist.get_rank()}").write_text(str(time.monotonic() - started))


def slow_before_exchange(out: Path, n: int, seconds: float) -> None:
    """Sleep `seconds` once, at this rank's n-th result exchange inside the next save (its crash point "gather",
    which every rank reaches; the crash module's own slow-down sleeps at every one)."""
    from optimum_parallel.checkpoint import rank_info

    point, reached = rank_info.crash_point, []

    def slow(name: str) -> None:
        if name == "gather":
            reached.append(name)
            if len(reached) == n:
                sleep_late(out, seconds)
        point(name)

    rank_info.crash_point = slow


def stop_before_exchange(out: Path) -> None:
    """SIGSTOP at this rank's first result exchange inside the next save."""
    from optimum_parallel.checkpoint import rank_info

    point = rank_info.crash_point

    def frozen(name: str) -> None:
        if name == "gather":
            die(out, signal.SIGSTOP)
        point(name)

    rank_info.crash_point = frozen


def run(args: argparse.Namespace, out: Path) -> list[float]:
    from transformers import AutoModelForCausalLM

    import optimum_parallel as op
    from optimum_parallel.checkpoint.crash import CRASH_ENV
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    mesh = op.init_mesh(dp=args.dp, tp=args.tp)  # the default timeouts
    late, kill, stop = fault("LATE"), fault("KILL"), fault("STOP")
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32, attn_implementation="eager")
    if late and late[0] == "parallelize":
        sleep_late(out, late[2])
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if args.dp > 1:
        model, optimizer = apply_data_parallel(model, optimizer, mesh, DataParallelConfig(sharding_level=0))
    rows, dp_rank, losses = ROWS // args.dp, mesh.rank("dp"), []
    for step in range(1, args.steps + 1):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, model.config.vocab_size, (ROWS, SEQ), generator=gen)
        ids = ids[rows * dp_rank : rows * (dp_rank + 1)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if kill and kill[0] == "step" and step == 1:
            die(out)
        if stop and stop[0] == "step" and step == 1:
            die(out, signal.SIGSTOP)
        if step != args.save_at:
            continue
        if late and late[0] == "save":
            slow_before_exchange(out, 2, late[2])
        if kill and kill[0] == "save":
            (out / f"killed-rank{dist.get_rank()}").write_text(str(time.time()))  # an instant before the kill
            os.environ[CRASH_ENV] = "gather:1"  # its first result exchange: every rank has one
        if stop and stop[0] == "save":
            stop_before_exchange(out)
        parallelizer.save_model_checkpoint(model, out / f"checkpoint-{step}", optimizer=optimizer)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hf_dir")
    parser.add_argument("out")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-at", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        losses = run(args, out)
    except Exception as err:
        failure = {"time": time.time(), "error": str(err)[:2000]}
        (out / f"failed-rank{os.environ['RANK']}").write_text(json.dumps(failure))
        raise
    (out / f"done-rank{dist.get_rank()}").write_text(json.dumps({"time": time.time(), "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
