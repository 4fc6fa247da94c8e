"""torch.compile on every layout (issue 35): each decoder block compiled (`compile=` on each entry point), against
the single-device transformers model (loss, every gradient, 3 AdamW steps), within fp32's noise floor: the worst error
of the same single-device run from weights perturbed by relative 1e-7; `torch._dynamo.explain` finds no graph break
in one decoder block of each layout, and the steps after the first compile nothing new (gloo, 4 ranks). The
Trainer's torch_compile, torch_compile_backend and torch_compile_mode, and the values `compile=` refuses.

The blocks are compiled with the "aot_eager" backend (dynamo and AOT autograd, as inductor gets them: the custom
ops' shapes and gradients, the folded entries), inductor once (tp=2 + sp); inductor's own speed is
`scripts/bench_compile.py`'s."""

from __future__ import annotations

import copy

import pytest
import torch
from _checks import TOL
from _models import build_model, make_batch, rel_err, tiny_config
from test_trainer import hf_dir, reference  # noqa: F401 (fixtures: the model directory, the single-device Trainer)

WORLD_SIZE = 4
PERTURBATION = 1e-7  # relative, on every weight of one device: the run that sets the tolerance
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)

LAYOUTS = {  # name: (mesh sizes, options)
    "tp2": (dict(dp=2, tp=2), {}),
    "tp2_sp": (dict(dp=2, tp=2), dict(sequence_parallel=True, backend="inductor")),
    "cp2_ring": (dict(dp=2, cp=2), dict(level=0)),
    "cp2_all_to_all": (dict(dp=2, cp=2), dict(level=0, strategy="all_to_all")),
    "dp4_level1": (dict(dp=4), dict(level=1)),
    "dp4_level2": (dict(dp=4), dict(level=2)),
    "dp2_tp2_level3": (dict(dp=2, tp=2), dict(level=3)),
    "pp2_tp2": (dict(pp=2, tp=2), dict(pipeline=True)),
    "ep2_mixtral": (dict(dp=4, ep=2), dict(level=0, model_type="mixtral")),
    # the frozen embedding gives the first block an input without gradient: a graph of its own
    "lora_tp2": (dict(dp=2, tp=2), dict(lora=True, graphs=2)),
}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(123)  # the same adapters on every rank and on one device
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


class _Explain:
    """Runs `torch._dynamo.explain` on the first decoder block's own forward, with the arguments of its first call
    (inside the layout: FSDP2's parameters unsharded, the sequence split, a pipeline stage's inputs)."""

    def __init__(self, block) -> None:
        self.result = None
        self.forward = type(block).forward.__get__(block)
        self.handle = block.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.handle.remove()
        out = torch._dynamo.explain(self.forward)(*args, **kwargs)
        self.result = {
            "graphs": out.graph_count,
            "breaks": out.graph_break_count,
            "reasons": [str(reason.reason).splitlines()[0] for reason in out.break_reasons],
        }
        torch._dynamo.reset()  # the compiled blocks start from an empty cache, and the counters from zero
        torch._dynamo.utils.counters.clear()


def _perturbed(model, relative: float = PERTURBATION):
    """A copy of `model` with every weight w made w * (1 + relative * N(0, 1)) (its own seed)."""
    copy_ = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in copy_.parameters():
            param.mul_(1 + relative * torch.randn(param.shape, generator=gen))
    return copy_


def check_layout(name: str, steps: int = 3) -> dict:
    """The compiled model of layout `name` against one device on the same batch (every dp replica gets it too, so
    averages are exact); the explain result of one block; what dynamo compiled after the first step. `floor`: the
    same errors of one device started from weights perturbed by relative 1e-7 (fp32's noise floor here)."""
    from torch._dynamo.utils import counters

    import optimum_parallel as op
    from optimum_parallel.engine.compile import decoder_blocks
    from optimum_parallel.engine.compose import compose_training
    from optimum_parallel.plan.wrappers import plan_root

    sizes, options = LAYOUTS[name]
    torch._dynamo.reset()
    counters.clear()
    mesh = op.init_mesh(**sizes)
    model_type = options.get("model_type", "llama")
    config = tiny_config(model_type, **(MIXTRAL if model_type == "mixtral" else {}))
    single = build_model(config)
    single.train()  # no dropout in these configs: train and eval compute the same
    model = copy.deepcopy(single)
    if options.get("lora"):
        single, model = _lora(single), _lora(model)
    floor_model = _perturbed(single)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(plan_root(model))
    model = parallelizer.parallelize(
        model,
        sequence_parallel_enabled=options.get("sequence_parallel", False),
        context_parallel_strategy=options.get("strategy", "ring"),
        pipeline_parallel_num_microbatches=2 if options.get("pipeline") else 1,
        compile=options.get("backend", "aot_eager"),
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    if "level" in options:
        optimizer = compose_training(plan_root(model), optimizer, mesh, {}, op.DataParallelConfig(options["level"]))[1]
    single_optimizer, floor_optimizer = (
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (single, floor_model)
    )
    blocks = decoder_blocks(plan_root(model))
    explain = _Explain(blocks[0])

    batch = make_batch(config)
    batch["labels"][0, 3] = -100  # predicted from a padding position, which context parallelism leaves at zero
    pipeline = options.get("pipeline", False)

    def step(m):
        if m is model and pipeline:
            return m.run_train(**batch)
        loss = m(**batch).loss
        loss.backward()
        return loss

    loss, single_loss, floor_loss = step(model), step(single), step(floor_model)
    first = {"loss": rel_err(loss, single_loss)}
    expected = dict(single.named_parameters())
    floor = {"loss": rel_err(floor_loss, single_loss), "worst_grad": 0.0, "steps": 0.0}
    for param_name, param in floor_model.named_parameters():
        if param.requires_grad:
            floor["worst_grad"] = max(floor["worst_grad"], rel_err(param.grad, expected[param_name].grad))
    grads = {}
    for param_name, param in model.named_parameters():
        if not param.requires_grad:  # LoRA's frozen base
            continue
        full = expected[param_name].grad
        for layout in (getattr(param, "expert_layout", None), getattr(param, "shard_layout", None)):
            full = layout.slice(full) if layout is not None else full
        grads[param_name] = rel_err(_whole(param.grad), full)
    compiled_after_first = dict(counters["stats"])
    losses = []
    for _ in range(steps):
        for opt in (optimizer, single_optimizer, floor_optimizer):
            opt.step()
            opt.zero_grad()
        single_loss = step(single)
        losses.append(rel_err(step(model), single_loss))
        floor["steps"] = max(floor["steps"], rel_err(step(floor_model), single_loss))
    return {
        **first,
        "worst_grad": max(grads.values()),
        "worst_grad_name": max(grads, key=grads.get),
        "grads": len(grads),
        "steps": max(losses),
        "floor": floor,
        "explain": explain.result,
        "blocks": len(blocks),
        "graphs_after_first": compiled_after_first.get("unique_graphs", 0),
        "graphs_after_all": dict(counters["stats"]).get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_single_device(pool, name):
    for rank, result in enumerate(pool.run(check_layout, name)):
        tolerance = max(result["floor"].values())  # the noise floor of this model in fp32 (~1e-6 here)
        assert 0 < tolerance <= TOL, f"rank {rank}: the perturbed run ({result['floor']})"
        for key in ("loss", "worst_grad", "steps"):
            assert result[key] <= tolerance, f"rank {rank}: {key} {result[key]:.2e} > {tolerance:.2e} ({result})"
        assert result["explain"] is not None, f"rank {rank}: no block ran ({result})"
        assert result["explain"]["breaks"] == 0 and result["explain"]["graphs"] == 1, f"rank {rank}: {result}"
        assert result["graph_breaks"] == 0, f"rank {rank}: {result}"
        graphs = LAYOUTS[name][1].get("graphs", 1)
        assert result["graphs_after_first"] == graphs, f"rank {rank}: one graph serves every block ({result})"
        assert result["graphs_after_all"] == result["graphs_after_first"], f"rank {rank}: recompiled ({result})"


# ----------------------------------------------------------------------------------------------- the Trainer


def train_compiled(model_dir: str, output_dir: str, **compile_args) -> dict:
    """ParallelTrainer at dp=2 x tp=2 with `compile_args` (torch_compile, _backend, _mode) on test_trainer's text: its
    curve, each block's CompileConfig, what dynamo compiled."""
    from test_trainer import LOAD, common_args, curve, datasets, token_accuracy
    from torch._dynamo.utils import counters

    from optimum_parallel.engine.compile import COMPILED_MARK, decoder_blocks
    from optimum_parallel.integrations.transformers.trainer import ParallelTrainer
    from optimum_parallel.integrations.transformers.training_args import ParallelTrainingArguments
    from optimum_parallel.plan.wrappers import plan_root

    torch._dynamo.reset()
    counters.clear()
    args = common_args(output_dir, per_device=2)
    args = ParallelTrainingArguments(**{**args, "save_strategy": "no", "tensor_parallel_size": 2, **compile_args})
    train, evaluation = datasets()
    trainer = ParallelTrainer(model_dir, args, model_kwargs=LOAD, train_dataset=train, eval_dataset=evaluation,
                              compute_metrics=token_accuracy)  # fmt: skip
    trainer.train()
    blocks = decoder_blocks(plan_root(trainer.model))
    return {
        "curve": curve(trainer.state.log_history),
        "configs": [block.__dict__.get(COMPILED_MARK) for block in blocks],
        "graphs": dict(counters["stats"]).get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def test_trainer_torch_compile_matches_single_device(pool, hf_dir, reference, tmp_path):  # noqa: F811
    """torch_compile=True with torch_compile_backend: every block compiled with that backend (accelerate compiles
    nothing more), the curve of the single-device Trainer; one graph for training and one for evaluation."""
    from test_trainer import TOL as TRAINER_TOL
    from test_trainer import worst_difference

    from optimum_parallel.engine.compile import CompileConfig

    results = pool.run(train_compiled, hf_dir, str(tmp_path / "out"), torch_compile=True,
                       torch_compile_backend="aot_eager")  # fmt: skip
    for rank, result in enumerate(results):
        assert result["configs"] == [CompileConfig("aot_eager")] * len(result["configs"]) and result["configs"], result
        assert worst_difference(result["curve"], reference["curve"], range(1, 7)) <= TRAINER_TOL, (
            f"rank {rank}: {result}"
        )
        assert result["graph_breaks"] == 0 and result["graphs"] <= 2, f"rank {rank}: {result}"


def test_trainer_compile_arguments(tmp_path):
    """torch_compile_backend and _mode reach the blocks' CompileConfig; neuron's shapes are static; a mode that is
    not inductor's, or one inductor does not have, is refused naming the argument and what is allowed."""
    from test_trainer import common_args

    from optimum_parallel.engine.compile import CompileConfig
    from optimum_parallel.integrations.transformers.training_args import (
        ParallelTrainingArguments,
        _compile_setting,
    )

    def args(**overrides):
        return ParallelTrainingArguments(**{**common_args(str(tmp_path), 4), **overrides})

    assert _compile_setting(args()) is None
    assert _compile_setting(args(torch_compile=True)) == CompileConfig()
    mode = args(torch_compile=True, torch_compile_mode="max-autotune-no-cudagraphs")
    assert _compile_setting(mode) == CompileConfig("inductor", "max-autotune-no-cudagraphs")
    assert _compile_setting(args(torch_compile_backend="aot_eager")) == CompileConfig("aot_eager")
    with pytest.raises(ValueError, match="torch_compile: mode='fast' is not allowed; allowed: default"):
        args(torch_compile=True, torch_compile_mode="fast")
    with pytest.raises(ValueError, match="torch_compile: backend 'nope' is not known to torch; allowed: .*inductor"):
        args(torch_compile_backend="nope")


@pytest.mark.parametrize(
    "value,words",
    [
        ("nope", ["compile: backend 'nope'", "allowed:", "inductor"]),
        ({"backend": "inductor", "fullgraph": True}, ["unknown keys ['fullgraph']", "backend, mode, dynamic"]),
        ({"backend": "aot_eager", "mode": "max-autotune"}, ["mode='max-autotune' is inductor's", "'aot_eager'"]),
        (3, ["compile=3 is not allowed", "True, False, a backend name"]),
    ],
)
def test_bad_compile_values_are_refused(value, words):
    from optimum_parallel.engine.compile import check_compile_config, compile_config

    with pytest.raises(ValueError) as error:
        check_compile_config(compile_config(value), "compile")
    assert all(word in str(error.value) for word in words), str(error.value)


def test_neuron_compiler_gets_static_shapes():
    """TorchNeuron's backend compiles with static shapes on every entry point (torch decides for the others)."""
    from optimum_parallel.engine.compile import CompileConfig, compile_config

    assert compile_config("neuron") == CompileConfig("neuron", dynamic=False)
    assert compile_config({"backend": "neuron"}) == CompileConfig("neuron", dynamic=False)
    assert compile_config({"backend": "neuron", "dynamic": True}) == CompileConfig("neuron", dynamic=True)
    assert compile_config(True) == compile_config("inductor") == CompileConfig()
