"""Runs one XLA scenario and writes what each rank saw to OUT/rank<N>.pt (the tests compare it with the CPU).

    python _worker.py tp1 MODEL_DIR OUT       # one XLA device, tp=1
    python _worker.py tp2 MODEL_DIR OUT       # two XLA devices in this process (torch_xla.launch, a thread each)
    python _worker.py tp2-sp MODEL_DIR OUT    # the same with sequence parallelism
    python _worker.py dp2 MODEL_DIR OUT       # dp=2 over two XLA devices (`parallelize` with dp_config level 0),
                                              # each on its replica's rows of the global batch
    python _worker.py dp1 MODEL_DIR OUT       # the same loop on one XLA device (the compilations of one device)
    python _worker.py dp2tp2 MODEL_DIR OUT    # dp=2 x tp=2 over four XLA devices: the Parallelizer's tp, then
                                              # `parallelize` with dp_config level 0

PJRT's CPU client has only in-process collectives, so several ranks means several devices of one process, one
thread each. Compilation is serialized (`SYNC_LOCK` around every `torch_xla.sync()`): two threads compiling at
once may deadlock in a collective's rendezvous. The parallel code itself takes its rank from torch-xla's runtime.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path

# dp, tp, sequence parallelism, entry point: the Parallelizer (tp) or `parallelize` with a dp_config
SCENARIOS = {
    "tp1": (1, 1, False, "parallelizer"),
    "tp2": (1, 2, False, "parallelizer"),
    "tp2-sp": (1, 2, True, "parallelizer"),
    "dp1": (1, 1, False, "parallelize"),
    "dp2": (2, 1, False, "parallelize"),
    "dp2tp2": (2, 2, False, "parallelizer"),
}
SYNC_LOCK = threading.Lock()


def sync() -> None:
    import torch_xla

    with SYNC_LOCK:
        torch_xla.sync()


def run(index: int, scenario: str, model_dir: str, out: str) -> None:
    """One rank: a failure ends the whole process at once (the other thread would wait for it in a collective)."""
    try:
        _run(scenario, model_dir, out)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _run(scenario: str, model_dir: str, out: str) -> None:
    with SYNC_LOCK:  # first imports one thread at a time: transformers' lazy module is not thread-safe
        import torch
        import torch_xla
        import torch_xla.debug.metrics as met
        from _common import EPS, LR, STEPS, load_llama, make_batch, replica_rows, shard_pieces
        from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel  # noqa: F401

        import optimum_parallel as op
        from optimum_parallel.mesh import ranks

    dp, tp, sequence_parallel, entry = SCENARIOS[scenario]
    device = torch_xla.device()
    with SYNC_LOCK:  # group creation, one thread at a time
        mesh = op.init_mesh(dp=dp, tp=tp, device="xla", timeout=120)
    me = ranks.global_rank()
    assert ranks.world_size() == dp * tp and mesh.device_type == "xla", (ranks.world_size(), dp, tp)
    assert (mesh.size("dp"), mesh.size("tp"), mesh.data_parallel_size) == (dp, tp, dp)
    assert mesh.rank("dp") * tp + mesh.rank("tp") == me  # tp ranks are neighbours
    assert (mesh.rank("dp"), mesh.rank("tp")) == (ranks.rank(mesh.group("dp")), ranks.rank(mesh.group("tp")))

    refusals = {}
    if entry == "parallelizer":
        with op.lazy_load_for_parallelism(tensor_parallel_size=tp):  # each rank reads its slices, on the CPU
            model = load_llama(model_dir)
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        assert parallelizer.__name__ == "LlamaParallelizer", parallelizer  # the family plan on every rank
        model = parallelizer.parallelize(model, device=device, sequence_parallel_enabled=sequence_parallel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        if dp > 1:  # then data parallelism over the tp-split model (gradients averaged over each shard's replicas)
            model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    else:  # Paddle's `parallelize`, data parallelism only: the model on the device first, then its optimizer
        model = load_llama(model_dir).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        if dp > 1:  # (at dp=1 `parallelize` refuses a dp_config: the plain model runs the loop)
            refusals = refused_levels(model, optimizer, mesh)
            model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    # layers whose wiring (decided with the plan) puts them in a sequence-parallel region
    split = [n for n, m in model.named_modules() if getattr(getattr(m, "wiring", None), "sequence", None) is not None]
    assert bool(split) == sequence_parallel, split
    params = dict(model.named_parameters())
    assert all(p.device.type == "xla" for p in params.values())
    if scenario == "tp2":
        sync()
        parallelizer.save_model_checkpoint(model, Path(out) / "ckpt-0")

    # every tp rank holds the whole batch; each dp rank its replica's rows of the global batch
    batch = {k: v.to(device) for k, v in replica_rows(make_batch(replicas=dp), mesh.rank("dp"), dp).items()}
    with torch.no_grad():  # inference: the full-vocabulary logits (gathered from the vocab-parallel head)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    sync()
    logits = logits.cpu()
    losses, grads = [], None
    for step in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        sync()  # the tests look at the gradients; a training loop needs only the sync after the step
        losses.append(loss.detach().cpu().item())
        if step == 0:
            grads = shard_pieces({n: p.grad for n, p in params.items()}, params)
        optimizer.step()
        optimizer.zero_grad()
        sync()
    if scenario == "tp2":
        parallelizer.save_model_checkpoint(model, Path(out) / f"ckpt-{STEPS}")
    compiles = met.metric_data("CompileTime")
    result = {
        "ordinal": me,
        "dp_rank": mesh.rank("dp"),
        "world": ranks.world_size(),
        "losses": losses,
        "logits": logits,
        "grads": grads,
        "params": shard_pieces(params, params),
        "compiles": compiles[0] if compiles else 0,
        "refusals": refusals,
    }
    torch.save(result, Path(out) / f"rank{me}.pt")


def refused_levels(model, optimizer, mesh) -> dict[int, str]:
    """`parallelize` at sharding levels 1-3 with dp=2 on XLA: each level's error, raised before the model or the
    optimizer changed."""
    import optimum_parallel as op

    def held() -> list:
        return [(name, p, p.grad, p._post_accumulate_grad_hooks) for name, p in model.named_parameters()]

    before, found = held(), {}
    for level in (1, 2, 3):
        try:
            op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})
        except ValueError as refused:
            found[level] = str(refused)
        else:
            raise AssertionError(f"sharding_level {level} was not refused on XLA")
    after = held()
    assert len(after) == len(before), "a refused request changed the model"
    for (name, *was), (_, *now) in zip(before, after, strict=True):
        assert all(a is b for a, b in zip(was, now, strict=True)), f"a refused request changed {name}"
    assert type(model).__name__ == "LlamaForCausalLM" and not optimizer.state
    return found


def main() -> None:
    scenario, model_dir, out = sys.argv[1:4]
    dp, tp, _, _ = SCENARIOS[scenario]
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(dp * tp)
    import torch_xla

    if dp * tp == 1:
        run(0, scenario, model_dir, out)
    else:
        torch_xla.launch(run, args=(scenario, model_dir, out))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
