"""Checkpoint saves while training: blocking against async, a ~0.5B Llama at tp=2 with AdamW state, in one run.

Two spawned CPU ranks (tp=2, gloo, one intra-op thread each) build the model lazily (`lazy_load_for_parallelism` +
`from_config`: no rank holds it whole), take AdamW steps on one batch, then save the sharded checkpoint (weights and
optimizer state) several ways, each into its own directory (removed after it, its page cache with it):

  blocking            save_model_checkpoint(...): the step waits for the files, their sha256 and the rename
  async (<policy>, copy <where>)
                      save_model_checkpoint(..., async_save=True): the shards copied to host memory in the
                      background before the next optimizer step, which waits for the copy (copy overlap), or in the
                      call (copy step: `async_save.COPY_POLICY = "step"`, what a save with no optimizer does); the
                      background writer scheduled as `async_save.WRITER_POLICY` says (idle: SCHED_IDLE; nice: nice
                      19; normal), training steps going on until the checkpoint is in place
  process writer      the thread-versus-process question: the same snapshot copied into shared memory and the same
                      writing work (every byte through sha256 and crc32, written and fsynced) done by a spawned
                      process (nice 19) instead of a thread; it writes bytes only, no checkpoint

For each: the stall seen by the training loop, in two parts: the save call (from the call to the next step's start)
and the time the optimizer's steps waited for the background copy (`AsyncCheckpoint.copy_waited`), with their sum
against the blocking save's stall; when the background copy was complete (from the save call); the time of the first
step after the save (it runs beside the copy) against the steps without a save; the total write time (from the save
call until the checkpoint is renamed into place), the peak host memory (VmHWM, reset before the save, the larger of
the two ranks), the mean step time during the background write against the steps without one, and the time the
training loop lost to the save (the stall plus what the steps during the write took beyond the steps without one).
"Without one" is the mean of the `--steps` steps just before the save and just after it (the machine's load drifts).
Goals: async stall (call + wait) <= 0.1x the blocking stall; steps during the write <= 1.2x the steps without one.

    python scripts/bench_checkpoint.py [--workdir /tmp/op-bench-checkpoint] [--seq 128] [--policies idle,normal]
        [--copy overlap,step]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from _common import LLAMA_0_5B, Stopwatch, now, print_table, proc_status_bytes, quiet_transformers, random_batch
from _ranks import run_on_ranks

CONFIG = LLAMA_0_5B
GIB = 1024**3

# The process writer: every byte of the rank's shared-memory snapshot through sha256 and crc32, written, fsynced
_WRITER = r"""
import hashlib, os, sys
from multiprocessing import resource_tracker, shared_memory
try:
    from zlib_ng.zlib_ng import crc32
except ImportError:
    from zlib import crc32
os.setpriority(os.PRIO_PROCESS, 0, 19)
name, size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
shm = shared_memory.SharedMemory(name=name)
resource_tracker.unregister(shm._name, "shared_memory")  # the rank owns and unlinks it
view, sha, fd = shm.buf[:size], hashlib.sha256(), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for start in range(0, size, 64 << 20):
    chunk = view[start : start + (64 << 20)]
    sha.update(chunk); crc32(chunk); os.write(fd, chunk); chunk.release()
os.fsync(fd); os.close(fd); view.release(); shm.close()
"""


def _reset_peak() -> None:
    """VmHWM restarts from the current RSS (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import optimum_parallel as op
    from optimum_parallel.checkpoint import async_save

    quiet_transformers()
    op.init_mesh(tp=world, timeout=600)
    with op.lazy_load_for_parallelism(tensor_parallel_size=world):
        config = LlamaConfig(**{**CONFIG, "num_hidden_layers": args.layers, "vocab_size": args.vocab})
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = op.make_optimizer_constructor_lazy(torch.optim.AdamW)(model.parameters(), lr=1e-5)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model.train()
    batch = random_batch(args.vocab, args.batch, args.seq, 0)
    workdir = Path(args.workdir)

    def step() -> float:
        with Stopwatch() as watch:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return watch.seconds

    def between_saves(path: Path) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # its files leave the page cache with it
        dist.barrier()

    for _ in range(args.warmup):  # AdamW's state exists after the first
        step()
    quiet = [step() for _ in range(args.steps)]
    rows = {}

    def measure(name: str, save) -> None:
        """`save()` returns something with `.done()`/`.wait()` (or None: blocking); steps until it is done."""
        nonlocal quiet
        _reset_peak()
        dist.barrier()
        start = now()
        handle = save()
        stall = now() - start  # the next step starts now
        during, finished, first = [], None, None

        def all_done() -> bool:  # the ranks agree, or one would step alone
            flag = torch.tensor([int(handle.done())])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())

        while handle is not None and not all_done():
            step_start = now()
            took = step()
            first = took if first is None else first
            if not handle.done() or (handle.finished_at or 0) > step_start + took / 2:
                during.append(took)  # the step ran beside this rank's write (most of it, at least)
        if handle is not None:
            handle.wait()
            finished = handle.finished_at
        total = (finished or now()) - start if handle is not None else stall
        peak = proc_status_bytes("VmHWM")
        snapshot = getattr(handle, "snapshot_bytes", None)
        waited = getattr(handle, "copy_waited", 0.0)
        copied = getattr(handle, "copied_at", None)
        copied = None if copied is None else copied - start
        rows[name] = dict(stall=stall, waited=waited, copied=copied, first=first, total=total, peak=peak)
        after = [step() for _ in range(args.steps)]  # steps without a write, between the saves
        rows[name].update(during=during, bytes=snapshot, near=quiet[-args.steps :] + after)
        quiet += after

    def blocking(path: Path) -> None:
        parallelizer.save_model_checkpoint(model, path, optimizer=optimizer)

    def in_background(path: Path):
        return parallelizer.save_model_checkpoint(model, path, optimizer=optimizer, async_save=True)

    def in_process(path: Path):
        path.mkdir(parents=True, exist_ok=True)
        return _process_writer(model, optimizer, path, rank)

    for repeat in range(args.repeats):
        suffix = f" #{repeat + 1}" if args.repeats > 1 else ""
        runs = [("blocking", "blocking", blocking)]
        runs += [
            (f"async ({policy}, copy {copy})", f"{policy}/{copy}", in_background)
            for policy in args.policies.split(",")
            for copy in args.copy.split(",")
        ]
        runs += [("process writer", "process", in_process)] if args.process_writer else []
        for name, policy, save in runs:
            async_save.WRITER_POLICY, _, copy = policy.partition("/")
            async_save.COPY_POLICY = copy or "overlap"
            path = workdir / policy.replace("/", "-")
            measure(f"{name}{suffix}", lambda save=save, path=path: save(path))
            between_saves(path)
    stats = {"rows": rows, "quiet": quiet, "rss": proc_status_bytes("VmRSS"), "parameters": parameters}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, stats)
    return gathered


class _ProcessWrite:
    """The process-writer variant: the rank's shards copied into shared memory, written by a spawned process."""

    def __init__(self, tensors: list, path: Path) -> None:
        from multiprocessing import shared_memory

        size = sum(t.numel() * t.element_size() for t in tensors)
        self.shm = shared_memory.SharedMemory(create=True, size=max(size, 1))
        offset = 0
        for t in tensors:  # one copy each, through memoryviews released at once (no export left on the mapping)
            data = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            self.shm.buf[offset : offset + len(data)] = data
            offset += len(data)
        self.snapshot_bytes = size
        self.proc = subprocess.Popen([sys.executable, "-c", _WRITER, self.shm.name, str(size), str(path)])
        self.finished_at = None

    def done(self) -> bool:
        if self.finished_at is None and self.proc.poll() is not None:
            self.finished_at = now()
        return self.finished_at is not None

    def wait(self) -> None:
        self.proc.wait()
        self.done()
        self.shm.close()
        self.shm.unlink()


def _process_writer(model, optimizer, directory: Path, rank: int) -> _ProcessWrite:
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if hasattr(v, "numel")]
    return _ProcessWrite(tensors, directory / f"rank{rank}.bin")


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/op-bench-checkpoint")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"], help="fewer: a smaller model")
    parser.add_argument("--vocab", type=int, default=CONFIG["vocab_size"])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps without a save before and after each save")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--policies", default="idle,nice,normal", help="async writer thread scheduling, in order")
    parser.add_argument("--copy", default="overlap,step", help="where async saves copy the weights and state, in order")
    parser.add_argument("--no-process-writer", dest="process_writer", action="store_false")
    parser.add_argument("--deadline", type=float, default=3000)
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    Path(args.workdir).mkdir(parents=True)
    started = now()
    ranks = run_on_ranks(args.tp, rank_main, (args,), deadline_s=args.deadline, what="bench_checkpoint")
    shutil.rmtree(args.workdir, ignore_errors=True)
    quiet = [t for r in ranks for t in r["quiet"]]
    step = _mean(quiet)
    print(
        f"Llama {ranks[0]['parameters'] / 1e9:.2f}B parameters fp32 + AdamW, tp={args.tp} (CPU, gloo, 1 thread per "
        f"rank), batch {args.batch} x seq {args.seq}; steps without a save: mean {step:.2f} s over {len(quiet)} "
        f"(both ranks), run in {now() - started:.0f} s"
    )
    header = [
        "",
        "stall s",
        "opt. wait s",
        "call+wait",
        "copied s",
        "1st step s",
        "total write s",
        "lost s",
        "peak RSS GiB",
        "snapshot GiB",
        "steps during",
        "step during s",
        "x quiet",
    ]
    rows = []
    blocking_stall = None
    for name in ranks[0]["rows"]:
        per_rank = [r["rows"][name] for r in ranks]
        stall = max(r["stall"] for r in per_rank)
        waited = max(r["waited"] for r in per_rank)
        copied = [r["copied"] for r in per_rank if r["copied"] is not None]
        firsts = [r["first"] for r in per_rank if r["first"] is not None]
        total = max(r["total"] for r in per_rank)
        peak = max(r["peak"] for r in per_rank) / GIB
        snapshot = max(r["bytes"] or 0 for r in per_rank) / GIB
        during = [t for r in per_rank for t in r["during"]]
        near = _mean([t for r in per_rank for t in r["near"]])  # the steps without a write just before and after
        lost = max(r["stall"] + sum(r["during"]) - len(r["during"]) * near for r in per_rank)
        blocking_stall = stall if name.startswith("blocking") else blocking_stall
        against = name.startswith(("async", "process")) and blocking_stall
        ratio = f"{_mean(during) / near:.2f}" if during else "-"
        cells = [
            name,
            f"{stall:.2f}",
            f"{waited:.2f}",
            f"{(stall + waited) / blocking_stall:.2f}x" if against else "-",
            f"{max(copied):.2f}" if copied else "-",
            f"{max(firsts):.2f} ({max(firsts) / near:.2f}x)" if firsts else "-",
            f"{total:.2f}",
            f"{lost:.2f}",
            f"{peak:.2f}",
            f"{snapshot:.2f}" if snapshot else "-",
            str(len(during)),
            f"{_mean(during):.2f}" if during else "-",
            ratio,
        ]
        rows.append(cells)
    print_table(header, rows, align_numbers=True, title=f"saves at tp={args.tp}")
    print(
        "goals: async stall (call + optimizer wait) <= 0.1x blocking; steps during the background write <= 1.2x steps "
        "without one"
    )


if __name__ == "__main__":
    main()
