"""The accelerator lane: every parallelism on a device that is neither the CPU nor CUDA (the simulated `neuron`,
simulated_neuron.py; `OP_TEST_DEVICE=cuda` runs the same cases on a GPU), each against one CPU process on the whole
batch (loss, every gradient, 3 AdamW steps; padding and -100 labels). Every case also asserts that every parameter
and the loss live on the device, that each process group of the mesh runs the backend registered for the device,
and that collectives really ran through it (the device's counter moved).

Two ranks for the parallel cases (tp=2 + sp with lazy loading, dp=2 at levels 0, 1 and 3, pp=2, cp=2, ep=2, a
checkpoint round trip, ParallelTrainer, generate); one rank for lazy loading, a checkpoint round trip and generate
on the device's own backend at world size 1 (NCCL on CUDA).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _accel import DEVICE, SIMULATED, Collectives, Workers, install, registered_backend
from _models import build_model, make_batch, rel_err, tiny_config, whole_logits

install()  # this process too: the device module's answers are checked here
# gloo hands send/recv the tensors' memory for its TCP transport as is: point-to-point (pp stages, the cp ring) cannot
# move device tensors over it; two ranks sharing one GPU (NCCL refuses them) run the other cases only
needs_device_p2p = pytest.mark.skipif(
    not SIMULATED and DEVICE != "cpu" and registered_backend() == "gloo",
    reason=f"gloo's send/recv cannot move {DEVICE} tensors: pp and cp need the device's backend, one device a rank",
)

TOL = 1e-5  # fp32, relative (DESIGN.md)
LR = 1e-2
STEPS = 3
LOAD = dict(dtype=torch.float32, attn_implementation="eager")
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)


@pytest.fixture(scope="module")
def pair():
    workers = Workers(2)
    yield workers
    workers.close()


@pytest.fixture(scope="module")
def single():
    workers = Workers(1)
    yield workers
    workers.close()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hf") / "llama"
    build_model(tiny_config("llama"), seed=3).save_pretrained(path)
    return str(path)


# ---- run on every rank ----------------------------------------------------------------------------------------
def _on_device(batch: dict) -> dict:
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch.items()}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _expected(param, full: torch.Tensor) -> torch.Tensor:
    """The part of a single-device tensor that `param` holds (its experts, then its tp shard)."""
    from optimum_parallel.expert_parallel import expert_layout

    for layout in (expert_layout(param), getattr(param, "shard_layout", None)):
        if layout is not None:
            full = layout.slice(full)
    return full


def _label_count(batch: dict) -> int:
    """The tokens the causal-LM loss averages over: labels shifted by one, -100 ignored."""
    return int((batch["labels"][:, 1:] != -100).sum())


def _plain_step(model, batch: dict) -> torch.Tensor:
    loss = model(**batch).loss
    loss.backward()
    return loss


def _where(model, mesh, loss: torch.Tensor) -> dict:
    """Where the run happened: parameter and loss devices, and the backend of every group of the mesh."""
    params = [_local(p) for p in model.parameters()]
    groups = {dim: mesh.group(dim) for dim in ("dp", "pp", "cp", "tp") if mesh.size(dim) > 1}
    if mesh.size("ep") > 1:
        groups["ep"] = mesh.group("ep")
    return {
        "mesh_device": mesh.device_type,
        "param_devices": sorted({p.device.type for p in params}),
        "n_params": len(params),
        "loss_device": loss.device.type,
        "backends": {dim: dist.get_backend(group) for dim, group in groups.items()},
        "registered": registered_backend(),
    }


def compare_training(
    reference, model, optimizer, mesh, ref_batch: dict, batch: dict, *, step=_plain_step, combine=None
) -> dict:
    """The loss and every gradient of one step, then the loss after each of STEPS AdamW steps, against the reference
    on the whole batch (on the CPU); `batch` is this rank's (moved to the device here), `combine` turns this rank's
    loss into the whole batch's (e.g. the mean over dp)."""
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    batch = _on_device(batch)
    combine = combine or (lambda loss: loss)
    with Collectives() as counted:
        ref_loss = _plain_step(reference, ref_batch)
        loss = step(model, batch)
        where = _where(model, mesh, loss)
        errors = {"loss": rel_err(combine(loss.detach()).cpu(), ref_loss)}
        expected = dict(reference.named_parameters())
        grads = {n: rel_err(_whole(p.grad).cpu(), _expected(p, expected[n].grad)) for n, p in model.named_parameters()}
        losses = []
        for _ in range(STEPS):
            for opt in (ref_optimizer, optimizer):
                opt.step()
                opt.zero_grad()
            ref_loss = _plain_step(reference, ref_batch)
            losses.append(rel_err(combine(step(model, batch).detach()).cpu(), ref_loss))
    worst = max(grads, key=grads.get)
    return {
        **errors,
        "grad": grads[worst],
        "worst_grad": worst,
        "n_grads": len(grads),
        "steps": max(losses),
        "collectives": counted.count,
        **where,
    }


def _replica_mean(mesh):
    def combine(loss):
        total = loss.clone()
        dist.all_reduce(total, group=mesh.data_parallel_group)
        return total / mesh.data_parallel_size

    return combine


def _replica_rows(batch: dict, replicas: int, replica: int) -> dict:
    """This replica's rows of `batch`, its loss normalised by the whole batch's label count: the mean of the
    replicas' losses is then the whole batch's token mean, whatever each replica's own count."""
    rows = batch["input_ids"].shape[0] // replicas
    local = {k: v[rows * replica : rows * (replica + 1)] for k, v in batch.items()}
    local["num_items_in_batch"] = torch.tensor(_label_count(batch) / replicas)
    return local


def check_tp_lazy(hf_dir: str, tp: int, sequence_parallel: bool) -> dict:
    """tp (+ sp) through the Parallelizer, the model loaded lazily and each rank's slices read onto the device."""
    from transformers import AutoModelForCausalLM

    import optimum_parallel as op

    mesh = op.init_mesh(tp=tp)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD).eval()
    with op.lazy_load_for_parallelism(tensor_parallel_size=tp):
        model = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD).eval()
    lazy = all(p.device.type == "meta" for p in model.parameters())
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, device=DEVICE, sequence_parallel_enabled=sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    batch = make_batch(model.config)
    return {"lazy": lazy, **compare_training(reference, model, optimizer, mesh, batch, batch)}


def check_data_parallel(level: int) -> dict:
    """dp=2 at `level` through `op.parallelize` on a model the user moved to the device."""
    import optimum_parallel as op

    mesh = op.init_mesh(dp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    model = copy.deepcopy(reference).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})
    batch = make_batch(config, batch=4)
    local = _replica_rows(batch, 2, mesh.data_parallel_rank)
    result = compare_training(reference, model, optimizer, mesh, batch, local, combine=_replica_mean(mesh))
    return {**result, "fsdp": type(model).__name__.startswith("FSDP")}


def check_pipeline() -> dict:
    """pp=2 (one decoder layer per stage, 2 micro-batches holding different label counts)."""
    import optimum_parallel as op

    mesh = op.init_mesh(pp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    model = copy.deepcopy(reference)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, device=DEVICE, pipeline_parallel_num_microbatches=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    batch = make_batch(config, batch=4)
    batch["labels"][2, :9] = -100  # micro-batch 2 holds fewer labelled tokens

    def step(m, b):
        return m.run_train(**b)

    return compare_training(reference, model, optimizer, mesh, batch, batch, step=step)


def check_context_parallel() -> dict:
    """cp=2 ring attention: each rank a balanced share of a padded 30-token sequence, gradients averaged over cp."""
    import optimum_parallel as op

    mesh = op.init_mesh(cp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    model = copy.deepcopy(reference)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, device=DEVICE, context_parallel_strategy="ring")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    batch = make_batch(config, seq=30)
    batch["labels"][0, :4] = -100  # the first real token after left padding has no real context (see test_cp)
    return compare_training(reference, model, optimizer, mesh, batch, batch)


def check_expert_parallel() -> dict:
    """ep=2 on mixtral (dp=2): each rank holds 2 of the 4 experts, tokens dispatched by all-to-all."""
    import optimum_parallel as op

    mesh = op.init_mesh(dp=2, ep=2)
    config = tiny_config("mixtral", **MIXTRAL)
    reference = build_model(config)
    model = copy.deepcopy(reference).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    batch = make_batch(config, batch=4)
    local = _replica_rows(batch, 2, mesh.data_parallel_rank)
    result = compare_training(reference, model, optimizer, mesh, batch, local, combine=_replica_mean(mesh))
    from optimum_parallel.expert_parallel import find_experts

    local_experts = [m.gate_up_proj.shape[0] for _, m in find_experts(model)]
    return {**result, "local_experts": local_experts}


def _host_state(model, optimizer) -> dict:
    """This rank's parameters and optimizer state, copied to the host (with each parameter's layout, and the device
    each state tensor lives on: AdamW keeps its step count on the CPU)."""
    params = {n: (p.detach().cpu().clone(), getattr(p, "shard_layout", None)) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    state = {
        names[id(p)]: {k: (v.detach().cpu().clone(), v.device.type) for k, v in s.items() if torch.is_tensor(v)}
        for p, s in optimizer.state.items()
    }
    return {"params": params, "optim": state}


def check_checkpoint(ckpt: str, tp: int) -> dict:
    """A tied model and its optimizer made on the host, parallelized onto the device (`device=`, the optimizer
    through `optimizer_for_mp`); train a step, save a sharded checkpoint (with the optimizer) from the device
    tensors, load it into a model with other weights on the device: every tensor must come back bit-identical."""
    import optimum_parallel as op

    mesh = op.init_mesh(tp=tp)
    config = tiny_config("llama", tie_word_embeddings=True)

    def parallel(seed: int):
        model = build_model(config, seed=seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model, device=DEVICE)
        return parallelizer, model, parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)

    parallelizer, model, optimizer = parallel(3)
    batch = _on_device(make_batch(config))
    with Collectives() as counted:
        loss = _plain_step(model, batch)
        optimizer.step()
        optimizer.zero_grad()
        parallelizer.save_model_checkpoint(model, ckpt, optimizer=optimizer)
        saved = _host_state(model, optimizer)
        _, loaded, loaded_optimizer = parallel(5)
        _plain_step(loaded, batch)  # the optimizer state exists before the load, as in a resumed run
        loaded_optimizer.zero_grad()
        parallelizer.load_model_checkpoint(loaded, ckpt, optimizer=loaded_optimizer)
        back = _host_state(loaded, loaded_optimizer)
        next_losses = [_plain_step(m, batch).item() for m in (model, loaded)]
    where = _where(loaded, mesh, loss)
    live = {id(p) for p in model.parameters()}
    same_params = all(torch.equal(back["params"][n][0], t) for n, (t, _) in saved["params"].items())
    same_state = saved["optim"].keys() == back["optim"].keys() and all(
        s.keys() == back["optim"][n].keys()
        and all(torch.equal(v, back["optim"][n][k][0]) and at == back["optim"][n][k][1] for k, (v, at) in s.items())
        for n, s in saved["optim"].items()
    )
    moments = {where for s in back["optim"].values() for k, (_, where) in s.items() if k != "step"}
    return {
        **where,
        "collectives": counted.count,
        "tied": all(m.lm_head.weight is m.model.embed_tokens.weight for m in (model, loaded)),
        "optimizer_on_model": all(id(p) in live for g in optimizer.param_groups for p in g["params"]),
        "same_params": same_params,
        "same_state": same_state,
        "loaded_devices": sorted({p.device.type for p in loaded.parameters()}),
        "moment_devices": sorted(moments),
        "next_losses": next_losses,
        "saved": saved["params"],
    }


def check_generate(tp: int) -> dict:
    """Greedy decoding with the KV cache on a left-padded batch: the single-device tokens, and full logits."""
    import optimum_parallel as op

    mesh = op.init_mesh(tp=tp)
    config = tiny_config("llama")
    reference = build_model(config)
    model = copy.deepcopy(reference)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model, device=DEVICE)
    batch = make_batch(config, seq=12)
    batch["input_ids"] = batch["input_ids"].clamp_min(3)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with Collectives() as counted, torch.no_grad():
        out = model(**_on_device(batch))
        got = model.generate(**_on_device(inputs), **options)
    want = reference.generate(**inputs, **options)
    with torch.no_grad():
        ref_out = reference(**batch)
    return {
        **_where(model, mesh, out.loss),
        "collectives": counted.count,
        "logits": rel_err(whole_logits(model, out.logits).cpu(), ref_out.logits),
        "loss": rel_err(out.loss.cpu(), ref_out.loss),
        "tokens_device": got.device.type,
        "tokens": (got.cpu().tolist(), want.tolist()),
    }


def trainer_rows(n: int = 12, seq: int = 16) -> list[dict]:
    """Rows with left padding of 0-3 tokens and -100 labels at different places: batches hold different label counts."""
    ids = torch.randint(3, 128, (n, seq), generator=torch.Generator().manual_seed(5))
    rows = []
    for i, row in enumerate(ids):
        mask = torch.ones(seq, dtype=torch.long)
        mask[: i % 4] = 0
        labels = row.clone()
        labels[: i % 4 + 1] = -100
        labels[8 + i % 3] = -100
        rows.append({"input_ids": row, "attention_mask": mask, "labels": labels})
    return rows


def trainer_args(output_dir: str) -> dict:
    """fp32, one seed, STEPS steps of 4 rows, warmup and linear decay, gradient clipping (the Trainer's default)."""
    return dict(
        output_dir=output_dir, per_device_train_batch_size=4, learning_rate=5e-3, weight_decay=0.1, warmup_steps=1,
        max_steps=STEPS, logging_steps=1, seed=0, save_strategy="no", report_to="none", disable_tqdm=True,
        ddp_timeout=60,
    )  # fmt: skip


def log_curve(history: list[dict]) -> dict[int, dict]:
    return {e["step"]: {k: e[k] for k in ("loss", "grad_norm")} for e in history if "loss" in e}


def check_trainer(hf_dir: str, output_dir: str) -> dict:
    """ParallelTrainer at tp=2 (fp32) on the device: the model path loaded lazily, its slices read onto the device."""
    from optimum_parallel.integrations.transformers.trainer import ParallelTrainer
    from optimum_parallel.integrations.transformers.training_args import ParallelTrainingArguments

    args = ParallelTrainingArguments(**trainer_args(output_dir), tensor_parallel_size=2)
    trainer = ParallelTrainer(hf_dir, args, model_kwargs=LOAD, train_dataset=trainer_rows())
    with Collectives() as counted:
        trainer.train()
    loss = trainer.model(**_on_device(make_batch(trainer.model.config))).loss
    return {
        **_where(trainer.model, trainer.mesh, loss),
        "collectives": counted.count,
        "args_device": args.device.type,
        "curve": log_curve(trainer.state.log_history),
    }


# ---- assertions -----------------------------------------------------------------------------------------------
def assert_on_device(results: list[dict]) -> None:
    """Every rank computed on the device, over groups of its registered backend, and (with more than one rank)
    ran collectives through it."""
    for rank, r in enumerate(results):
        assert r["mesh_device"] == DEVICE, f"rank {rank}: init_mesh picked {r['mesh_device']}, not {DEVICE}"
        assert r["param_devices"] == [DEVICE] and r["n_params"] > 0, f"rank {rank}: parameters on {r['param_devices']}"
        assert r["loss_device"] == DEVICE, f"rank {rank}: the loss is on {r['loss_device']}"
        assert all(b == r["registered"] for b in r["backends"].values()), f"rank {rank}: groups on {r['backends']}"
        if len(results) > 1:
            assert r["collectives"] > 0, f"rank {rank}: no collective ran on the {DEVICE} backend"


def assert_matches(results: list[dict], n_params: int | None = None) -> None:
    assert_on_device(results)
    for rank, r in enumerate(results):
        if n_params is not None:
            assert r["n_grads"] == n_params, f"rank {rank}: {r['n_grads']} gradients, the model has {n_params}"
        for key in ("loss", "grad", "steps"):
            assert r[key] <= TOL, f"rank {rank}: {key} relative error {r[key]:.2e} ({r})"


def _n_params(model_type: str = "llama", **overrides) -> int:
    return len(dict(build_model(tiny_config(model_type, **overrides)).named_parameters()))


# ---- the cases ------------------------------------------------------------------------------------------------
def test_device_module_answers_for_the_device():
    """mesh/device.py's answers for the device, each against what torch itself does."""
    import simulated_neuron

    from optimum_parallel.mesh import device as devices

    assert devices.resolve_device_type() == DEVICE and devices.backend_for(DEVICE) == registered_backend()
    model = build_model(tiny_config("llama", tie_word_embeddings=True))
    before = [id(p) for p in model.parameters()]
    model.to(DEVICE)  # torch keeps the Parameter objects only where it shallow-copies across the two kinds
    assert devices.module_to_keeps_parameters(DEVICE) == ([id(p) for p in model.parameters()] == before)
    assert devices.module_to_keeps_parameters("cpu") and not devices.module_to_keeps_parameters("xla")
    if torch.accelerator.current_accelerator() is not None:  # without one nothing is pinned, nor needs to be
        try:
            pinned = torch.arange(3.0).pin_memory().is_pinned()
        except (RuntimeError, NotImplementedError):
            pinned = False
        assert devices.lacks_pinned_memory() == (not pinned)
    if SIMULATED:  # PrivateUse1: new Parameters on Module.to; pinned memory only with the C++ hooks
        assert not devices.module_to_keeps_parameters(DEVICE)
        assert devices.lacks_pinned_memory() == (not simulated_neuron.hooks_built())


# ---- the parallel cases ---------------------------------------------------------------------------------------------
def test_tp2_sequence_parallel_lazy_loading(pair, hf_dir):
    results = pair.run(check_tp_lazy, hf_dir, 2, True)
    assert all(r["lazy"] for r in results), "from_pretrained under lazy_load_for_parallelism built real weights"
    assert_matches(results, _n_params())
    assert all(r["backends"].keys() == {"tp"} for r in results)


@pytest.mark.parametrize("level", [0, 1, 3])
def test_dp2_sharding_level(pair, level):
    results = pair.run(check_data_parallel, level)
    assert_matches(results, _n_params())
    assert all(r["backends"].keys() == {"dp"} for r in results)


@needs_device_p2p
def test_pp2(pair):
    results = pair.run(check_pipeline)
    assert_matches(results)
    assert sum(r["n_grads"] for r in results) == _n_params(), "the two stages hold every parameter between them"


@needs_device_p2p
def test_cp2_ring(pair):
    assert_matches(pair.run(check_context_parallel), _n_params())


def test_ep2_mixtral(pair):
    results = pair.run(check_expert_parallel)
    assert_matches(results, _n_params("mixtral", **MIXTRAL))
    assert all(r["local_experts"] == [2, 2] for r in results), [r["local_experts"] for r in results]


def _assemble(shards: list[dict]) -> dict[str, torch.Tensor]:
    """The whole parameters from every rank's (tensor, layout) pieces."""
    whole = {}
    for name, (tensor, layout) in shards[0].items():
        if layout is None or layout.dim is None:
            whole[name] = tensor
            continue
        full = torch.empty(layout.global_shape, dtype=tensor.dtype)
        for held in shards:
            piece, piece_layout = held[name]
            offset = 0
            for start, end in piece_layout.ranges:
                full.narrow(layout.dim, start, end - start).copy_(piece.narrow(layout.dim, offset, end - start))
                offset += end - start
        whole[name] = full
    return whole


def _check_round_trip(results: list[dict], ckpt: str, out: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import optimum_parallel as op

    assert_on_device(results)
    for rank, r in enumerate(results):
        assert r["tied"], f"rank {rank}: moving the model to {DEVICE} untied lm_head from embed_tokens"
        assert r["optimizer_on_model"], f"rank {rank}: optimizer_for_mp's optimizer holds tensors the model lost"
        assert r["same_params"] and r["same_state"], f"rank {rank}: the loaded checkpoint differs from the saved one"
        assert r["loaded_devices"] == [DEVICE] and r["moment_devices"] == [DEVICE], (rank, r)
        assert r["next_losses"][0] == r["next_losses"][1], f"rank {rank}: {r['next_losses']}"
    whole = _assemble([r["saved"] for r in results])
    consolidated = op.consolidate_checkpoint(ckpt, out, progress=False)
    tensors = {k: v for f in consolidated.glob("*.safetensors") for k, v in load_file(f).items()}
    assert tensors.keys() == whole.keys()
    for name, full in whole.items():
        assert torch.equal(tensors[name], full), f"{name}: consolidated differs from the trained device weights"
    model = AutoModelForCausalLM.from_pretrained(consolidated, **LOAD)
    assert all(torch.equal(p, whole[n]) for n, p in model.named_parameters())
    assert json.loads((consolidated / "config.json").read_text())["model_type"] == "llama"


def test_checkpoint_saved_from_the_device(pair, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _check_round_trip(pair.run(check_checkpoint, ckpt, 2), ckpt, tmp_path / "consolidated")


def test_generate_tp2(pair):
    results = pair.run(check_generate, 2)
    assert_on_device(results)
    for rank, r in enumerate(results):
        assert r["logits"] <= TOL and r["loss"] <= TOL, (rank, r)
        assert r["tokens_device"] == DEVICE
        got, want = r["tokens"]
        assert got == want, f"rank {rank}: generated {got}, the single-device model {want}"


def test_parallel_trainer_tp2(pair, hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    args = TrainingArguments(**trainer_args(str(tmp_path / "reference")), use_cpu=True)
    reference = Trainer(AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD), args, train_dataset=trainer_rows())
    reference.train()
    expected = log_curve(reference.state.log_history)
    assert sorted(expected) == list(range(1, STEPS + 1)), expected
    results = pair.run(check_trainer, hf_dir, str(tmp_path / "parallel"))
    assert_on_device(results)
    for rank, r in enumerate(results):
        assert r["args_device"] == DEVICE, f"rank {rank}: the Trainer's device is {r['args_device']}"
        assert sorted(r["curve"]) == sorted(expected), (rank, r["curve"])
        for step, want in expected.items():
            for key, value in want.items():
                err = abs(r["curve"][step][key] - value) / abs(value)
                assert err <= TOL, f"rank {rank} step {step}: {key} {r['curve'][step][key]} vs {value} ({err:.1e})"


# ---- one rank: the device's own backend at world size 1 (NCCL on CUDA) ----------------------------------------
def test_world_size_one_training(single, hf_dir):
    assert_matches(single.run(check_tp_lazy, hf_dir, 1, False), _n_params())


def test_world_size_one_checkpoint(single, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _check_round_trip(single.run(check_checkpoint, ckpt, 1), ckpt, tmp_path / "consolidated")
