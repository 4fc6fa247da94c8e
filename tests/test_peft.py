"""LoRA (PEFT) under tensor parallelism, in both orders, against the single-device PEFT model: loss, every LoRA
gradient, the loss after AdamW steps, frozen base weights, and the collectives the adapters add."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from _checks import TOL, count_collectives
from _models import build_model, make_batch, rel_err, tiny_config
from test_pipeline import pipeline_batch

pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]  # column (q: 4 heads, v: 2 kv heads) and row-parallel bases


def lora_config():
    from peft import LoraConfig

    # random A and B (PEFT's default B = 0 would make A's gradient 0 at the first step, testing nothing)
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)


def _peft(model):
    from peft import get_peft_model

    torch.manual_seed(123)  # the adapters' init draws the same numbers on every rank and on one device
    return get_peft_model(model, lora_config())


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def check_lora(order: str, tp: int, sequence_parallel: bool = False, sharding_level: int | None = None) -> dict:
    """Every rank trains on the same batch, so data-parallel replicas average identical gradients."""
    import torch.distributed as dist

    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training
    from optimum_parallel.plan.wrappers import plan_root

    mesh = op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    config = tiny_config("llama", num_key_value_heads=2)  # tp=4 replicates the 2 kv heads (and v's adapter B)
    base = build_model(config)
    reference = _peft(copy.deepcopy(base))
    parallelizer = op.ParallelizersManager.parallelizer_for_model(base)
    if order == "peft_first":
        model = parallelizer.parallelize(_peft(copy.deepcopy(base)), sequence_parallel_enabled=sequence_parallel)
    else:
        model = _peft(parallelizer.parallelize(copy.deepcopy(base), sequence_parallel_enabled=sequence_parallel))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if sharding_level is not None:
        dp_config = op.DataParallelConfig(sharding_level=sharding_level)
        opt = compose_training(plan_root(model), opt, mesh, {}, dp_config)[1]

    batch = make_batch(config)
    ref_loss, loss = reference(**batch).loss, model(**batch).loss
    ref_loss.backward()
    loss.backward()
    expected = dict(reference.named_parameters())
    grads = {}
    for name in trainable:
        param, full = dict(model.named_parameters())[name], expected[name].grad
        layout = getattr(param, "shard_layout", None)
        grads[name] = rel_err(_whole(param.grad), layout.slice(full) if layout is not None else full)

    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    steps = []
    for _ in range(3):
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        ref_loss, loss = reference(**batch).loss, model(**batch).loss
        ref_loss.backward()
        loss.backward()
        steps.append(rel_err(loss, ref_loss))
    return {
        "loss": rel_err(model(**batch).loss, reference(**batch).loss),
        "worst_grad": max(grads.values()),
        "n_lora_grads": len(grads),
        "trainable_are_lora": all(".lora_" in n for n in trainable),
        "base_unchanged": all(torch.equal(_whole(p), frozen[n]) for n, p in model.named_parameters() if n in frozen),
        "steps": max(steps),
    }


@pytest.mark.parametrize(
    "order,tp,sequence_parallel",
    [("peft_first", 2, False), ("parallel_first", 2, False), ("peft_first", 4, False), ("parallel_first", 2, True)],
    ids=["peft-then-tp2", "tp2-then-peft", "peft-then-tp4", "peft-then-tp2-sp"],
)
def test_lora_matches_single_device_peft(pool, order, tp, sequence_parallel):
    _assert_matches(pool.run(check_lora, order, tp, sequence_parallel))


@pytest.mark.parametrize("sharding_level", [0, 1, 2, 3])
def test_lora_composes_with_data_parallel(pool, sharding_level):
    """dp=2 x tp=2: DDP, ZeRO-1, FSDP2 (frozen base and adapters sharded together) keep the single-device numbers."""
    _assert_matches(pool.run(check_lora, "peft_first", 2, sharding_level=sharding_level))


def _assert_matches(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["n_lora_grads"] == 2 * len(TARGETS) * 2, result  # A and B of 3 targets x 2 layers
        assert result["trainable_are_lora"] and result["base_unchanged"], result
        assert max(result["loss"], result["worst_grad"], result["steps"]) <= TOL, f"rank {rank}: {result}"


def test_lora_adds_no_collective(pool):
    """Without SP the adapters ride on the base layers' collectives: the same calls, each a little larger
    ([x | u] at the column entries, [W x | A x] at the row exits). Under SP the replicated adapter matrices get the
    sequence-parallel parameter all-reduce (one per adapter, r x hidden), as trainable norms do; nothing else."""
    plain = pool.run(count_collectives, 1, 2)[0]
    lora = pool.run(count_collectives, 1, 2, lora_targets=tuple(TARGETS))[0]
    assert [(p, c) for p, c, _, _ in lora] == [(p, c) for p, c, _, _ in plain]
    assert sum(n for *_, n, _ in lora) > sum(n for *_, n, _ in plain)

    plain_sp = pool.run(count_collectives, 1, 2, True)[0]
    lora_sp = pool.run(count_collectives, 1, 2, True, lora_targets=tuple(TARGETS))[0]

    def parameter_sized(call) -> bool:  # norm weights (frozen under LoRA) and the adapter matrices
        phase, collective, elements, _ = call
        return phase == "backward" and collective == "all_reduce" and elements <= 4 * 64

    # the frozen embeddings need no input gradient: autograd skips layer 0's entry collectives backward
    activations = Counter((p, c) for p, c, n, a in lora_sp if not parameter_sized((p, c, n, a)))
    baseline = Counter((p, c) for p, c, n, a in plain_sp if not parameter_sized((p, c, n, a)))
    assert activations <= baseline and activations[("forward", "all_gather")] == baseline[("forward", "all_gather")]
    assert [n for call in lora_sp if parameter_sized(call) for n in [call[2]]] == [4 * 64] * len(TARGETS)


def export_adapter_and_merge(order: str, adapter_dir: str, merged_dir: str) -> None:
    import torch.distributed as dist

    import optimum_parallel as op
    from optimum_parallel.checkpoint import save_model_checkpoint

    op.init_mesh(dp=dist.get_world_size() // 2, tp=2)
    base = build_model(tiny_config("llama", num_key_value_heads=2))
    parallelizer = op.ParallelizersManager.parallelizer_for_model(base)
    if order == "peft_first":
        model = parallelizer.parallelize(_peft(base))
    else:
        model = _peft(parallelizer.parallelize(base))
    model.save_pretrained(adapter_dir)  # every rank: the shards are gathered over tp
    merged = model.merge_and_unload()
    save_model_checkpoint(merged, merged_dir, as_regular=True, as_sharded=False)


@pytest.mark.parametrize("order", ["peft_first", "parallel_first"])
def test_adapter_saves_as_a_standard_peft_adapter_and_merges_like_one_device(pool, tmp_path, order):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    pool.run(export_adapter_and_merge, order, str(tmp_path / "adapter"), str(tmp_path / "merged"))
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = tiny_config("llama", num_key_value_heads=2)
    reference = _peft(build_model(config))
    expected = {n: p for n, p in reference.named_parameters() if ".lora_" in n}
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {n.replace(".weight", ".default.weight") for n in saved} == set(expected)
    loaded = PeftModel.from_pretrained(build_model(config), tmp_path / "adapter")
    for name, param in loaded.named_parameters():
        if ".lora_" in name:
            assert torch.equal(param, expected[name]), name
    batch = make_batch(config)
    assert rel_err(loaded(**batch).logits, reference(**batch).logits) == 0

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    reference_merged = dict(reference.merge_and_unload().named_parameters())
    for name, param in merged.named_parameters():
        assert rel_err(param, reference_merged[name]) <= TOL, name


def load_adapter_onto_parallel(adapter_dir: str, tp: int) -> dict:
    """A standard adapter (whole tensors, saved on one device) onto a tp model: `PeftModel.from_pretrained`, then a
    second copy through `load_adapter` (a further adapter on the split layers) and both active at once."""
    import torch.distributed as dist
    from peft import PeftModel

    import optimum_parallel as op

    op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    config = tiny_config("llama", num_key_value_heads=2)
    batch = make_batch(config)
    reference = PeftModel.from_pretrained(build_model(config), adapter_dir)
    base = build_model(config)
    parallel = op.ParallelizersManager.parallelizer_for_model(base).parallelize(base)
    model = PeftModel.from_pretrained(parallel, adapter_dir)
    with torch.no_grad():  # inference: whole-vocabulary logits
        errors = {"from_pretrained": rel_err(model(**batch).logits, reference(**batch).logits)}
        for m in (reference, model):
            m.load_adapter(adapter_dir, adapter_name="second")
            m.base_model.set_adapter(["default", "second"])
        errors["two_adapters"] = rel_err(model(**batch).logits, reference(**batch).logits)
    return errors


@pytest.mark.parametrize("tp", [2, 4])
def test_standard_adapter_loads_onto_a_parallel_model(pool, tmp_path, tp):
    reference = _peft(build_model(tiny_config("llama", num_key_value_heads=2)))
    reference.save_pretrained(tmp_path / "adapter")
    for result in pool.run(load_adapter_onto_parallel, str(tmp_path / "adapter"), tp):
        assert result["from_pretrained"] <= TOL and result["two_adapters"] <= TOL, result


def unsupported_methods() -> list[str]:
    from peft import IA3Config, LoraConfig, get_peft_model

    import optimum_parallel as op

    op.init_mesh(tp=2, dp=2)
    messages = []
    for config in (
        IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
        LoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
        LoraConfig(r=4, target_modules=["lm_head"]),
    ):
        model = get_peft_model(build_model(tiny_config("llama")), config)
        try:
            op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
        except NotImplementedError as err:
            messages.append(str(err))
        else:
            messages.append("no error")
    return messages


def test_unsupported_peft_methods_are_named(pool):
    ia3, dora, head = pool.run(unsupported_methods)[0]
    assert "peft.tuners.ia3" in ia3 and "supported: LoRA" in ia3, ia3
    assert "DoRA" in dora or "Dora" in dora, dora
    assert "LM head" in head, head


def test_lora_example_runs_under_torchrun(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "lora_llama.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(example)]
    command += ["--output_dir", str(tmp_path / "out"), "--steps", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "step 2: loss" in result.stdout and (tmp_path / "out" / "adapter_model.safetensors").exists()


def check_lora_pipeline() -> dict:
    import optimum_parallel as op

    op.init_mesh(pp=2, tp=2)
    config = tiny_config("llama", num_key_value_heads=2, num_hidden_layers=4)
    base = build_model(config)
    reference = _peft(copy.deepcopy(base))
    model = _peft(copy.deepcopy(base))
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(
        model, pipeline_parallel_num_microbatches=2
    )
    batch = pipeline_batch(config)  # every micro-batch the same number of labelled tokens
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    loss = model.run_train(**batch)
    expected = dict(reference.named_parameters())
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            layout = getattr(param, "shard_layout", None)
            full = expected[name].grad
            grads[name] = rel_err(param.grad, layout.slice(full) if layout is not None else full)
    return {"loss": rel_err(loss, ref_loss), "worst_grad": max(grads.values()), "n": len(grads)}


def test_lora_under_pipeline_and_tensor_parallelism(pool):
    """pp=2 x tp=2: each stage trains the adapters of its own layers."""
    for rank, result in enumerate(pool.run(check_lora_pipeline)):
        assert result["n"] == 2 * len(TARGETS) * 2, result  # A and B of 3 targets x the stage's 2 layers
        assert max(result["loss"], result["worst_grad"]) <= TOL, f"rank {rank}: {result}"


def check_lazy_base_then_lora(path: str) -> dict:
    """The frozen base loaded lazily (each rank reads only its slices), then the adapters on the parallel model."""
    from transformers import AutoModelForCausalLM

    import optimum_parallel as op
    import optimum_parallel.engine.materialize as materialize

    op.init_mesh(tp=2, dp=2)
    load = {"dtype": torch.float32, "attn_implementation": "eager"}
    reference = _peft(AutoModelForCausalLM.from_pretrained(path, **load))
    with op.lazy_load_for_parallelism(tensor_parallel_size=2):
        model = AutoModelForCausalLM.from_pretrained(path, **load)
    read, original = [], materialize.read_slice
    materialize.read_slice = lambda *args: read.append(original(*args)) or read[-1]
    try:
        model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    finally:
        materialize.read_slice = original
    base_elements = sum(p.numel() for p in model.parameters())
    model = _peft(model)
    batch = make_batch(model.config)
    loss, ref_loss = model(**batch).loss, reference(**batch).loss
    with op.lazy_load_for_parallelism(tensor_parallel_size=2):
        meta = _peft(AutoModelForCausalLM.from_pretrained(path, **load))
    try:
        op.ParallelizersManager.parallelizer_for_model(meta).parallelize(meta)
        refused = "no error"
    except NotImplementedError as err:
        refused = str(err)
    return {
        "read": sum(t.numel() for t in read),
        "local": base_elements,
        "loss": rel_err(loss, ref_loss),
        "refused": refused,
    }


def test_lazily_loaded_base_reads_only_its_slices(pool, tmp_path):
    build_model(tiny_config("llama", num_key_value_heads=2)).save_pretrained(tmp_path / "base")
    for result in pool.run(check_lazy_base_then_lora, str(tmp_path / "base")):
        assert result["read"] == result["local"] and result["loss"] <= TOL, result
        assert "call get_peft_model on the parallel model" in result["refused"], result


def train_lora_trainer(hf_dir: str, output_dir: str, tp: int, resume: str | None = None) -> dict:
    """ParallelTrainer with a peft_config over a lazily loaded base; the global batch is 4 blocks at any tp."""
    import os

    from peft import LoraConfig
    from test_trainer import common_args, curve, datasets

    from optimum_parallel import ParallelTrainer, ParallelTrainingArguments

    per_device = 4 * tp // int(os.environ["WORLD_SIZE"])
    args = ParallelTrainingArguments(
        **{**common_args(output_dir, per_device), "tensor_parallel_size": tp, "eval_strategy": "no"}
    )
    train, _ = datasets()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(123)
    trainer = ParallelTrainer(hf_dir, args, peft_config=lora, train_dataset=train)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    return curve(trainer.state.log_history)


def test_trainer_trains_saves_and_resumes_adapters_at_another_tp(pool, tmp_path):
    """ParallelTrainer with a peft_config over a lazily loaded base at tp=2 (dp=2): its checkpoints hold the adapters
    and their AdamW state only, save_model() writes a PEFT adapter, and resuming at tp=4 (dp=1) from the step-3
    checkpoint gives the uninterrupted run's losses."""
    import json

    from test_trainer import SAVE_AT

    hf_dir = tmp_path / "base"
    build_model(tiny_config("llama", num_key_value_heads=2), seed=3).save_pretrained(hf_dir)
    full = pool.run(train_lora_trainer, str(hf_dir), str(tmp_path / "tp2"), 2)[0]
    checkpoint = tmp_path / "tp2" / f"checkpoint-{SAVE_AT}"
    index = json.loads((checkpoint / "parallel_checkpoint.json").read_text())
    assert index["tensors"] and all(".lora_" in name for name in index["tensors"]), list(index["tensors"])[:4]
    assert index["optimizer_tensors"] and index["extra"]["trainable_only"]
    assert (tmp_path / "tp2" / "adapter_model.safetensors").exists()
    resumed = pool.run(train_lora_trainer, str(hf_dir), str(tmp_path / "tp4"), 4, str(checkpoint))[0]
    later = [step for step in full if step > SAVE_AT and "loss" in full[step]]
    assert later and all(abs(resumed[s]["loss"] - full[s]["loss"]) <= 1e-4 for s in later), (full, resumed)
