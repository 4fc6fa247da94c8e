"""Sharded checkpoints of expert-parallel models at data-parallel sharding levels 1-3 (ZeRO-1: two optimizers, dense
over dp x cp and experts over their replica group; FSDP2: experts sharded over their replica group), with AdamW state
(gloo, 4 ranks): the files and index are those of sharding level 0 (same names, shards, files, optimizer groups), they
hold the trained tensors bit for bit, loading is bit-identical and the next steps' losses equal an uninterrupted run,
another level loads them too, consolidate gives a plain HF checkpoint of the single model, and reshard to ep=1 and
ep=4 with the optimizer state loads and trains on; the optimizer groups are recorded as built; pp=2 x dp=2 x ep=2 at
levels 0, 1 and 3 saves and resumes alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _checks import train_step
from _models import build_model, rel_err, tiny_config
from safetensors.torch import load_file
from test_expert_parallel import MOE, replica_batch
from test_expert_parallel_checkpoint import (
    _local_batch,
    _replica_mean,
    _where,
    assemble,
    expected_local,
    single_model_reference,
)
from test_pipeline import pipeline_batch
from transformers import AutoModelForCausalLM

WORLD_SIZE = 4
LR = 1e-2
TOL = 1e-5
DP4_EP2 = dict(dp=4, ep=2)
TP2_EP2 = dict(dp=2, tp=2, ep=2)


# ----------------------------------------------------------------------------------------------- worker helpers


def _parallel(mesh, model_type: str, seed: int, level: int):
    """A tiny MoE (random with `seed`) and its AdamW, parallelized on `mesh` at sharding `level`."""
    import optimum_parallel as op

    model = build_model(tiny_config(model_type, **MOE[model_type]), seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    if mesh.tp_size > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    return op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered over its mesh (a collective), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """Copies of what this rank holds: its parameters' and AdamW state's local shards (ZeRO-1: its share)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {n: _local(p.detach()).clone() for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        out.update({f"{names[id(param)]}/{k}": _local(v).clone() for k, v in state.items()})
    return out


def full_view(model, optimizer) -> dict[str, tuple[torch.Tensor, dict]]:
    """Every parameter and AdamW state tensor this rank's tp / ep position holds, FSDP2 shards gathered (in the
    parameters' order, the same on every rank), with where it sits; ZeRO-1 state only where this rank holds it."""
    out = {}
    state = optimizer.state
    for name, param in model.named_parameters():
        out[name] = (_whole(param.detach()).clone(), _where(param))
        for key, value in sorted((state.get(param) or {}).items()):  # ZeRO-1 after a load: None
            like = value.shape == param.shape
            out[f"{name}/{key}"] = (_whole(value).clone(), _where(param) if like else {"experts": None, "tp": None})
    return out


def train_save_resume(model_type: str, sizes: dict, level: int, ckpt: str, before: int = 2, after: int = 2) -> dict:
    """`before` steps at sharding `level`, save (sharded + regular) with the optimizer, `after` more steps; a fresh
    model (other weights, a step of its own) at the same level loads it and trains `after` steps, and one at the
    next level (0 -> 1 -> 2 -> 3 -> 0) takes one step."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import load_model_checkpoint, save_model_checkpoint

    mesh = op.init_mesh(**sizes)
    model, optimizer = _parallel(mesh, model_type, 0, level)
    batch = _local_batch(model.config, mesh)
    for _ in range(before):
        train_step(model, optimizer, batch)
    save_model_checkpoint(model, ckpt, optimizer=optimizer, as_regular=True)
    saved, view = local_snapshot(model, optimizer), full_view(model, optimizer)
    straight = [_replica_mean(train_step(model, optimizer, batch), mesh) for _ in range(after)]

    def resume(at: int, steps: int) -> tuple[dict, list[float]]:
        fresh, fresh_optimizer = _parallel(mesh, model_type, 99, at)
        train_step(fresh, fresh_optimizer, batch)  # state of its own, which the checkpoint must replace
        load_model_checkpoint(fresh, ckpt, optimizer=fresh_optimizer)
        loaded = local_snapshot(fresh, fresh_optimizer)
        return loaded, [_replica_mean(train_step(fresh, fresh_optimizer, batch), mesh) for _ in range(steps)]

    loaded, resumed = resume(level, after)
    _, elsewhere = resume((level + 1) % 4, 1)
    differ = sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k]))
    out = {"view": view, "differ": differ, "keys": (sorted(saved), sorted(loaded))}
    out.update(straight=straight, resumed=resumed, elsewhere=elsewhere, optimizer=type(optimizer).__name__)
    if dist.get_rank() == 0:  # the single model on the global batch, trained alike
        out.update(single_model_reference(model_type, mesh.data_parallel_size, before))
    return out


def load_and_continue(model_type: str, sizes: dict, level: int, ckpt: str, steps: int = 2) -> dict:
    """A fresh model on `sizes` at `level` loads `ckpt` with its optimizer state: what it holds, and the losses of
    `steps` more steps."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import load_model_checkpoint

    mesh = op.init_mesh(**sizes)
    model, optimizer = _parallel(mesh, model_type, 99, level)
    batch = _local_batch(model.config, mesh)
    train_step(model, optimizer, batch)
    load_model_checkpoint(model, ckpt, optimizer=optimizer)
    view = full_view(model, optimizer)
    return {"view": view, "losses": [_replica_mean(train_step(model, optimizer, batch), mesh) for _ in range(2)]}


# ----------------------------------------------------------------------------------------------- save / load / resume

CASES = [
    ("mixtral", DP4_EP2, 0),  # the files every other level must match
    ("mixtral", DP4_EP2, 1),
    ("mixtral", DP4_EP2, 2),
    ("mixtral", DP4_EP2, 3),
    ("mixtral", TP2_EP2, 0),
    ("mixtral", TP2_EP2, 2),
]


def _key(model_type: str, sizes: dict, level: int) -> str:
    return f"{model_type}-{'-'.join(f'{d}{n}' for d, n in sizes.items())}-L{level}"


@pytest.fixture(scope="module")
def runs(pool, tmp_path_factory) -> dict:
    out = {}
    for case in CASES:
        ckpt = str(tmp_path_factory.mktemp("ep_levels") / _key(*case))
        results = pool.run(train_save_resume, *case, ckpt)
        out[_key(*case)] = {"ckpt": ckpt, "results": results, "full": assemble([r["view"] for r in results])}
    return out


LEVEL_CASES = [c for c in CASES if c[2]]
LEVEL_IDS = [_key(*c) for c in LEVEL_CASES]


@pytest.mark.parametrize("model_type,sizes,level", LEVEL_CASES, ids=LEVEL_IDS)
def test_save_load_is_bit_identical_and_resumes(runs, model_type, sizes, level):
    run = runs[_key(model_type, sizes, level)]
    for rank, result in enumerate(run["results"]):
        assert result["optimizer"] == ("ExpertSplitOptimizer" if level == 1 else "AdamW"), result["optimizer"]
        assert result["keys"][0] == result["keys"][1], rank
        assert result["differ"] == [], f"rank {rank}: loaded tensors differ: {result['differ'][:5]}"
        assert any("/exp_avg" in k for k in result["keys"][0]) or level == 1, "no optimizer state was compared"
        assert result["resumed"] == result["straight"], f"rank {rank}: {result['resumed']} != {result['straight']}"
        # the next level (1 -> 2, 2 -> 3, 3 -> 0) loads the same files and takes the same step
        assert abs(result["elsewhere"][0] - result["straight"][0]) <= TOL * abs(result["straight"][0]), result
    assert all(not torch.isnan(t).any() for t in run["full"].values())
    assert any("/exp_avg" in k for k in run["full"])


@pytest.mark.parametrize("model_type,sizes,level", LEVEL_CASES, ids=LEVEL_IDS)
def test_files_are_those_of_level_0_holding_the_trained_tensors(runs, model_type, sizes, level):
    """The index of a level-L checkpoint is that of level 0 at the same mesh but for checksums (the same tensors,
    shards, files and optimizer groups), and every stored tensor, model and optimizer, is the trained one."""
    from optimum_parallel.checkpoint import read_index, verify_checkpoint
    from optimum_parallel.checkpoint.reading import ShardFiles

    run = runs[_key(model_type, sizes, level)]
    ckpt = Path(run["ckpt"])
    index = verify_checkpoint(ckpt)
    base_key = _key(model_type, sizes, 0)
    if base_key in runs:
        base = read_index(runs[base_key]["ckpt"])

        def shape(entries):
            return {
                n: (e.dtype, e.global_shape, e.experts, [(s.file, s.key, s.ranges, s.ep_rank) for s in e.shards])
                for n, e in entries.items()
            }

        assert shape(index.tensors) == shape(base.tensors)
        assert shape(index.optimizer_tensors) == shape(base.optimizer_tensors)
        assert index.optimizer == base.optimizer and index.mesh == base.mesh and index.tied == base.tied
        assert sorted(index.files) == sorted(base.files)
    compared = 0
    with ShardFiles(ckpt, index) as files:
        for table in (index.tensors, index.optimizer_tensors):
            for name, entry in table.items():
                stored = files.assemble(name, entry)
                assert torch.equal(stored, run["full"][name]), f"{name} differs from the trained tensor"
                compared += 1
    assert compared == len(run["full"]), (compared, len(run["full"]))


@pytest.mark.parametrize("model_type,sizes,level", LEVEL_CASES, ids=LEVEL_IDS)
def test_consolidate_equals_the_single_model(runs, tmp_path, model_type, sizes, level):
    import optimum_parallel as op

    run = runs[_key(model_type, sizes, level)]
    out = op.consolidate_checkpoint(run["ckpt"], tmp_path / "hf", progress=False)
    tensors = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    params = {k: v for k, v in run["full"].items() if "/" not in k}
    assert set(tensors) == set(params)
    assert all(torch.equal(tensors[n], full) for n, full in params.items())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    reference = run["results"][0]["reference"]
    worst = {n: rel_err(v, reference[n]) for n, v in model.state_dict().items()}
    batch = replica_batch(model.config, sizes["dp"])
    with torch.no_grad():
        logits = rel_err(model(**batch).logits, run["results"][0]["reference_logits"])
    # as in test_expert_parallel_checkpoint: AdamW turns last-bit gradient differences into updates of up to lr
    assert max(worst.values()) <= 1e-3, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert logits <= TOL
    regular = AutoModelForCausalLM.from_pretrained(run["ckpt"], dtype=torch.float32, attn_implementation="eager")
    assert all(torch.equal(a, b) for a, b in zip(regular.parameters(), model.parameters(), strict=True))


# ----------------------------------------------------------------------------------------------- reshard

RESHARDS = [  # (saved case, loaded at, level)
    (("mixtral", DP4_EP2, 3), dict(dp=4), 3),
    (("mixtral", DP4_EP2, 3), dict(dp=4, ep=4), 3),
    (("mixtral", DP4_EP2, 1), dict(dp=4, ep=4), 1),
    (("mixtral", DP4_EP2, 2), dict(dp=4), 1),
    (("mixtral", TP2_EP2, 2), dict(dp=4, ep=4), 2),
    (("mixtral", TP2_EP2, 2), dict(dp=2, tp=2), 2),
]


@pytest.mark.parametrize(
    "saved,loaded_at,level",
    RESHARDS,
    ids=[f"{_key(*s)}-to-{'-'.join(f'{d}{n}' for d, n in b.items())}-L{lv}" for s, b, lv in RESHARDS],
)
def test_reshard_to_other_ep_with_optimizer_state(pool, runs, tmp_path, saved, loaded_at, level):
    import optimum_parallel as op
    from optimum_parallel.checkpoint import read_index

    run = runs[_key(*saved)]
    tp, ep = loaded_at.get("tp", 1), loaded_at.get("ep", 1)
    target = op.reshard_checkpoint(run["ckpt"], tmp_path / "resharded", tp=tp, ep=ep, progress=False)
    assert read_index(target).mesh == {"dp": saved[1]["dp"], "pp": 1, "tp": tp, **({"ep": ep} if ep > 1 else {})}
    results = pool.run(load_and_continue, saved[0], loaded_at, level, str(target))
    compared = 0
    for rank, result in enumerate(results):
        for name, (value, where) in result["view"].items():
            assert torch.equal(value, expected_local(run["full"][name], where)), f"rank {rank}: {name} at {where}"
            compared += "/exp_avg" in name and where["experts"] is not None
    assert compared or ep == 1
    held = set().union(*(r["view"] for r in results))
    assert held == set(run["full"]), sorted(held ^ set(run["full"]))[:5]
    if loaded_at["dp"] == saved[1]["dp"]:  # the same rows per replica: training goes on alike
        straight = run["results"][0]["straight"]
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(results[0]["losses"], straight, strict=True))


# ----------------------------------------------------------------------------------------------- param groups


def grouped_save_load(level: int, ckpt: str) -> dict:
    """dp=4 x ep=2 with three AdamW param groups as transformers' Trainer makes them (decay, no decay, and an empty
    one): a step, save, and a fresh model at the same level loads it; whether what it holds is what was saved."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import load_model_checkpoint, save_model_checkpoint

    mesh = op.init_mesh(**DP4_EP2)

    def build(seed: int):
        model = build_model(tiny_config("mixtral", **MOE["mixtral"]), seed=seed)
        params = list(model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": LR / 2},
            {"params": [], "weight_decay": 0.3},
        ]
        optimizer = torch.optim.AdamW(groups, lr=LR)
        return op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})

    model, optimizer = build(0)
    batch = _local_batch(model.config, mesh)
    train_step(model, optimizer, batch)
    save_model_checkpoint(model, ckpt, optimizer=optimizer)
    saved = local_snapshot(model, optimizer)
    fresh, fresh_optimizer = build(99)
    load_model_checkpoint(fresh, ckpt, optimizer=fresh_optimizer)
    loaded = local_snapshot(fresh, fresh_optimizer)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in fresh_optimizer.param_groups]
    return {
        "same": sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved),
        "groups": groups,
    }


def test_param_groups_are_recorded_as_built(pool, tmp_path):
    """The index's optimizer groups (options, parameter names, an empty group where the rebuilt optimizer keeps it)
    are level 0's at levels 1 and 3."""
    from optimum_parallel.checkpoint import read_index

    meta = {}
    for level in (0, 1, 3):
        results = pool.run(grouped_save_load, level, str(tmp_path / f"L{level}"))
        assert all(r["same"] for r in results), level
        meta[level] = read_index(tmp_path / f"L{level}").optimizer
    groups = meta[0]["param_groups"]["0"]
    assert [(g["weight_decay"], g["lr"]) for g in groups[:2]] == [(0.1, LR), (0.0, LR / 2)]
    assert all(g["weight_decay"] == 0.3 and not g["params"] for g in groups[2:])  # the empty group, where kept
    assert meta[1] == meta[0] and meta[3] == meta[0]


# ----------------------------------------------------------------------------------------------- pp x ep


def pipeline_save_resume(level: int, ckpt: str) -> dict:
    """pp=2 x dp=2 x ep=2 (4 layers, 2 micro-batches) at sharding `level`: a step, save with AdamW state, two more;
    a fresh model at the same level loads the checkpoint and takes the same two steps."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import load_model_checkpoint, save_model_checkpoint

    mesh = op.init_mesh(dp=2, pp=2, ep=2)
    config = tiny_config("mixtral", **{**MOE["mixtral"], "num_hidden_layers": 4})

    def build(seed: int):
        model = build_model(config, seed=seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
        return op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})

    def step(model, optimizer) -> float:
        loss = model.run_train(**local)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    local = {k: v[4 * mesh.rank("dp") : 4 * mesh.rank("dp") + 4] for k, v in pipeline_batch(config, rows=8).items()}
    model, optimizer = build(0)
    step(model, optimizer)
    save_model_checkpoint(model, ckpt, optimizer=optimizer)
    saved = local_snapshot(model, optimizer)
    straight = [step(model, optimizer) for _ in range(2)]
    fresh, fresh_optimizer = build(99)
    step(fresh, fresh_optimizer)
    load_model_checkpoint(fresh, ckpt, optimizer=fresh_optimizer)
    loaded = local_snapshot(fresh, fresh_optimizer)
    same = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    return {"same": same, "straight": straight, "resumed": [step(fresh, fresh_optimizer) for _ in range(2)]}


@pytest.mark.parametrize("level", [0, 1, 3])
def test_pipeline_with_expert_parallel_save_load_resumes(pool, tmp_path, level):
    from optimum_parallel.checkpoint import verify_checkpoint

    for rank, result in enumerate(pool.run(pipeline_save_resume, level, str(tmp_path / "ckpt"))):
        assert result["same"] and result["resumed"] == result["straight"], (rank, result)
    index = verify_checkpoint(tmp_path / "ckpt")
    assert index.mesh == {"dp": 2, "pp": 2, "tp": 1, "ep": 2}
    blocks = {(e.pp_rank, s.ep_rank) for e in index.tensors.values() if e.experts for s in e.shards}
    assert blocks == {(0, 0), (0, 1), (1, 0), (1, 1)}  # each stage's experts, one block per ep rank
