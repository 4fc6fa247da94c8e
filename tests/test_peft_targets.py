"""LoRA with every target form PEFT accepts ("all-linear", a regex string, a list, `layers_to_transform`) at tp=2, in
both orders (`get_peft_model` before and after `parallelize`) and through `ParallelTrainer(peft_config=...)`: the
adapted modules are those PEFT picks on the single-device model, and the loss and every LoRA gradient equal
single-device PEFT's within the fp32 noise floor (what a relative 1e-7 perturbation of the weights moves them by).
Also on Qwen3.5's hybrid: the gated delta net's projections (packed q|k|v, z/b/a, out_proj) take adapters too."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import build_model, make_batch, rel_err, tiny_config

pytest.importorskip("peft")

WORLD_SIZE = 2
HYBRID = dict(  # tests/_grpo.py's tiny Qwen3.5: a gated delta net layer, then an attention layer
    intermediate_size=96, head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
)  # fmt: skip
TARGETS = {
    "all-linear": dict(target_modules="all-linear"),
    "regex": dict(target_modules=r".*\.(q_proj|o_proj|up_proj)"),
    "list-layer1": dict(target_modules=["k_proj", "gate_proj", "down_proj"], layers_to_transform=[1]),
    "delta-net-out": dict(target_modules=["out_proj"]),
}
NOISE_FACTOR = 10  # a parallel error up to 10x what a 1e-7 relative perturbation of the weights causes is fp32 noise


def lora_config(form: str):
    from peft import LoraConfig

    # random A and B: PEFT's default B = 0 would make A's gradient 0, testing nothing
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **TARGETS[form])


def _peft(model, form: str):
    from peft import get_peft_model

    torch.manual_seed(123)  # the adapters draw the same numbers on every rank and on one device
    return get_peft_model(model, lora_config(form))


def _config(model_type: str):
    return tiny_config(model_type, **(HYBRID if model_type == "qwen3_5_text" else {}))


def adapted(model) -> list[str]:
    """The names of the modules carrying a LoRA adapter."""
    return sorted(n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A"))


def _perturbed(model, seed: int = 7):
    """`model` with every parameter moved by a relative 1e-7 (the fp32 noise floor's yardstick)."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 1e-7 * torch.randn(param.shape, generator=gen))
    return model


def _step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and the LoRA gradients (this rank's shards; names as on one device) of one forward and backward."""
    from torch.distributed.tensor import DTensor

    loss = model(**batch).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            grads[name.removeprefix("module.")] = grad
    return loss, grads


def _compare(model, reference, batch) -> dict:
    """The parallel model's errors against one device and, measured on the same shards, those of the single-device
    model with its weights perturbed by a relative 1e-7 (the floor); and the adapted modules."""
    layouts = {n.removeprefix("module."): getattr(p, "shard_layout", None) for n, p in model.named_parameters()}
    loss, grads = _step(model, batch)
    ref_loss, expected = _step(reference, batch)
    floor_loss, perturbed = _step(_perturbed(reference), batch)

    def shard(name: str, grad: torch.Tensor) -> torch.Tensor:
        return layouts[name].slice(grad) if layouts.get(name) is not None else grad

    expected = {n: shard(n, g) for n, g in expected.items()}
    return {
        "loss": rel_err(loss, ref_loss),
        "floor_loss": rel_err(floor_loss, ref_loss),
        "grads": {n: rel_err(g, expected[n]) for n, g in grads.items()},
        "floor_grads": {n: rel_err(shard(n, perturbed[n]), expected[n]) for n in grads},
        "adapted": adapted(model),
        "expected": adapted(reference),
    }


def check_order(model_type: str, form: str, order: str) -> dict:
    import optimum_parallel as op

    op.init_mesh(tp=2)
    config = _config(model_type)
    base = build_model(config)
    reference = _peft(copy.deepcopy(base), form)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(base)
    if order == "peft_first":
        model = parallelizer.parallelize(_peft(copy.deepcopy(base), form))
    else:
        model = _peft(parallelizer.parallelize(copy.deepcopy(base)), form)
    return _compare(model, reference, make_batch(config))


def _assert_equal(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["adapted"] == result["expected"] and result["adapted"], (rank, result)
        grads, floor = result["grads"], result["floor_grads"]
        assert len(grads) == 2 * len(result["expected"]), (rank, sorted(grads))  # A and B of every adapted module
        assert result["loss"] <= NOISE_FACTOR * max(result["floor_loss"], 1e-7), (rank, result)
        for name, err in grads.items():
            assert err <= NOISE_FACTOR * max(floor[name], 1e-7), (
                f"rank {rank} {name}: {err:.2e} (floor {floor[name]:.2e})"
            )


CASES = [
    ("llama", "all-linear"),
    ("llama", "regex"),
    ("llama", "list-layer1"),
    ("qwen3_5_text", "all-linear"),
    ("qwen3_5_text", "delta-net-out"),
]


@pytest.mark.parametrize("order", ["peft_first", "parallel_first"])
@pytest.mark.parametrize("model_type,form", CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_target_forms_match_single_device_peft(pool, model_type, form, order):
    _assert_equal(pool.run(check_order, model_type, form, order))


def check_gathering_plan(order: str) -> dict:
    """A plan whose MLP gathers gate/up outputs and lets down_proj split its own input (the layers transformers' own
    `colwise_gather_output` entries make): LoRA on them gathers and splits with the base."""
    import optimum_parallel as op

    mesh = op.init_mesh(tp=2)
    plan = {
        "model.layers.*.self_attn.(q|k|v)_proj": op.ColWiseParallel(),
        "model.layers.*.self_attn.o_proj": op.RowWiseParallel(),
        "model.layers.*.mlp.(gate|up)_proj": op.ColWiseParallel(gather_output=True),
        "model.layers.*.mlp.down_proj": op.RowWiseParallel(input_is_parallel=False),
    }
    config = _config("llama")
    base = build_model(config)
    reference = _peft(copy.deepcopy(base), "all-linear")
    parallel = {"mp_config": {"parallelize_plan": plan}}
    if order == "peft_first":
        model = op.parallelize(_peft(copy.deepcopy(base), "all-linear"), mesh=mesh, config=parallel)[0]
    else:
        model = _peft(op.parallelize(copy.deepcopy(base), mesh=mesh, config=parallel)[0], "all-linear")
    result = _compare(model, reference, make_batch(config))
    bases = [getattr(m, "base_layer", None) for m in model.modules()]
    result["gathering"] = sum(getattr(b, "gather_output", False) for b in bases)  # gate_proj, up_proj x 2 layers
    result["splitting"] = sum(getattr(b, "input_is_parallel", True) is False for b in bases)  # down_proj x 2 layers
    return result


@pytest.mark.parametrize("order", ["peft_first", "parallel_first"])
def test_layers_that_gather_or_split_their_own_input(pool, order):
    results = pool.run(check_gathering_plan, order)
    _assert_equal(results)
    assert all(r["gathering"] == 4 and r["splitting"] == 2 for r in results), results


def test_all_linear_leaves_out_the_lm_head():
    """What PEFT itself picks on one device: every projection, not the LM head (the expected set of the tests)."""
    names = adapted(_peft(build_model(_config("llama")), "all-linear"))
    assert len(names) == 2 * 7 and not any("lm_head" in n for n in names), names


def check_trainer(hf_dir: str, output_dir: str, form: str) -> dict:
    """`ParallelTrainer(path, args, peft_config=...)` at tp=2: the adapters on its (lazily loaded, split) model
    against single-device PEFT on the same checkpoint, then a step of training."""
    from test_trainer import common_args, datasets
    from transformers import AutoModelForCausalLM

    from optimum_parallel import ParallelTrainer, ParallelTrainingArguments

    args = ParallelTrainingArguments(
        **{**common_args(output_dir, 2), "tensor_parallel_size": 2, "eval_strategy": "no", "save_strategy": "no"},
        max_steps=1,
    )
    train, _ = datasets()
    torch.manual_seed(123)
    trainer = ParallelTrainer(hf_dir, args, peft_config=lora_config(form), train_dataset=train)
    reference = _peft(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), form)
    model = trainer.model
    result = _compare(model, reference, make_batch(reference.config))
    model.zero_grad(set_to_none=True)
    trainer.train()
    result["trained"] = trainer.state.global_step
    return result


@pytest.mark.parametrize("form", ["all-linear", "regex"])
def test_trainer_peft_config_target_forms(pool, tmp_path, form):
    build_model(_config("llama"), seed=3).save_pretrained(tmp_path / "base")
    results = pool.run(check_trainer, str(tmp_path / "base"), str(tmp_path / "out"), form)
    _assert_equal(results)
    assert all(r["trained"] == 1 for r in results), results
