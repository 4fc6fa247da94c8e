"""Plans: regex keys, parameter keys, lists of styles, hooks, and errors raised before anything moves."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _checks import error_and_whether_untouched
from _models import build_model, make_batch, rel_err, tiny_config, whole_logits

WORLD_SIZE = 2  # worker processes of this module's `pool` (conftest.py)


def user_plan():
    import optimum_parallel as op

    return {
        "model.embed_tokens": op.RowWiseParallel(),
        "model.layers.*.self_attn.q_proj": op.ColWiseParallel(units=4),
        "model.layers.*.self_attn.(k|v)_proj": op.ColWiseParallel(units=2),
        "model.layers.*.self_attn.o_proj": op.RowWiseParallel(),
        "model.layers.*.mlp.(gate|up)_proj": op.ColWiseParallel(),
        "model.layers.*.mlp.down_proj": op.RowWiseParallel(),
        "lm_head.weight": op.ColWiseParallel(),  # a parameter key targets its module
    }


def check_user_plan_matches_reference() -> dict:
    import optimum_parallel as op
    from optimum_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    mesh = op.init_mesh(tp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    model = copy.deepcopy(reference)
    calls = []
    plan = user_plan()
    plan["model.layers.0.mlp"] = [
        op.PrepareLayerInput(lambda module, args, kwargs: calls.append("input")),
        op.PrepareLayerOutput(lambda module, args, output: calls.append("output")),
    ]
    op.apply_plan(model, plan, mesh)
    batch = make_batch(config)
    expected = reference(**batch)
    out = model(**batch)
    layer = model.model.layers[1]
    return {
        "loss": rel_err(out.loss, expected.loss),
        "logits": rel_err(whole_logits(model, out.logits), expected.logits),
        "swapped": isinstance(layer.self_attn.k_proj, ColumnParallelLinear)
        and isinstance(layer.mlp.down_proj, RowParallelLinear),
        "hooks": calls,
        "state_dict_keys_kept": list(model.state_dict()) == list(reference.state_dict()),
    }


def test_user_plan_with_regex_and_parameter_keys(pool):
    for result in pool.run(check_user_plan_matches_reference):
        assert result["loss"] <= 1e-5 and result["logits"] <= 1e-5, result
        assert result["swapped"] and result["state_dict_keys_kept"], result
        assert result["hooks"] == ["input", "output"], result


def check_bad_plan(case: str) -> tuple[str, str, bool]:
    import optimum_parallel as op

    mesh = op.init_mesh(tp=2)
    model = build_model(tiny_config("llama"))
    plan = user_plan()
    if case == "unknown_key":
        plan["model.layers.*.self_attn.qkv_proj"] = op.ColWiseParallel()
    elif case == "misfit_style":
        plan["model.layers.*.input_layernorm"] = op.ColWiseParallel()
    elif case == "not_a_style":
        plan["model.norm"] = "colwise"
    elif case == "bad_regex":
        plan["model.layers.(*"] = op.ColWiseParallel()
    elif case == "heads":
        plan["model.layers.*.self_attn.q_proj"] = op.ColWiseParallel(units=3)
    return error_and_whether_untouched(model, lambda: op.apply_plan(model, plan, mesh))


@pytest.mark.parametrize(
    "case,error,words",
    [
        ("unknown_key", "ValueError", ["model.layers.*.self_attn.qkv_proj", "matches no module"]),
        ("misfit_style", "ValueError", ["ColWiseParallel", "input_layernorm", "LlamaRMSNorm", "Linear"]),
        ("not_a_style", "TypeError", ["model.norm", "'colwise'", "ColWiseParallel"]),
        ("bad_regex", "ValueError", ["model.layers.(*", "regex"]),
        ("heads", "ValueError", ["q_proj", "3 heads", "tensor-parallel size 2"]),
    ],
)
def test_bad_plans_raise_before_anything_moves(pool, case, error, words):
    for kind, message, unchanged in pool.run(check_bad_plan, case):
        assert kind == error, message
        assert all(w in message for w in words), message
        assert unchanged, "the model was modified before the error"


def check_optional_key_and_tied_weights() -> dict:
    import optimum_parallel as op

    mesh = op.init_mesh(tp=2)
    model = build_model(tiny_config("llama", tie_word_embeddings=True))
    plan = user_plan()
    plan["model.does_not_exist"] = op.optional(op.ColWiseParallel())
    op.apply_plan(model, plan, mesh)
    return {"tied": model.lm_head.weight is model.model.embed_tokens.weight, "rank": dist.get_rank()}


def test_optional_keys_and_tied_weights_stay_tied(pool):
    assert all(r["tied"] for r in pool.run(check_optional_key_and_tied_weights))


def check_a_swapped_container_is_looked_up_anew() -> dict:
    """A swapping style that replaces a module with children: a plan key under it names the new child."""
    import optimum_parallel as op
    from optimum_parallel.tensor_parallel import ColumnParallelLinear

    class NewMlp(op.ParallelStyle):
        swaps_module = True

        def apply(self, module, name, ctx):
            replacement = copy.deepcopy(module)
            replacement.replaced = True
            with torch.no_grad():
                replacement.up_proj.weight.zero_()  # tells the new child from the old one
            return replacement

    mesh = op.init_mesh(tp=2)
    model = build_model(tiny_config("llama"))
    op.apply_plan(model, {"model.layers.0.mlp": NewMlp(), "model.layers.0.mlp.up_proj": op.ColWiseParallel()}, mesh)
    mlp = model.model.layers[0].mlp
    return {
        "replaced": getattr(mlp, "replaced", False),
        "new_child_split": isinstance(mlp.up_proj, ColumnParallelLinear) and not mlp.up_proj.weight.any().item(),
    }


def test_a_key_under_a_swapped_container_names_its_new_child(pool):
    for result in pool.run(check_a_swapped_container_is_looked_up_anew):
        assert result == {"replaced": True, "new_child_split": True}, result


def check_optimizer_for_mp_keeps_groups_and_state() -> dict:
    import optimum_parallel as op

    op.init_mesh(tp=2)
    model = build_model(tiny_config("llama"))
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.8, 0.9)
    )
    batch = make_batch(model.config)
    model(**batch).loss.backward()
    optimizer.step()
    exp_avg = optimizer.state[model.model.layers[0].mlp.up_proj.weight]["exp_avg"].clone()
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    new = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    up = model.model.layers[0].mlp.up_proj.weight
    return {
        "class": type(new).__name__,
        "groups": [(g["weight_decay"], g["lr"], g["betas"], len(g["params"])) for g in new.param_groups],
        "state_sliced": torch.equal(new.state[up]["exp_avg"], up.shard_layout.slice(exp_avg)),
        "params_are_parallel": {id(p) for g in new.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters()},
    }


def test_optimizer_for_mp_keeps_groups_and_state(pool):
    result = pool.run(check_optimizer_for_mp_keeps_groups_and_state)[0]
    assert result["class"] == "AdamW"
    assert result["groups"] == [(0.1, 3e-3, (0.8, 0.9), 16), (0.0, 3e-3, (0.8, 0.9), 5)]
    assert result["state_sliced"] and result["params_are_parallel"], result
