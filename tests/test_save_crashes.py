"""A rank SIGKILLed at 20 points inside a sharded save (tensor writes, file closes, config, index, rename), and at 21
inside an async one (its snapshot: copied in the background while the next step's forward and backward run, or in
the call where it cannot wait; and the background write: tensors, files, the extra files, the exchange, config,
index, rename) never loses the previous checkpoint: `find_last_checkpoint` returns a complete one (the previous, or
the new one once it was renamed into place), every byte of it verifies and equals an uninterrupted save and it
consolidates (every tensor read back), and the interrupted save is ignored with a warning naming it. The crash
points are `optimum_parallel.checkpoint.crash.crash_point` calls, armed through `OPTIMUM_PARALLEL_CRASH_AT` in the
rank that is to die; the other rank is then killed too, as torchrun would. Two gloo ranks (tp=2) forked from the test
workers' server (`_pool.forkserver_context`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from _pool import forkserver_context

from optimum_parallel.mesh.ports import free_port

# (crash point "name:n" -> the n-th time a rank reaches it, the rank that dies, where the second save goes)
NEW, OVERWRITE = "checkpoint-2", "checkpoint-1"
POINTS = [  # rank 0 writes 21 model tensors then 63 optimizer tensors, rank 1 16 then 32
    ("prepare:1", 0, NEW),
    ("tensor:1", 0, NEW),
    ("tensor:13", 0, NEW),
    ("tensor:21", 0, NEW),
    ("file:1", 0, NEW),
    ("tensor:30", 0, NEW),
    ("tensor:84", 0, NEW),
    ("file:2", 0, NEW),
    ("config:1", 0, NEW),
    ("index:1", 0, NEW),
    ("publish:1", 0, NEW),
    ("published:1", 0, NEW),
    ("tensor:1", 1, NEW),
    ("tensor:9", 1, NEW),
    ("file:1", 1, NEW),
    ("tensor:48", 1, NEW),
    ("tensor:3", 0, OVERWRITE),
    ("index:1", 0, OVERWRITE),
    ("published:1", 0, OVERWRITE),
    ("file:2", 1, OVERWRITE),
]
# the second save is async (each rank adds an extra file, as the Trainer adds its RNG state): every point is in the
# background thread while the main thread trains on: "copy" points in the snapshot's copy (slowed down, so the next
# step's forward and backward run beside it and its optimizer step waits for it), then the write ("gather:3": the
# background's exchange of the written files, after the 2 in the step)
ASYNC_POINTS = [
    ("copy:1", 0, NEW),
    ("copy:50", 0, NEW),
    ("copy:84", 0, NEW),
    ("copy:40", 1, NEW),
    ("tensor:1", 0, NEW),
    ("tensor:21", 0, NEW),
    ("file:1", 0, NEW),
    ("tensor:60", 0, NEW),
    ("file:2", 0, NEW),
    ("extra:1", 0, NEW),
    ("tensor:9", 1, NEW),
    ("extra:1", 1, NEW),
    ("gather:3", 1, NEW),
    ("config:1", 0, NEW),
    ("index:1", 0, NEW),
    ("publish:1", 0, NEW),
    ("published:1", 0, NEW),
    ("tensor:3", 0, OVERWRITE),
    ("published:1", 0, OVERWRITE),
]
# the same async save with the snapshot copied in the call (`async_save.COPY_POLICY = "step"`, as when there is no
# optimizer whose step could wait): "snapshot" points are in the step
ASYNC_STEP_POINTS = [
    ("snapshot:1", 0, NEW),
    ("snapshot:40", 1, NEW),
]


def _save_twice(
    rank: int, port: int, out: str, crash: str | None, crash_rank: int, target: str, async_save: str | None = None
) -> None:
    """Train a step, save checkpoint-1, train another, save into `target` (rank `crash_rank` dies at `crash`); with
    `async_save` ("overlap" or "step": where the snapshot is copied) the second save is async (with an extra file per
    rank, its background copy slowed down) and a step is trained while it is written."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from _models import build_model, make_batch, tiny_config

    import optimum_parallel as op
    from optimum_parallel.checkpoint import async_save as background
    from optimum_parallel.checkpoint.crash import CRASH_ENV, SLOW_ENV

    op.init_mesh(tp=2, timeout=20)
    model = build_model(tiny_config("llama"), seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    batch = make_batch(model.config)
    for step in (1, 2):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 2 and crash is not None and rank == crash_rank:
            os.environ[CRASH_ENV] = crash
        path = Path(out) / (target if step == 2 else OVERWRITE)
        if step == 2 and async_save:
            background.COPY_POLICY = async_save
            os.environ[SLOW_ENV] = "copy:0.005"  # the next step's forward and backward run beside the copy
            extra = {f"rng_state_{rank}.pth": f"rank {rank}".encode()}
            handle = op.checkpoint.save_model_checkpoint(
                model, path, optimizer=optimizer, async_save=True, extra_files=extra
            )
            model(**batch).loss.backward()  # training goes on during the background write
            optimizer.step()  # after the copy: the checkpoint holds the weights of the call
            optimizer.zero_grad()
            handle.wait()
        else:
            parallelizer.save_model_checkpoint(model, path, optimizer=optimizer)
    torch.distributed.destroy_process_group()


def _run(
    out: Path, crash: str | None = None, crash_rank: int = 0, target: str = NEW, async_save: str | None = None
) -> list[int]:
    """Both ranks; once the crashing rank died, the other is killed (as torchrun would). Their exit codes."""
    ctx = forkserver_context()
    port = free_port()
    args = (str(out), crash, crash_rank, target, async_save)
    procs = [ctx.Process(target=_save_twice, args=(r, port, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[crash_rank].join(120)
    other = procs[1 - crash_rank]
    if crash is not None and other.is_alive():
        other.kill()
    other.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def _checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """The files of both saves, never interrupted: checkpoint-1 (first state), checkpoint-2 (second)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert _run(out) == [0, 0]
    return {"first": _checkpoint_files(out / NEW.replace("2", "1")), "second": _checkpoint_files(out / NEW)}


@pytest.fixture(scope="module")
def uninterrupted_async(tmp_path_factory, uninterrupted) -> dict[str, dict[str, bytes]]:
    """The same two saves, the second async: its files are the blocking save's, plus each rank's extra file."""
    out = tmp_path_factory.mktemp("uninterrupted-async")
    assert _run(out, async_save="overlap") == [0, 0]
    second = _checkpoint_files(out / NEW)
    extras = {f"rng_state_{r}.pth": f"rank {r}".encode() for r in (0, 1)}
    assert second == {**uninterrupted["second"], **extras}, "an async save differs from a blocking one"
    return {"first": _checkpoint_files(out / OVERWRITE), "second": second}


@pytest.mark.parametrize(("point", "rank", "target"), POINTS, ids=[f"{p}@rank{r}->{t}" for p, r, t in POINTS])
def test_crash_mid_save_keeps_last_checkpoint(uninterrupted, tmp_path, point, rank, target):
    _check_crash(uninterrupted, tmp_path, point, rank, target, async_save=None)


@pytest.mark.parametrize(
    ("point", "rank", "target"), ASYNC_POINTS, ids=[f"{p}@rank{r}->{t}" for p, r, t in ASYNC_POINTS]
)
def test_crash_mid_async_save_keeps_last_checkpoint(uninterrupted_async, tmp_path, point, rank, target):
    _check_crash(uninterrupted_async, tmp_path, point, rank, target, async_save="overlap")


@pytest.mark.parametrize(
    ("point", "rank", "target"), ASYNC_STEP_POINTS, ids=[f"{p}@rank{r}->{t}" for p, r, t in ASYNC_STEP_POINTS]
)
def test_crash_in_async_save_copying_in_the_call(uninterrupted_async, tmp_path, point, rank, target):
    _check_crash(uninterrupted_async, tmp_path, point, rank, target, async_save="step")


def _check_crash(uninterrupted, tmp_path, point: str, rank: int, target: str, async_save: str | None) -> None:
    from optimum_parallel.checkpoint import consolidate_checkpoint, find_last_checkpoint, verify_checkpoint

    codes = _run(tmp_path, point, rank, target, async_save)
    assert codes[rank] == -9, f"rank {rank} never reached {point}: exit codes {codes}"
    renamed = point.startswith("published")  # the new directory was in place when the rank died
    interrupted = [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        last = find_last_checkpoint(tmp_path)
    messages = [str(w.message) for w in caught]
    assert last is not None and last.name == (target if renamed else OVERWRITE), (last, messages)
    verify_checkpoint(last)  # marker, index, every file's size and sha256
    expected = uninterrupted["second" if renamed else "first"]
    assert _checkpoint_files(last) == expected, "the checkpoint found differs from an uninterrupted save"
    consolidate_checkpoint(last, tmp_path / "consolidated", progress=False)  # every tensor read back
    for name in interrupted:  # the partial save is ignored, with a message naming it
        assert any(name in m and "interrupted" in m for m in messages), (name, messages)
    if not renamed and rank == 0:  # a surviving rank 0 removes the partial directory when its collective fails
        assert interrupted or target == OVERWRITE, "a save that died before its rename left no partial directory"
