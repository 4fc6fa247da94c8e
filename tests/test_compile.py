"""torch.compile on every layout (issue 35): each decoder block compiled (`compile=` on the doors), against the
single-device transformers model (loss, every gradient, 3 AdamW steps); `torch._dynamo.explain` finds no graph break
in one decoder block of each layout, and the steps after the first compile nothing new (gloo, 4 ranks).

The blocks are compiled with the "aot_eager" backend (dynamo and AOT autograd, as inductor gets them: the custom
ops' shapes and gradients, the folded entries), inductor once (tp=2 + sp); inductor's own speed is
`scripts/bench_compile.py`'s."""

from __future__ import annotations

import copy

import pytest
import torch
from _checks import TOL
from _models import build_model, make_batch, rel_err, tiny_config

WORLD_SIZE = 4
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)

LAYOUTS = {  # name: (mesh sizes, options)
    "tp2": (dict(dp=2, tp=2), {}),
    "tp2_sp": (dict(dp=2, tp=2), dict(sequence_parallel=True, backend="inductor")),
    "cp2_ring": (dict(dp=2, cp=2), dict(level=0)),
    "cp2_all_to_all": (dict(dp=2, cp=2), dict(level=0, strategy="all_to_all")),
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


def check_layout(name: str, steps: int = 3) -> dict:
    """The compiled model of layout `name` against one device on the same batch (every dp replica gets it too, so
    averages are exact); the explain result of one block; what dynamo compiled after the first step."""
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
    reference = build_model(config)
    reference.train()  # no dropout in these configs: train and eval compute the same
    model = copy.deepcopy(reference)
    if options.get("lora"):
        reference, model = _lora(reference), _lora(model)
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
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
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

    loss, ref_loss = step(model), step(reference)
    first = {"loss": rel_err(loss, ref_loss)}
    expected = dict(reference.named_parameters())
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
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        losses.append(rel_err(step(model), step(reference)))
    return {
        **first,
        "worst_grad": max(grads.values()),
        "worst_grad_name": max(grads, key=grads.get),
        "grads": len(grads),
        "steps": max(losses),
        "explain": explain.result,
        "blocks": len(blocks),
        "graphs_after_first": compiled_after_first.get("unique_graphs", 0),
        "graphs_after_all": dict(counters["stats"]).get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_single_device(pool, name):
    for rank, result in enumerate(pool.run(check_layout, name)):
        for key in ("loss", "worst_grad", "steps"):
            assert result[key] <= TOL, f"rank {rank}: {key} {result[key]:.2e} ({result})"
        assert result["explain"] is not None, f"rank {rank}: no block ran ({result})"
        assert result["explain"]["breaks"] == 0 and result["explain"]["graphs"] == 1, f"rank {rank}: {result}"
        assert result["graph_breaks"] == 0, f"rank {rank}: {result}"
        graphs = LAYOUTS[name][1].get("graphs", 1)
        assert result["graphs_after_first"] == graphs, f"rank {rank}: one graph serves every block ({result})"
        assert result["graphs_after_all"] == result["graphs_after_first"], f"rank {rank}: recompiled ({result})"
