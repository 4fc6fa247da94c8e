"""Sharded checkpoints and lazy loading with expert parallelism (gloo, 4 ranks): save -> load is bit-identical (model
and AdamW state) and training goes on as if uninterrupted, at dp=4 x ep=2 and dp=2 x tp=2 x ep=2; consolidate gives
a plain HF checkpoint equal to the single model trained alike; reshard between ep (and tp) sizes; a lazily built
model reads only its rank's experts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _checks import train_step
from _models import build_model, rel_err, tiny_config
from safetensors.torch import load_file, save_file
from test_expert_parallel import MOE, replica_batch
from transformers import AutoModelForCausalLM

WORLD_SIZE = 4
LR = 1e-2
TOL = 1e-5
LOAD = dict(dtype=torch.float32, attn_implementation="eager")
DP4_EP2 = dict(dp=4, ep=2)
TP2_EP2 = dict(dp=2, tp=2, ep=2)


# ----------------------------------------------------------------------------------------------- worker helpers


def _parallel(mesh, model_type: str, seed: int, model=None, lazy_optimizer: bool = False):
    """A tiny MoE (random with `seed`, or `model`) and its AdamW, parallelized on `mesh` (tp plan first, then ep and
    data parallelism at sharding level 0)."""
    import optimum_parallel as op

    model = model if model is not None else build_model(tiny_config(model_type, **MOE[model_type]), seed=seed)
    adamw = op.make_optimizer_constructor_lazy(torch.optim.AdamW) if lazy_optimizer else torch.optim.AdamW
    optimizer = adamw(model.parameters(), lr=LR, weight_decay=0.1)
    if mesh.tp_size > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    if mesh.data_parallel_size == 1:
        return model, optimizer
    return op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})


def _where(param) -> dict:
    """Where a local tensor sits in the global one: its experts (dim 0) and its tp cut."""
    from optimum_parallel.expert_parallel import expert_range

    layout = getattr(param, "shard_layout", None)
    return {"experts": expert_range(param), "tp": None if layout is None or layout.dim is None else layout.to_json()}


def _snapshot(model, optimizer) -> dict:
    """Every local parameter and AdamW state tensor, with where it sits (copies)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {}
    for name, param in model.named_parameters():
        tensors[name] = (param.detach().clone(), _where(param))
    for param, state in optimizer.state.items():
        for key, value in state.items():
            like = value.shape == param.shape
            tensors[f"{names[id(param)]}/{key}"] = (value.clone(), _where(param) if like else {"experts": None})
    return tensors


def _local_batch(config, mesh) -> dict:
    replica = mesh.data_parallel_rank
    return {k: v[2 * replica : 2 * replica + 2] for k, v in replica_batch(config, mesh.data_parallel_size).items()}


def _replica_mean(loss: float, mesh) -> float:
    total = torch.tensor(loss, dtype=torch.float64)
    dist.all_reduce(total, group=mesh.data_parallel_group)
    return (total / mesh.data_parallel_size).item()


def train_save_resume(model_type: str, sizes: dict, ckpt: str, before: int = 2, after: int = 2) -> dict:
    """`before` steps, save (sharded + regular), `after` more steps; then a fresh model (other weights) loads the
    checkpoint and trains `after` steps. Also trains the single model on the whole batch `before` steps."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import load_model_checkpoint, save_model_checkpoint

    mesh = op.init_mesh(**sizes)
    model, optimizer = _parallel(mesh, model_type, seed=0)
    batch = _local_batch(model.config, mesh)
    for _ in range(before):
        train_step(model, optimizer, batch)
    save_model_checkpoint(model, ckpt, optimizer=optimizer, as_regular=True)
    saved = _snapshot(model, optimizer)
    straight = [_replica_mean(train_step(model, optimizer, batch), mesh) for _ in range(after)]

    fresh, fresh_optimizer = _parallel(mesh, model_type, seed=99)
    train_step(fresh, fresh_optimizer, batch)  # state of its own, which the checkpoint must replace
    load_model_checkpoint(fresh, ckpt, optimizer=fresh_optimizer)
    loaded = _snapshot(fresh, fresh_optimizer)
    differ = sorted(k for k in saved if k not in loaded or not torch.equal(saved[k][0], loaded[k][0]))
    resumed = [_replica_mean(train_step(fresh, fresh_optimizer, batch), mesh) for _ in range(after)]

    out = {"saved": saved, "differ": differ, "straight": straight, "resumed": resumed, "only": sorted(loaded)}
    if dist.get_rank() == 0:  # the single model on the global batch, trained alike
        out.update(single_model_reference(model_type, mesh.data_parallel_size, before))
    return out


def single_model_reference(model_type: str, replicas: int, steps: int) -> dict:
    """The single model trained `steps` AdamW steps on the global batch of `replicas` replicas: its state and
    logits."""
    reference = build_model(tiny_config(model_type, **MOE[model_type]), seed=0)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    whole = replica_batch(reference.config, replicas)
    for _ in range(steps):
        train_step(reference, ref_optimizer, whole)
    with torch.no_grad():
        logits = reference(**whole).logits
    return {"reference": {k: v.detach().clone() for k, v in reference.state_dict().items()}, "reference_logits": logits}


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The global tensors of every rank's snapshot, put together by their layouts (not by the checkpoint code); a name
    may be missing on some ranks (ZeRO-1 state)."""
    full: dict[str, torch.Tensor] = {}
    for snapshot in per_rank:
        for name, (local, where) in snapshot.items():
            if name not in full:
                shape = list(where["tp"]["global_shape"]) if where.get("tp") else list(local.shape)
                if where["experts"] is not None:
                    shape[0] = max(v[name][1]["experts"][1] for v in per_rank if name in v)
                full[name] = torch.full(shape, float("nan"), dtype=local.dtype)
            target = full[name]
            if where["experts"] is not None:
                target = target.narrow(0, where["experts"][0], where["experts"][1] - where["experts"][0])
            if not where.get("tp"):
                target.copy_(local)
                continue
            dim, offset = where["tp"]["dim"], 0
            for start, end in where["tp"]["ranges"]:
                target.narrow(dim, start, end - start).copy_(local.narrow(dim, offset, end - start))
                offset += end - start
    return full


def expected_local(full: torch.Tensor, where: dict) -> torch.Tensor:
    """The local tensor `where` describes, cut out of the global `full`."""
    from optimum_parallel.tensor_parallel.spec import ShardLayout

    if where["experts"] is not None:
        start, end = where["experts"]
        full = full.narrow(0, start, end - start)
    if where.get("tp"):
        full = ShardLayout.from_json({**where["tp"], "global_shape": list(full.shape)}).slice(full)
    return full


# ----------------------------------------------------------------------------------------------- save / load / resume

CASES = [("mixtral", DP4_EP2), ("qwen3_moe", TP2_EP2), ("gpt_oss", DP4_EP2), ("mixtral", TP2_EP2), ("gpt_oss", TP2_EP2)]


@pytest.fixture(scope="module")
def runs(pool, tmp_path_factory) -> dict:
    """One save -> load -> resume run per case (the checkpoints are reused by the consolidate and reshard tests)."""
    out = {}
    for model_type, sizes in CASES:
        key = _key(model_type, sizes)
        ckpt = str(tmp_path_factory.mktemp("ep") / key)
        results = pool.run(train_save_resume, model_type, sizes, ckpt)
        out[key] = {"ckpt": ckpt, "results": results, "full": assemble([r["saved"] for r in results])}
    return out


def _key(model_type: str, sizes: dict) -> str:
    return model_type + "-" + "-".join(f"{d}{n}" for d, n in sizes.items())


@pytest.mark.parametrize("model_type,sizes", CASES, ids=[_key(*c) for c in CASES])
def test_save_load_is_bit_identical_and_resumes(runs, model_type, sizes):
    run = runs[_key(model_type, sizes)]
    for rank, result in enumerate(run["results"]):
        assert result["differ"] == [], f"rank {rank}: loaded tensors differ: {result['differ'][:5]}"
        assert sorted(result["saved"]) == result["only"]
        assert any("/exp_avg" in k for k in result["saved"]), "no optimizer state was compared"
        assert result["resumed"] == result["straight"], f"rank {rank}: {result['resumed']} != {result['straight']}"
    assert all(not torch.isnan(t).any() for t in run["full"].values())


@pytest.mark.parametrize("model_type,sizes", CASES[:3], ids=[_key(*c) for c in CASES[:3]])
def test_index_and_files(runs, model_type, sizes):
    """Every expert block is stored once, by the first replica of its expert group, in that ep rank's file."""
    from optimum_parallel.checkpoint import read_index, verify_checkpoint

    ckpt = Path(runs[_key(model_type, sizes)]["ckpt"])
    index = verify_checkpoint(ckpt)
    ep, tp = sizes["ep"], sizes.get("tp", 1)
    assert index.mesh == {"dp": sizes["dp"], "pp": 1, "tp": tp, "ep": ep}
    experts = {n: e for n, e in index.tensors.items() if e.experts}
    assert experts and all(".experts." in n for n in experts)
    assert not any(".experts." in n for n, e in index.tensors.items() if not e.experts)
    for name, entry in experts.items():
        count = entry.global_shape[0]
        blocks = sorted({(s.ep_rank, tuple(s.experts)) for s in entry.shards})
        assert blocks == [(e, (e * count // ep, (e + 1) * count // ep)) for e in range(ep)], (name, blocks)
        for shard in entry.shards:
            suffix = f"-ep{shard.ep_rank:02d}" if shard.ep_rank else ""
            assert shard.file == f"model-pp00-tp{shard.tp_ranks[0]:02d}{suffix}.safetensors"
    state = {k: e for k, e in index.optimizer_tensors.items() if e.experts}
    assert {e.param for e in state.values()} == set(experts)  # AdamW's exp_avg / exp_avg_sq, split like them
    names = sorted(p.name for p in ckpt.glob("*-pp*.safetensors"))
    expected = sorted(
        f"{kind}-pp00-tp{t:02d}{f'-ep{e:02d}' if e else ''}.safetensors"
        for kind in ("model", "optimizer")
        for t in range(tp)
        for e in range(ep)
    )
    assert names == expected
    dense = load_file(ckpt / "model-pp00-tp00-ep01.safetensors")
    assert dense and all(".experts." in k for k in dense)  # ep rank > 0 files hold experts only
    assert read_index(ckpt).tensors == index.tensors


@pytest.mark.parametrize("model_type,sizes", CASES[:3], ids=[_key(*c) for c in CASES[:3]])
def test_consolidate_loads_in_transformers_equal_to_the_single_model(runs, tmp_path, model_type, sizes):
    import optimum_parallel as op

    run = runs[_key(model_type, sizes)]
    out = op.consolidate_checkpoint(run["ckpt"], tmp_path / "hf", progress=False)
    tensors = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    params = {k: v for k, v in run["full"].items() if "/" not in k}
    assert set(tensors) == set(params)
    for name, full in params.items():
        assert torch.equal(tensors[name], full), f"{name} differs from the trained parallel weights"
    model = AutoModelForCausalLM.from_pretrained(out, **LOAD)
    reference = run["results"][0]["reference"]
    state = model.state_dict()
    worst = {n: rel_err(state[n], reference[n]) for n in reference}
    batch = replica_batch(model.config, sizes["dp"] * sizes.get("cp", 1))
    with torch.no_grad():
        logits = rel_err(model(**batch).logits, run["results"][0]["reference_logits"])
    # the files are the parallel weights bit for bit (above); those differ from the single model's by AdamW turning
    # last-bit gradient differences of near-zero gradients into updates of up to lr: up to ~2e-4 relative here
    assert max(worst.values()) <= 1e-3, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert logits <= TOL
    # as_regular=True wrote the same standard checkpoint next to the shards
    regular = AutoModelForCausalLM.from_pretrained(run["ckpt"], **LOAD)
    assert all(torch.equal(a, b) for a, b in zip(regular.parameters(), model.parameters(), strict=True))


# ----------------------------------------------------------------------------------------------- reshard


def load_and_continue(model_type: str, sizes: dict, ckpt: str, steps: int = 2) -> dict:
    """A fresh model (other weights, a step of its own) on `sizes` loads `ckpt` with its optimizer state; the
    snapshot after loading and the losses of `steps` more steps."""
    import optimum_parallel as op
    from optimum_parallel.checkpoint import load_model_checkpoint

    mesh = op.init_mesh(**sizes)
    model, optimizer = _parallel(mesh, model_type, seed=99)
    batch = _local_batch(model.config, mesh)
    train_step(model, optimizer, batch)
    load_model_checkpoint(model, ckpt, optimizer=optimizer)
    loaded = _snapshot(model, optimizer)
    losses = [_replica_mean(train_step(model, optimizer, batch), mesh) for _ in range(steps)]
    return {"loaded": loaded, "losses": losses}


RESHARDS = [  # (model, saved at, loaded at)
    ("mixtral", DP4_EP2, dict(dp=4)),
    ("mixtral", DP4_EP2, dict(dp=4, ep=4)),
    ("mixtral", TP2_EP2, dict(dp=4, ep=4)),
    ("qwen3_moe", TP2_EP2, dict(tp=4)),
]


@pytest.mark.parametrize(
    "model_type,saved_at,loaded_at", RESHARDS, ids=[f"{m}-{_key('', a)}-to{_key('', b)}" for m, a, b in RESHARDS]
)
def test_reshard_between_ep_and_tp_sizes(pool, runs, tmp_path, model_type, saved_at, loaded_at):
    import optimum_parallel as op
    from optimum_parallel.checkpoint import read_index

    run = runs[_key(model_type, saved_at)]
    tp, ep = loaded_at.get("tp", 1), loaded_at.get("ep", 1)
    target = op.reshard_checkpoint(run["ckpt"], tmp_path / "resharded", tp=tp, ep=ep, progress=False)
    assert read_index(target).mesh == {"dp": saved_at["dp"], "pp": 1, "tp": tp, **({"ep": ep} if ep > 1 else {})}
    results = pool.run(load_and_continue, model_type, {"dp": 1, **loaded_at}, str(target))
    compared = 0
    for rank, result in enumerate(results):
        assert sorted(result["loaded"]) == sorted(run["full"]), rank
        for name, (local, where) in result["loaded"].items():
            expected = expected_local(run["full"][name], where)
            assert torch.equal(local, expected), f"rank {rank}: {name} at {where}"
            compared += ".experts." in name and where["experts"] is not None
    assert compared or ep == 1
    if loaded_at.get("dp", 1) == saved_at["dp"]:  # the same batches per replica: training goes on alike
        straight = run["results"][0]["straight"]
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(results[0]["losses"], straight, strict=True))


def test_reshard_ep_round_trip_gives_the_same_files(runs, tmp_path):
    """ep 2 -> 1 -> 2 (pure CPU): every tensor of every file is the saved one again."""
    import optimum_parallel as op

    source = Path(runs[_key("mixtral", DP4_EP2)]["ckpt"])
    one = op.reshard_checkpoint(source, tmp_path / "ep1", tp=1, ep=1, progress=False)
    assert not list(one.glob("*-ep*.safetensors"))
    back = op.reshard_checkpoint(one, tmp_path / "ep2", tp=1, ep=2, progress=False)
    for file in sorted(source.glob("*.safetensors")):
        if file.name.startswith(("model-pp", "optimizer-pp")):
            original, again = load_file(file), load_file(back / file.name)
            assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)


def test_reshard_and_load_refusals(runs, tmp_path):
    import optimum_parallel as op
    from optimum_parallel.checkpoint import CheckpointError

    ckpt = runs[_key("mixtral", DP4_EP2)]["ckpt"]
    with pytest.raises(CheckpointError, match=r"4 experts cannot be split over ep=3; allowed: 1, 2, 4"):
        op.reshard_checkpoint(ckpt, tmp_path / "ep3", tp=1, ep=3, progress=False)
    assert not (tmp_path / "ep3").exists()
    with pytest.raises(ValueError, match="ep=0"):
        op.reshard_checkpoint(ckpt, tmp_path / "ep0", tp=1, ep=0, progress=False)


def load_at_other_ep(ckpt: str) -> str:
    import optimum_parallel as op
    from optimum_parallel.checkpoint import load_model_checkpoint

    mesh = op.init_mesh(dp=4, ep=4)
    model, optimizer = _parallel(mesh, "mixtral", seed=99)
    try:
        load_model_checkpoint(model, ckpt, optimizer=optimizer)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def save_with_zero1(path: str) -> dict:
    """A ZeRO-1 optimizer of an ep model built by hand over dp x cp (ranks holding other experts under the same
    names), not over the experts' replica group as `parallelize` builds it at level 1: refused before anything is
    written."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import optimum_parallel as op
    from optimum_parallel.checkpoint import save_model_checkpoint

    mesh = op.init_mesh(dp=4, ep=2)
    model, _ = _parallel(mesh, "mixtral", seed=0)
    zero = ZeroRedundancyOptimizer(
        list(model.parameters()), torch.optim.AdamW, process_group=mesh.data_parallel_group, lr=LR
    )
    try:
        save_model_checkpoint(model, path, optimizer=zero)
    except NotImplementedError as err:
        return {"error": str(err), "written": Path(path).exists()}
    return {"error": "no error", "written": True}


def test_refusals_name_the_key(pool, runs, tmp_path):
    ckpt = runs[_key("mixtral", DP4_EP2)]["ckpt"]
    for error in pool.run(load_at_other_ep, ckpt):
        assert error.startswith("CheckpointError") and "saved at tp=1, pp=1, ep=2" in error, error
        assert f"reshard {ckpt} OUT --tp 1 --pp 1 --ep 4" in error, error
    for result in pool.run(save_with_zero1, str(tmp_path / "zero1")):
        assert "ZeRO-1 state over ranks [0, 1, 2, 3]" in result["error"], result
        assert "allowed: experts sharded over the ranks holding the same experts" in result["error"], result
        assert not result["written"]
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------------- lazy loading


@pytest.fixture(scope="module")
def stacked_dirs(tmp_path_factory) -> dict[str, str]:
    """HF checkpoints with the experts stored stacked ([E, ...] tensors, as gpt_oss ships them; transformers saves
    mixtral / qwen3_moe per expert: `per_expert_dirs` below)."""
    out = {}
    for model_type in ("mixtral", "qwen3_moe"):
        path = tmp_path_factory.mktemp("stacked") / model_type
        model = build_model(tiny_config(model_type, **MOE[model_type]), seed=3)
        model.config.save_pretrained(path)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        out[model_type] = str(path)
    return out


def lazy_against_eager(model_type: str, sizes: dict, hf_dir: str) -> dict:
    """The model built on meta and parallelized (reading its slices), and the same checkpoint loaded eagerly and
    parallelized alike: what the lazy one read, and which parameters differ."""
    import optimum_parallel as op
    import optimum_parallel.engine.materialize as lazy

    mesh = op.init_mesh(**sizes)
    reads, original = [], lazy.read_slice

    def recording(reader, key, layout, scratch=None, experts=None):
        value = original(reader, key, layout, scratch, experts)
        reads.append((key, experts, value.numel() * value.element_size()))
        return value

    with op.lazy_load_for_parallelism(tensor_parallel_size=mesh.tp_size, expert_parallel_size=sizes.get("ep", 1)):
        model = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD)
    meta = all(p.device.type == "meta" for p in model.parameters())
    lazy.read_slice = recording
    try:
        model, _ = _parallel(mesh, model_type, 0, model=model, lazy_optimizer=True)
    finally:
        lazy.read_slice = original
    eager, _ = _parallel(mesh, model_type, 0, model=AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD))
    held = dict(eager.named_parameters())
    differ = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), held[n].detach())]
    experts = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n}
    batch = _local_batch(model.config, mesh)
    with torch.no_grad():
        same_loss = model(**batch).loss.item() == eager(**batch).loss.item()
    return {"meta": meta, "reads": reads, "differ": differ, "experts": experts, "same_loss": same_loss}


LAZY = [("mixtral", TP2_EP2), ("qwen3_moe", TP2_EP2), ("mixtral", DP4_EP2)]


@pytest.mark.parametrize("model_type,sizes", LAZY, ids=[_key(*c) for c in LAZY])
def test_lazy_loading_reads_only_the_ranks_experts(pool, stacked_dirs, model_type, sizes):
    hf_dir = stacked_dirs[model_type]
    files = load_file(Path(hf_dir) / "model.safetensors")
    on_disk = {k: v.numel() * v.element_size() for k, v in files.items() if ".experts." in k}
    ep, tp = sizes["ep"], sizes.get("tp", 1)
    blocks = set()
    for rank, result in enumerate(pool.run(lazy_against_eager, model_type, sizes, hf_dir)):
        assert result["meta"] and result["differ"] == [] and result["same_loss"], (rank, result["differ"])
        expert_reads = [r for r in result["reads"] if ".experts." in r[0]]
        assert sorted(k for k, _, _ in expert_reads) == sorted(on_disk), rank  # each expert tensor read once
        for key, experts, size in expert_reads:
            count = files[key].shape[0]
            ep_rank = (rank // tp) % ep  # grid [dp, pp, cp, tp]: dp rank = rank // tp; ep rank = dp rank % ep
            assert experts == (ep_rank * count // ep, (ep_rank + 1) * count // ep), (rank, key, experts)
            assert size == on_disk[key] // (ep * tp) == result["experts"][key], (rank, key, size)
            blocks.add((key, experts, rank % tp))
        assert sum(s for _, _, s in expert_reads) == sum(on_disk.values()) // (ep * tp)
    assert len(blocks) == len(on_disk) * ep * tp  # together the ranks read every expert slice once per replica


@pytest.fixture(scope="module")
def per_expert_dirs(tmp_path_factory) -> dict[str, str]:
    """HF checkpoints as `save_pretrained` writes them: one tensor per expert (mixtral `experts.<e>.w1/w2/w3`,
    qwen3_moe `experts.<e>.gate_proj/up_proj/down_proj`), which transformers stacks at load."""
    out = {}
    for model_type in ("mixtral", "qwen3_moe"):
        path = tmp_path_factory.mktemp("per_expert") / model_type
        build_model(tiny_config(model_type, **MOE[model_type]), seed=3).save_pretrained(path)
        out[model_type] = str(path)
    return out


def lazy_per_expert_against_eager(model_type: str, sizes: dict, hf_dir: str) -> dict:
    """Lazy load of a per-expert checkpoint, parallelized, against an eager load parallelized alike: the bytes read
    per checkpoint key, and which parameters differ."""
    import optimum_parallel as op
    from optimum_parallel.io.safetensors_io import SafetensorsReader

    mesh = op.init_mesh(**sizes)
    reads: dict[str, int] = {}
    originals = {name: getattr(SafetensorsReader, name) for name in ("read", "read_slice", "map_rows")}

    def recording(name):
        def read(self, key, *args, **kwargs):
            value = originals[name](self, key, *args, **kwargs)
            reads[key] = reads.get(key, 0) + value.numel() * value.element_size()
            return value

        return read

    with op.lazy_load_for_parallelism(tensor_parallel_size=mesh.tp_size, expert_parallel_size=sizes.get("ep", 1)):
        model = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD)
    meta = all(p.device.type == "meta" for p in model.parameters())
    for name in originals:
        setattr(SafetensorsReader, name, recording(name))
    try:
        model, _ = _parallel(mesh, model_type, 0, model=model, lazy_optimizer=True)
    finally:
        for name, original in originals.items():
            setattr(SafetensorsReader, name, original)
    eager, _ = _parallel(mesh, model_type, 0, model=AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD))
    held = dict(eager.named_parameters())
    differ = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), held[n].detach())]
    batch = _local_batch(model.config, mesh)
    with torch.no_grad():
        same_loss = model(**batch).loss.item() == eager(**batch).loss.item()
    return {"meta": meta, "reads": reads, "differ": differ, "same_loss": same_loss}


PER_EXPERT = [("mixtral", TP2_EP2), ("qwen3_moe", TP2_EP2), ("mixtral", dict(dp=2, tp=2))]


@pytest.mark.parametrize("model_type,sizes", PER_EXPERT, ids=[_key(*c) for c in PER_EXPERT])
def test_lazy_loading_stacks_per_expert_checkpoints(pool, per_expert_dirs, model_type, sizes):
    """transformers' own save format (one tensor per expert): each rank reads only its experts' tensors, and of each
    its tp slice; the stacked result equals transformers' eager load parallelized alike."""
    hf_dir = per_expert_dirs[model_type]
    files = load_file(Path(hf_dir) / "model.safetensors")
    per_expert = {k: v.numel() * v.element_size() for k, v in files.items() if re.search(r"\.experts\.\d+\.", k)}
    assert per_expert, "save_pretrained no longer writes one tensor per expert"
    count = MOE[model_type]["num_local_experts" if model_type == "mixtral" else "num_experts"]
    ep, tp = sizes.get("ep", 1), sizes["tp"]
    for rank, result in enumerate(pool.run(lazy_per_expert_against_eager, model_type, sizes, hf_dir)):
        assert result["meta"] and result["differ"] == [] and result["same_loss"], (rank, result["differ"])
        ep_rank = (rank // tp) % ep
        block = range(ep_rank * count // ep, (ep_rank + 1) * count // ep)
        mine = {k for k in per_expert if int(re.search(r"experts\.(\d+)\.", k)[1]) in block}
        read = {k: n for k, n in result["reads"].items() if k in per_expert}
        assert read.keys() == mine, (rank, sorted(set(read) ^ mine))
        assert all(n == per_expert[k] // tp for k, n in read.items()), rank
