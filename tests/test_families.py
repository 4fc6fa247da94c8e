"""Every hand-written model family against the real single-device transformers model (gloo, 4 ranks).

Each case saves a tiny random model with `save_pretrained`, loads it on every rank, parallelizes one
copy (tp=2 runs as dp=2 x tp=2) and compares logits, loss, every gradient (relative 1e-5, fp32, eager
attention, no dropout) and the loss over 3 AdamW steps with the untouched reference. A gradient's
error is measured against the largest gradient of its own module (see `grad_err`).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _checks import worst_loss_over_steps
from _models import rel_err
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

TOL = 1e-5
AUTO = {
    "causal": AutoModelForCausalLM,
    "mlm": AutoModelForMaskedLM,
    "seq_cls": AutoModelForSequenceClassification,
    "tok_cls": AutoModelForTokenClassification,
    "s2s": AutoModelForSeq2SeqLM,
}
TOKENS = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_labels=3)
LLAMA_LIKE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
ENCODER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)

# Tiny configs per family (hidden 64, 2 layers, 4 heads, vocab 128); cases add their own overrides.
FAMILIES: dict[str, dict] = {
    "llama": dict(LLAMA_LIKE),
    "mistral": dict(LLAMA_LIKE),
    "qwen2": dict(LLAMA_LIKE),
    "qwen3": dict(LLAMA_LIKE, head_dim=16, tie_word_embeddings=False),
    "gemma": dict(LLAMA_LIKE, head_dim=16),
    "gemma2": dict(LLAMA_LIKE, head_dim=16, sliding_window=8, final_logit_softcapping=3.0, attn_logit_softcapping=2.0),
    "gemma3_text": dict(LLAMA_LIKE, head_dim=16, sliding_window=8),
    "phi3": dict(LLAMA_LIKE, tie_word_embeddings=False),
    "mixtral": dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(
        LLAMA_LIKE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[1],  # layer 1 keeps a dense MLP
    ),
    # biases on attention and experts, one attention sink per head, interleaved gate/up pairs, sliding-window layers
    "gpt_oss": dict(
        LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=16, sliding_window=8
    ),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": dict(ENCODER, max_position_embeddings=64),
    "gpt_neo": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=8,
        max_position_embeddings=64,
    ),
    "opt": dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64),
    "bert": dict(ENCODER, max_position_embeddings=64),
    "roberta": dict(ENCODER, max_position_embeddings=64, pad_token_id=1),
    "t5": dict(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4, decoder_start_token_id=0),
}

# (family, task, tp, overrides): tied and untied heads, kv heads fewer than tp, vocab not divisible by tp.
CASES = [
    ("qwen3", "causal", 2, {}),
    ("qwen3", "causal", 4, {"tie_word_embeddings": True, "vocab_size": 130}),  # 2 kv heads over 4 ranks
    ("gemma", "causal", 2, {}),  # tied, scaled embedding
    ("gemma", "causal", 4, {"num_key_value_heads": 1, "vocab_size": 130}),  # multi-query: kv on all 4
    ("gemma2", "causal", 2, {}),  # soft-capping, sliding window, tied
    ("gemma2", "causal", 4, {"vocab_size": 130}),  # 2 kv heads over 4 ranks
    ("gemma3_text", "causal", 4, {"vocab_size": 130}),
    ("phi3", "causal", 2, {}),
    ("phi3", "causal", 4, {"vocab_size": 130, "tie_word_embeddings": True}),  # 2 kv heads of the fused qkv on 4 ranks
    ("phi3", "seq_cls", 2, {"num_key_value_heads": 4}),
    ("mixtral", "causal", 2, {}),
    ("mixtral", "causal", 4, {"output_router_logits": True, "router_aux_loss_coef": 0.1, "vocab_size": 130}),
    ("qwen2_moe", "causal", 2, {}),
    ("qwen2_moe", "causal", 4, {"tie_word_embeddings": True, "vocab_size": 130}),
    ("gpt_oss", "causal", 2, {}),
    ("gpt_oss", "causal", 4, {"vocab_size": 130}),  # one head and its sink per rank, 2 kv heads over 4 ranks
    ("gpt2", "causal", 2, {}),  # Conv1D, fused c_attn, tied
    ("gpt2", "causal", 4, {"vocab_size": 130}),
    ("gpt2", "tok_cls", 2, {}),
    ("gpt_neox", "causal", 2, {}),  # interleaved fused qkv, untied
    ("gpt_neox", "causal", 4, {"tie_word_embeddings": True, "vocab_size": 130}),
    ("gpt_neo", "causal", 2, {}),  # global + local attention layers, tied
    ("gpt_neo", "causal", 4, {"vocab_size": 130}),
    ("opt", "causal", 2, {}),
    ("opt", "causal", 4, {"vocab_size": 130}),
    ("bert", "mlm", 2, {}),  # tied decoder weight and bias
    ("bert", "mlm", 4, {"vocab_size": 130}),
    ("bert", "seq_cls", 2, {}),
    ("roberta", "mlm", 2, {}),
    ("roberta", "tok_cls", 4, {}),
    ("t5", "s2s", 2, {}),  # relative attention bias, tied, scaled head
    ("t5", "s2s", 4, {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "vocab_size": 130}),
    ("llama", "seq_cls", 2, {}),
    ("mistral", "tok_cls", 4, {}),
]


def family_config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**TOKENS, **FAMILIES[model_type], **overrides})


def save_tiny_model(directory, config, task: str, seed: int = 0) -> str:
    """A tiny random model of `config` with its `task` head, written with `save_pretrained`."""
    torch.manual_seed(seed)
    model = AUTO[task].from_config(config)
    model.save_pretrained(directory)
    return str(directory)


def load_model(model_dir: str, task: str):
    model = AUTO[task].from_pretrained(model_dir, attn_implementation="eager").float()
    model.eval()  # no dropout: identical math on every rank
    return model


def make_inputs(config, task: str, batch: int = 2, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    """Padded inputs (left padding for decoders, right for encoders) and labels with -100 where ignored."""
    gen = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size
    input_ids = torch.randint(3, vocab, (batch, seq), generator=gen)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    if task in ("mlm", "s2s") or config.model_type in ("bert", "roberta"):
        attention_mask[0, -3:] = 0
    else:
        attention_mask[0, :3] = 0
    input_ids[attention_mask == 0] = config.pad_token_id
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if task == "causal":
        labels = input_ids.clone()
        labels[attention_mask == 0] = -100
        labels[:, seq // 2] = -100
    elif task == "mlm":
        labels = torch.full_like(input_ids, -100)
        chosen = (torch.rand(batch, seq, generator=gen) < 0.4) & (attention_mask == 1)
        labels[chosen] = input_ids[chosen]
    elif task == "seq_cls":
        labels = torch.randint(0, config.num_labels, (batch,), generator=gen)
    elif task == "tok_cls":
        labels = torch.randint(0, config.num_labels, (batch, seq), generator=gen)
        labels[attention_mask == 0] = -100
    else:  # s2s: decoder labels, shifted right by the model into decoder inputs
        labels = torch.randint(3, vocab, (batch, seq // 2), generator=gen)
        labels[0, -2:] = -100
    inputs["labels"] = labels
    return inputs


def full_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """The full logits of a parallel model (vocab-parallel heads gather theirs)."""
    from optimum_parallel.tensor_parallel import ColumnParallelLinear

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if isinstance(head, ColumnParallelLinear) and not head.gather_output and logits.shape[-1] != head.out_features:
        return head.gather(logits)
    return logits


def grad_err(actual: torch.Tensor, expected: torch.Tensor, module_scale: float) -> float:
    """max |actual - expected| relative to the largest gradient of the parameter's module (weight and bias).

    Equal to rel_err for all but analytically-zero gradients: a key-projection bias cannot change the
    softmax, so its fp32 gradient (~1e-10) is rounding noise, measured here on its layer's scale.
    """
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).abs().max() / max(module_scale, 1e-30)).item()


def compare_with_reference(reference, parallel, optimizer, batch) -> dict:
    """Logits, loss and every gradient now, then the loss over 3 AdamW steps; the worst errors."""
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    ref_out = reference(**batch)
    ref_out.loss.backward()
    out = parallel(**batch)
    out.loss.backward()
    errors = {
        "logits": rel_err(full_logits(parallel, out.logits), ref_out.logits),
        "loss": rel_err(out.loss, ref_out.loss),
    }
    ref_params = dict(reference.named_parameters())
    module_scale: dict[str, float] = {}
    for name, param in ref_params.items():
        if param.grad is not None:
            owner = name.rpartition(".")[0]
            module_scale[owner] = max(module_scale.get(owner, 0.0), param.grad.abs().max().item())
    grads, split = {}, 0
    for name, param in parallel.named_parameters():
        expected = ref_params[name].grad
        layout = getattr(param, "shard_layout", None)
        split += layout is not None and layout.dim is not None
        if expected is None or param.grad is None:
            assert expected is None and param.grad is None, f"{name}: gradient present on one side only"
            continue
        expected = layout.slice(expected) if layout is not None else expected
        grads[name] = grad_err(param.grad, expected, module_scale[name.rpartition(".")[0]])
    errors["worst_grad"] = max(grads.values())
    errors["worst_grad_name"] = max(grads, key=grads.get)
    errors["n_params"] = len(dict(parallel.named_parameters()))
    errors["n_ref_params"] = len(ref_params)
    errors["n_split"] = split
    errors["steps"] = worst_loss_over_steps(reference, parallel, ref_optimizer, optimizer, batch)
    return errors


def check_family(model_dir: str, task: str, tp: int, batch: dict, sequence_parallel: bool = False) -> dict:
    import optimum_parallel as op

    op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    reference = load_model(model_dir, task)
    parallel = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-2, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(parallel)
    parallel = parallelizer.parallelize(parallel, sequence_parallel_enabled=sequence_parallel)
    optimizer = parallelizer.optimizer_for_mp(optimizer, parallel.orig_param_to_parallel_param)
    errors = compare_with_reference(reference, parallel, optimizer, batch)
    errors["parallelizer"] = parallelizer.__name__
    return errors


def assert_matches(results: list[dict]) -> None:
    for rank, errors in enumerate(results):
        assert errors["n_params"] == errors["n_ref_params"], errors
        assert errors["n_split"] > 0, f"rank {rank}: nothing was split ({errors})"
        for key in ("logits", "loss", "worst_grad", "steps"):
            assert errors[key] <= TOL, f"rank {rank}: {key} relative error {errors[key]:.2e} ({errors})"


@pytest.mark.parametrize(
    "model_type,task,tp,overrides", CASES, ids=[f"{m}-{t}-tp{p}-{i}" for i, (m, t, p, _) in enumerate(CASES)]
)
def test_family_matches_single_device(pool, tmp_path, model_type, task, tp, overrides):
    config = family_config(model_type, **overrides)
    model_dir = save_tiny_model(tmp_path / model_type, config, task)
    results = pool.run(check_family, model_dir, task, tp, make_inputs(config, task))
    assert not results[0]["parallelizer"].startswith("AutoPlan"), "a hand-written parallelizer must be used"
    assert_matches(results)


# Families that declare sequence parallelism (the Llama plan's sequence-parallel regions).
SP_CASES = [
    ("qwen3", 2, {}),
    ("qwen3", 4, {"tie_word_embeddings": True}),
    ("gemma", 4, {"num_key_value_heads": 1}),
]


@pytest.mark.parametrize("model_type,tp,overrides", SP_CASES, ids=[f"{m}-sp-tp{t}" for m, t, _ in SP_CASES])
def test_family_sequence_parallel_matches_single_device(pool, tmp_path, model_type, tp, overrides):
    config = family_config(model_type, **overrides)
    model_dir = save_tiny_model(tmp_path / model_type, config, "causal")
    assert_matches(pool.run(check_family, model_dir, "causal", tp, make_inputs(config, "causal"), True))


# One config per family whose heads tp=4 cannot split.
BAD_HEADS = {
    "qwen3": ("causal", {"num_attention_heads": 2, "num_key_value_heads": 2}, "num_attention_heads=2"),
    "gemma": ("causal", {"num_attention_heads": 2, "num_key_value_heads": 1}, "num_attention_heads=2"),
    "gemma2": ("causal", {"num_attention_heads": 2, "num_key_value_heads": 2}, "num_attention_heads=2"),
    "phi3": ("causal", {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3}, "key_value_heads=3"),
    "mixtral": ("causal", {"num_attention_heads": 2, "num_key_value_heads": 1}, "num_attention_heads=2"),
    "qwen2_moe": ("causal", {"num_attention_heads": 2, "num_key_value_heads": 2}, "num_attention_heads=2"),
    "gpt2": ("causal", {"n_head": 2}, "n_head=2"),
    "gpt_neox": ("causal", {"num_attention_heads": 2}, "num_attention_heads=2"),
    "gpt_neo": ("causal", {"num_heads": 2}, "num_heads=2"),
    "opt": ("causal", {"num_attention_heads": 2}, "num_attention_heads=2"),
    "bert": ("mlm", {"num_attention_heads": 2}, "num_attention_heads=2"),
    "roberta": ("seq_cls", {"num_attention_heads": 2}, "num_attention_heads=2"),
    "t5": ("s2s", {"num_heads": 2}, "num_heads=2"),
}


def check_bad_heads_rejected(tp: int) -> dict[str, str | None]:
    """For every family: parallelize a model whose heads tp cannot split; the error, weights untouched."""
    import optimum_parallel as op

    op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    messages = {}
    for model_type, (task, overrides, _) in BAD_HEADS.items():
        torch.manual_seed(0)
        model = AUTO[task].from_config(family_config(model_type, **overrides))
        before = dict(model.named_parameters())
        try:
            op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
        except ValueError as err:
            assert all(p is before[n] for n, p in model.named_parameters()), f"{model_type}: weights moved"
            messages[model_type] = str(err)
        else:
            messages[model_type] = None
    return messages


def test_heads_tp_cannot_split_are_rejected_before_weights_move(pool):
    messages = pool.run(check_bad_heads_rejected, 4)[0]
    for model_type, (_, _, expected) in BAD_HEADS.items():
        assert messages[model_type] is not None, f"{model_type}: no error for heads tp=4 cannot split"
        assert expected in messages[model_type] and "tensor_parallel_size=4" in messages[model_type], messages


LAZY_CASES = [
    ("phi3", "causal", 4, {}),  # packed qkv (replicated kv parts) and gate_up read as slices
    # MoE checkpoints as transformers saves them, one tensor per expert: stacked per rank from the experts' slices
    ("mixtral", "causal", 2, {}),
    ("qwen2_moe", "causal", 2, {}),
    ("gpt2", "causal", 2, {}),  # Conv1D [in, out] and packed c_attn
    ("t5", "s2s", 2, {}),  # head-split relative attention bias, tied shared embedding
    ("bert", "mlm", 4, {}),  # tied MLM bias
]


def check_lazy_loading(cases: list[tuple[str, str, int, dict]], batches: list[dict]) -> dict[str, float]:
    """Each rank reads only its slices (lazy_load_for_parallelism): same parameters, same loss as a full load."""
    import optimum_parallel as op

    errors = {}
    for (model_dir, task, tp), batch in zip(cases, batches, strict=True):
        op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
        reference = load_model(model_dir, task)
        with op.lazy_load_for_parallelism(tensor_parallel_size=tp):
            model = AUTO[task].from_pretrained(model_dir, attn_implementation="eager")
        model.eval()
        model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
        ref_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            assert param.device.type != "meta", f"{model_dir}: {name} still on meta"
            layout = getattr(param, "shard_layout", None)
            expected = layout.slice(ref_params[name]) if layout is not None else ref_params[name]
            assert torch.equal(param.detach(), expected.detach()), f"{model_dir}: {name} differs"
        errors[model_dir] = rel_err(model(**batch).loss, reference(**batch).loss)
    return errors


def test_lazy_loading_reads_each_families_slices(pool, tmp_path):
    cases, batches = [], []
    for model_type, task, tp, overrides in LAZY_CASES:
        config = family_config(model_type, **overrides)
        cases.append((save_tiny_model(tmp_path / model_type, config, task), task, tp))
        batches.append(make_inputs(config, task))
    for errors in pool.run(check_lazy_loading, cases, batches):
        assert all(err <= TOL for err in errors.values()), errors
