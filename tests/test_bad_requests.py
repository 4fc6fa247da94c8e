"""Bad requests at every entry point raise ONE error, on every rank, naming the key and the allowed values, before
anything changes: the model keeps the same parameter objects with the same values and the same module types.

Entry points: Paddle's `op.parallelize(model, optimizer, mesh, config)`, `Parallelizer.parallelize(model, ...)` after
`op.init_mesh`, `ParallelTrainer(model, ParallelTrainingArguments(...))`, and PEFT's `get_peft_model` in both orders.
All cases run in one `pool.run` (4 ranks); each case's assertions are their own test id.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from _models import build_model, tiny_config

WORLD_SIZE = 4
ERRORS = (ValueError, TypeError, NotImplementedError)


def _mesh(**sizes):
    """The mesh with these sizes, made once per worker (process groups are not free) and made current."""
    import optimum_parallel as op

    key = tuple(sorted(sizes.items()))
    made = _mesh.__dict__.setdefault("made", {})
    if key not in made:
        made[key] = op.init_mesh(**sizes)
    return op.set_mesh(made[key])


def _llama(**overrides):
    return build_model(tiny_config("llama", **overrides))


def _plan():
    import optimum_parallel as op

    return {
        "model.layers.*.self_attn.q_proj": op.ColWiseParallel(units=4),
        "model.layers.*.self_attn.k_proj": op.ColWiseParallel(units=2),
        "model.layers.*.self_attn.v_proj": op.ColWiseParallel(units=2),
        "model.layers.*.self_attn.o_proj": op.RowWiseParallel(units=4),
        "model.layers.*.mlp.gate_proj": op.ColWiseParallel(),
        "model.layers.*.mlp.up_proj": op.ColWiseParallel(),
        "model.layers.*.mlp.down_proj": op.RowWiseParallel(),
    }


def _stepped_optimizer(model):
    """An AdamW that has stepped (it holds state); the step leaves the weights as they are (lr 0)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    return optimizer


def _lora(targets, **kwargs):
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=targets, **kwargs)


# ---------------------------------------------------------------------------------------------- the entry points


def paddle(config, model=None, mesh=None, optimizer=None, layers=2, tied=False):
    """op.parallelize(model, optimizer, mesh, config) on a tiny Llama over `mesh` (default tp=2 x dp=2)."""

    def setup():
        import optimum_parallel as op

        m = model() if model is not None else _llama(num_hidden_layers=layers, tie_word_embeddings=tied)
        the_mesh = mesh if isinstance(mesh, str) else _mesh(**(mesh or {"dp": 2, "tp": 2}))
        opt = optimizer(m) if optimizer is not None else None
        cfg = config() if callable(config) else config
        return m, lambda: op.parallelize(m, opt, the_mesh, cfg)

    return setup


def parallelizer(mesh, model=None, **kwargs):
    """Parallelizer.parallelize(model, **kwargs) after init_mesh(**mesh)."""

    def setup():
        import optimum_parallel as op

        _mesh(**mesh)
        m = model() if model is not None else _llama()
        return m, lambda: op.ParallelizersManager.parallelizer_for_model(m).parallelize(m, **kwargs)

    return setup


def trainer(args, model=None, optimizer=False, plain_args=False, lora_targets=None):
    """ParallelTrainer(model, ParallelTrainingArguments(**args)) (the arguments themselves may raise)."""

    def setup():
        from transformers import TrainingArguments

        from optimum_parallel.integrations.transformers.trainer import ParallelTrainer
        from optimum_parallel.integrations.transformers.training_args import ParallelTrainingArguments

        m = model() if model is not None else _llama()
        opt = _stepped_optimizer(m) if optimizer else None
        common = dict(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, ddp_timeout=60, disable_tqdm=True)

        def call():
            cls = TrainingArguments if plain_args else ParallelTrainingArguments
            peft_config = None
            if lora_targets is not None:
                from peft import LoraConfig

                peft_config = LoraConfig(r=4, target_modules=lora_targets)
            return ParallelTrainer(m, cls(**common, **args), optimizers=(opt, None), peft_config=peft_config)

        return m, call

    return setup


def peft_after(targets, mesh=None, **lora):
    """get_peft_model on a model parallelized before (the returned model is the parallel one)."""

    def setup():
        from peft import get_peft_model

        import optimum_parallel as op

        _mesh(**(mesh or {"dp": 2, "tp": 2}))
        m = _llama()
        m = op.ParallelizersManager.parallelizer_for_model(m).parallelize(m)
        return m, lambda: get_peft_model(m, _lora(targets, **lora))

    return setup


def peft_before(targets, entry="parallelizer", plan=None):
    """get_peft_model first, then parallelize (the Parallelizer, or Paddle's `parallelize` with `plan`)."""

    def setup():
        from peft import get_peft_model

        import optimum_parallel as op

        mesh = _mesh(dp=2, tp=2)
        m = get_peft_model(_llama(), _lora(targets))
        if entry == "parallelizer":
            return m, lambda: op.ParallelizersManager.parallelizer_for_model(m).parallelize(m)
        return m, lambda: op.parallelize(m, None, mesh, {"mp_config": {"parallelize_plan": {**_plan(), **plan()}}})

    return setup


def _gpt2():
    return build_model(tiny_config("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64))


def _olmoe():
    return build_model(tiny_config("olmoe", num_experts=2, num_experts_per_tok=1))


def _mixtral():
    return build_model(tiny_config("mixtral", num_local_experts=2, num_experts_per_tok=1))


def _split_count():
    import optimum_parallel as op

    return {"pp_config": {"split_spec": {"model.layers.0": op.SplitPoint.END, "model.layers.2": op.SplitPoint.END}}}


def _with_plan(extra):
    def config():
        return {"mp_config": {"parallelize_plan": {**_plan(), **extra()}}}

    return config


def _colwise(**kwargs):
    import optimum_parallel as op

    return op.ColWiseParallel(**kwargs)


def _rowwise(**kwargs):
    import optimum_parallel as op

    return op.RowWiseParallel(**kwargs)


PP2 = {"pp": 2, "dp": 2, "tp": 1}
CP4 = {"cp": 4, "tp": 1}

# id -> (setup, error type, words the message must hold)
CASES = {
    # ---------------------------------------------------- op.parallelize(model, optimizer, mesh, config)
    "paddle/unknown_section": (
        paddle({"xp_config": {}}),
        "ValueError",
        ["'xp_config'", "dp_config, mp_config, pp_config"],
    ),
    "paddle/config_not_a_dict": (paddle([1]), "TypeError", ["config", "dict"]),
    "paddle/mesh_not_a_mesh": (paddle({"dp_config": {}}, mesh="tp=2"), "TypeError", ["mesh", "ParallelMesh"]),
    "paddle/unknown_dp_key": (
        paddle({"dp_config": {"sharding": 1}}),
        "ValueError",
        ["dp_config", "'sharding'", "sharding_level"],
    ),
    "paddle/sharding_level": (
        paddle({"dp_config": {"sharding_level": 4}}),
        "ValueError",
        ["dp_config['sharding_level']=4", "0, 1, 2, 3"],
    ),
    "paddle/dp_not_a_dict": (paddle({"dp_config": 1}), "TypeError", ["dp_config", "dict"]),
    "paddle/zero1_stepped_optimizer": (
        paddle(lambda: {"dp_config": {"sharding_level": 1}, **_with_plan(dict)()}, optimizer=_stepped_optimizer),
        "ValueError",
        ["dp_config['sharding_level']=1", "fresh optimizer", "allowed"],
    ),
    "paddle/no_dp_dim": (
        paddle({"dp_config": {"sharding_level": 2}}, mesh={"tp": 4}),
        "ValueError",
        ["dp_config", "dp x cp > 1", "dp=1", "cp=1"],
    ),
    "paddle/no_tp_dim": (
        paddle(_with_plan(dict), mesh={"dp": 4, "tp": 1}),
        "ValueError",
        ["mp_config", "tp > 1", "tp=1"],
    ),
    "paddle/no_pp_dim": (
        paddle({"pp_config": {"split_spec": "model.layers"}}),
        "ValueError",
        ["pp_config", "pp > 1", "pp=1"],
    ),
    "paddle/plan_not_a_dict": (
        paddle({"mp_config": {"parallelize_plan": ["q_proj"]}}),
        "TypeError",
        ["parallelize_plan", "dict"],
    ),
    "paddle/missing_plan": (paddle({"mp_config": {}}), "ValueError", ["mp_config", "'parallelize_plan'"]),
    "paddle/unmatched_key": (
        paddle(_with_plan(lambda: {"model.layers.*.attn.qkv": _colwise()})),
        "ValueError",
        ["model.layers.*.attn.qkv", "matches no module", "names look like"],
    ),
    "paddle/misfit_style": (
        paddle(_with_plan(lambda: {"model.norm": _rowwise()})),
        "ValueError",
        ["RowWiseParallel", "model.norm", "LlamaRMSNorm", "Linear, Embedding"],
    ),
    "paddle/not_a_style": (
        paddle(_with_plan(lambda: {"model.norm": "colwise"})),
        "TypeError",
        ["parallelize_plan['model.norm']", "'colwise'", "ColWiseParallel"],
    ),
    "paddle/bad_regex": (
        paddle(_with_plan(lambda: {"model.layers.(*": _colwise()})),
        "ValueError",
        ["model.layers.(*", "regex"],
    ),
    "paddle/heads": (
        paddle(_with_plan(lambda: {"model.layers.*.self_attn.q_proj": _colwise(units=3)})),
        "ValueError",
        ["q_proj", "3 heads", "tensor-parallel size 2"],
    ),
    "paddle/bad_split_point": (
        paddle({"pp_config": {"split_spec": {"model.layers.1": "end"}}}, mesh=PP2),
        "ValueError",
        ["pp_config['split_spec']", "model.layers.1", "SplitPoint.END"],
    ),
    "paddle/split_spec_type": (
        paddle({"pp_config": {"split_spec": 3}}, mesh=PP2),
        "TypeError",
        ["pp_config['split_spec']", "str or a dict"],
    ),
    "paddle/split_count": (
        paddle(_split_count, mesh=PP2, layers=4),
        "ValueError",
        ["pp_config['split_spec']", "2 distinct split points", "2 stages need exactly 1"],
    ),
    "paddle/split_prefix": (
        paddle({"pp_config": {"split_spec": "model.blocks"}}, mesh=PP2),
        "ValueError",
        ["pp_config['split_spec']", "'model.blocks'", "names no module"],
    ),
    "paddle/bad_schedule": (
        paddle({"pp_config": {"split_spec": "model.layers", "schedule": "2f2b"}}, mesh=PP2, layers=4),
        "ValueError",
        ["pp_config['schedule']='2f2b'", "gpipe, 1f1b, interleaved_1f1b"],
    ),
    "paddle/microbatches": (
        paddle({"pp_config": {"split_spec": "model.layers", "num_microbatches": 1}}, mesh=PP2, layers=4),
        "ValueError",
        ["pp_config['num_microbatches']=1", ">= pp=2"],
    ),
    "paddle/too_many_stages": (
        paddle({"pp_config": {"split_spec": "model.layers"}}, mesh={"pp": 4, "tp": 1}),
        "ValueError",
        ["2 layers cannot be split into 4 pipeline stages", "at most 2"],
    ),
    "paddle/global_spec": (
        paddle({"pp_config": {"split_spec": "model.layers", "global_spec": "model.rotary"}}, mesh=PP2),
        "ValueError",
        ["pp_config['global_spec']", "'model.rotary'", "allowed"],
    ),
    "paddle/tied_zbv": (
        paddle(
            {"pp_config": {"split_spec": "model.layers", "schedule": "zbv", "num_microbatches": 2}},
            mesh=PP2,
            layers=4,
            tied=True,
        ),
        "NotImplementedError",
        [
            "pp_config['schedule']='zbv'",
            "tied embeddings",
            "tie_word_embeddings=False",
            "allowed with tied embeddings: gpipe, 1f1b",
        ],
    ),
    "paddle/pp_not_a_decoder": (
        paddle({"pp_config": {"split_spec": "transformer.h"}}, model=_gpt2, mesh=PP2),
        "NotImplementedError",
        ["GPT2LMHeadModel", "transformer.wpe holds parameters", "allowed for this model: pp=1"],
    ),
    "paddle/cp_family": (
        paddle({"dp_config": {"sharding_level": 0}}, model=_gpt2, mesh={"cp": 2, "dp": 2, "tp": 1}),
        "NotImplementedError",
        ["context parallelism", "'gpt2'", "transformer.wpe", "allowed for this model: cp=1"],
    ),
    # ---------------------------------------------------- Parallelizer.parallelize(model, ...) after init_mesh
    "parallelizer/microbatches_under_pp": (
        parallelizer(PP2, model=lambda: _llama(num_hidden_layers=4), pipeline_parallel_num_microbatches=1),
        "ValueError",
        ["pipeline_parallel_num_microbatches=1", ">= pp=2"],
    ),
    "parallelizer/microbatches_without_pp": (
        parallelizer({"dp": 2, "tp": 2}, pipeline_parallel_num_microbatches=2),
        "ValueError",
        ["pipeline_parallel_num_microbatches=2", "pp > 1", "allowed with pp=1: 1"],
    ),
    "parallelizer/schedule": (
        parallelizer(
            PP2,
            model=lambda: _llama(num_hidden_layers=4),
            pipeline_parallel_num_microbatches=2,
            pipeline_parallel_schedule="2f2b",
        ),
        "ValueError",
        ["pipeline_parallel_schedule='2f2b'", "1f1b", "interleaved_1f1b", "zbv"],
    ),
    "parallelizer/tied_zbv": (
        parallelizer(
            PP2,
            model=lambda: _llama(num_hidden_layers=4, tie_word_embeddings=True),
            pipeline_parallel_num_microbatches=2,
            pipeline_parallel_schedule="zbv",
        ),
        "NotImplementedError",
        ["pipeline_parallel_schedule='zbv'", "tied embeddings", "tie_word_embeddings=False"],
    ),
    "parallelizer/too_many_stages": (
        parallelizer(PP2, pipeline_parallel_num_microbatches=2, pipeline_parallel_schedule="interleaved_1f1b"),
        "ValueError",
        ["2 layers cannot be split into 4 pipeline stages", "at most 2"],
    ),
    "parallelizer/input_names": (
        parallelizer(
            PP2,
            model=lambda: _llama(num_hidden_layers=4),
            pipeline_parallel_num_microbatches=2,
            pipeline_parallel_input_names=["token_type_ids"],
        ),
        "ValueError",
        ["pipeline_parallel_input_names", "'token_type_ids'", "allowed: input_ids, attention_mask, labels"],
    ),
    "parallelizer/pp_family": (
        parallelizer(PP2, model=_gpt2, pipeline_parallel_num_microbatches=2),
        "NotImplementedError",
        ["does not support pipeline parallelism", "allowed for this model: pp=1"],
    ),
    "parallelizer/router_logits_pp": (
        parallelizer(
            PP2,
            model=lambda: build_model(
                tiny_config(
                    "mixtral",
                    num_local_experts=2,
                    num_experts_per_tok=1,
                    num_hidden_layers=4,
                    output_router_logits=True,
                )  # fmt: skip
            ),
            pipeline_parallel_num_microbatches=2,
        ),
        "ValueError",
        ["output_router_logits=True with pp=2", "allowed with pp > 1: output_router_logits=False"],
    ),
    "paddle/ep_hybrid_sharding": (
        paddle({"dp_config": {"sharding_level": 2, "shard_size": 2}}, model=_mixtral, mesh={"dp": 4, "ep": 2}),
        "ValueError",
        ["dp_config['shard_size']=2", "ep=2", "allowed with ep > 1: -1"],
    ),
    "trainer/ep_hybrid_sharding": (
        trainer({"expert_parallel_size": 2, "sharding_level": 1, "shard_size": 2}, model=_mixtral),
        "ValueError",
        ["shard_size=2", "ep=2", "allowed with ep > 1: -1"],
    ),
    "parallelizer/sp_family": (
        parallelizer({"dp": 2, "tp": 2}, model=_gpt2, sequence_parallel_enabled=True),
        "NotImplementedError",
        ["sequence_parallel_enabled=True", "does not support sequence parallelism", "allowed for this model: False"],
    ),
    "parallelizer/heads_over_tp": (
        parallelizer({"tp": 4}, model=lambda: _llama(num_attention_heads=2, num_key_value_heads=2)),
        "ValueError",
        ["tensor_parallel_size=4", "must divide num_attention_heads=2"],
    ),
    "parallelizer/cp_family": (
        parallelizer(CP4, model=_gpt2),
        "NotImplementedError",
        ["context parallelism", "'gpt2'", "does not declare context parallelism", "allowed for this model: cp=1"],
    ),
    "parallelizer/cp_strategy": (
        parallelizer(CP4, context_parallel_strategy="zigzag"),
        "ValueError",
        ["context_parallel_strategy='zigzag'", "allowed: ring, all_to_all"],
    ),
    "parallelizer/cp_heads": (
        parallelizer(CP4, context_parallel_strategy="all_to_all"),
        "ValueError",
        ["context_parallel_strategy='all_to_all'", "divide by cp=4", "4 query and 2 key/value", "'ring'"],
    ),
    "parallelizer/cp_heads_per_tp_rank": (
        parallelizer({"cp": 2, "tp": 2}, context_parallel_strategy="all_to_all"),
        "ValueError",
        ["context_parallel_strategy='all_to_all'", "divide by cp=2", "2 query and 1 key/value"],
    ),
    # ---------------------------------------------------- ParallelTrainer(model, args) and its args
    "trainer/plain_training_arguments": (
        trainer({}, plain_args=True),
        "TypeError",
        ["ParallelTrainingArguments", "TrainingArguments"],
    ),
    "trainer/sizes_do_not_divide": (
        trainer({"tensor_parallel_size": 3}),
        "ValueError",
        ["tensor_parallel_size=3", "does not divide", "world size 4", "allowed"],
    ),
    "trainer/zero1_stepped_optimizer": (
        trainer({"tensor_parallel_size": 2, "sharding_level": 1}, optimizer=True),
        "ValueError",
        ["sharding_level=1", "fresh optimizer", "allowed"],
    ),
    "trainer/tied_zbv": (
        trainer(
            {
                "pipeline_parallel_size": 2,
                "pipeline_parallel_num_microbatches": 2,
                "pipeline_schedule": "zbv",
                "per_device_train_batch_size": 2,
                "per_device_eval_batch_size": 2,
            },
            model=lambda: _llama(num_hidden_layers=4, tie_word_embeddings=True),
        ),
        "NotImplementedError",
        ["pipeline_schedule='zbv'", "tie_word_embeddings=False"],
    ),
    "trainer/too_many_stages": (
        trainer(
            {
                "pipeline_parallel_size": 2,
                "pipeline_parallel_num_microbatches": 2,
                "pipeline_schedule": "interleaved_1f1b",
                "per_device_train_batch_size": 2,
                "per_device_eval_batch_size": 2,
            }
        ),
        "ValueError",
        ["2 layers cannot be split into 4 pipeline stages", "at most 2"],
    ),
    "trainer/cp_family": (
        trainer({"context_parallel_size": 2}, model=_gpt2),
        "NotImplementedError",
        ["context parallelism", "'gpt2'", "supported"],
    ),
    "trainer/cp_heads": (
        trainer({"context_parallel_size": 4, "context_parallel_strategy": "all_to_all"}),
        "ValueError",
        ["context_parallel_strategy='all_to_all'", "divide by cp=4", "'ring'"],
    ),
    "trainer/sp_family": (
        trainer({"tensor_parallel_size": 2, "sequence_parallel": True}, model=_gpt2),
        "NotImplementedError",
        ["sequence_parallel", "allowed for this model: False"],
    ),
    "trainer/lora_on_the_lm_head": (
        trainer({"tensor_parallel_size": 2}, lora_targets=["q_proj", "lm_head"]),
        "NotImplementedError",
        ["'lm_head'", "vocab-parallel LM head", "target_modules"],
    ),
    # ---------------------------------------------------- PEFT, both orders
    "peft_after/lm_head": (
        peft_after(["q_proj", "lm_head"]),
        "NotImplementedError",
        ["'lm_head'", "vocab-parallel LM head", "target_modules", "Supported: LoRA on Linear"],
    ),
    "peft_after/lm_head_only": (
        peft_after(["lm_head"]),
        "NotImplementedError",
        ["'lm_head'", "vocab-parallel LM head", "RowParallelLinear"],
    ),
    "peft_before/lm_head": (
        peft_before(["q_proj", "lm_head"]),
        "NotImplementedError",
        ["'lm_head'", "vocab-parallel LM head", "target_modules", "Supported: LoRA on Linear"],
    ),
}


def _snapshot(model):
    params = dict(model.named_parameters(remove_duplicate=False))
    return (
        {n: p for n, p in params.items()},
        {n: p.detach().clone() for n, p in params.items()},
        {n: type(m) for n, m in model.named_modules(remove_duplicate=False)},
    )


def untouched(model, before) -> str:
    """ "" if `model` has the same parameter objects, values and module types as `before`, else what differs."""
    objects, values, types = before
    now, now_types = (
        dict(model.named_parameters(remove_duplicate=False)),
        {n: type(m) for n, m in model.named_modules(remove_duplicate=False)},
    )
    if now.keys() != objects.keys():
        return f"parameters changed: {sorted(now.keys() ^ objects.keys())[:4]}"
    replaced = [n for n, p in now.items() if p is not objects[n]]
    changed = [n for n, p in now.items() if not torch.equal(p.detach(), values[n])]
    retyped = [n for n in types.keys() | now_types.keys() if types.get(n) is not now_types.get(n)]
    problems = {"replaced": replaced, "values changed": changed, "module types changed": retyped}
    return "; ".join(f"{k}: {v[:4]}" for k, v in problems.items() if v)


def run_cases() -> dict[str, tuple[str, str, str]]:
    """Every case on this rank: {id: (error type, message, what changed or "")}."""
    results = {}
    for case, (setup, _, _) in CASES.items():
        model, call = setup()
        before = _snapshot(model)
        try:
            call()
        except ERRORS as err:
            results[case] = (type(err).__name__, str(err), untouched(model, before))
        else:
            results[case] = ("", "no error", untouched(model, before))
    return results


@pytest.fixture(scope="module")
def results(pool):
    pytest.importorskip("peft")
    return pool.run(run_cases)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_raises_one_error_on_every_rank_before_anything_changes(results, case):
    _, error, words = CASES[case]
    for rank, per_rank in enumerate(results):
        kind, message, changed = per_rank[case]
        assert kind == error, f"rank {rank}: {kind}: {message}"
        missing = [w for w in words if w not in message]
        assert not missing, f"rank {rank}: {missing} not in: {message}"
        assert not changed, f"rank {rank}: the model changed before the error: {changed}"
