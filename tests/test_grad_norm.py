"""`op.grad_norm` / `op.clip_grad_norm_` on every layout equal torch's on the single-device model (gloo, 4 ranks).

Every dp replica trains on the same batch (padding and -100 labels), so the averaged gradient is the reference's
gradient on that batch whatever the loss weighting: what is tested is that each distinct gradient piece (tp shards,
kv heads replicated over tp, pipeline stages, a tied embedding on two stages, FSDP shards, dp and cp copies) counts
exactly once.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _checks import TOL
from _models import build_model, make_batch, rel_err, tiny_config

LAYOUTS = {
    # name: (mesh sizes, model type, config overrides, Parallelizer options, sharding level or None, LoRA)
    "tp4-kv-replicated": ({"tp": 4}, "llama", {}, {}, None, False),
    "tp4-packed-qkv-kv-replicated": ({"tp": 4}, "phi3", {"pad_token_id": 0}, {}, None, False),
    "dp2-tp2-sp-tied": ({"dp": 2, "tp": 2}, "llama", {"tie_word_embeddings": True}, {"sp": True}, 0, False),
    "dp2-tp2-level1": ({"dp": 2, "tp": 2}, "llama", {}, {}, 1, False),
    "dp2-tp2-level2": ({"dp": 2, "tp": 2}, "llama", {}, {}, 2, False),
    "dp2-tp2-level3": ({"dp": 2, "tp": 2}, "llama", {}, {}, 3, False),
    "dp2-tp2-level2-packed-qkv-kv-replicated": (
        {"dp": 2, "tp": 2},
        "phi3",
        {"pad_token_id": 0, "num_key_value_heads": 1},
        {},
        2,
        False,
    ),
    "pp2-tp2-tied": ({"pp": 2, "tp": 2}, "llama", {"tie_word_embeddings": True}, {"pp": True}, None, False),
    "dp2-pp2-level2-tied": ({"dp": 2, "pp": 2}, "llama", {"tie_word_embeddings": True}, {"pp": True}, 2, False),
    "cp2-tp2": ({"cp": 2, "tp": 2}, "llama", {}, {}, 0, False),
    "dp2-tp2-lora": ({"dp": 2, "tp": 2}, "llama", {}, {}, 0, True),
}


def _lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(5)
    return get_peft_model(model, config)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def check_norms(name: str) -> dict:
    import optimum_parallel as op
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    sizes, model_type, overrides, options, level, lora = LAYOUTS[name]
    mesh = op.init_mesh(**sizes)
    layers = 4 if options.get("pp") else 2
    config = tiny_config(model_type, num_hidden_layers=layers, **overrides)
    reference = build_model(config)
    if lora:
        reference = _lora(reference)
    model = copy.deepcopy(reference)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(
        model,
        sequence_parallel_enabled=options.get("sp", False),
        pipeline_parallel_num_microbatches=2 if options.get("pp") else 1,
    )
    if level is not None:
        model, _ = apply_data_parallel(model, None, mesh, DataParallelConfig(level))
    batch = make_batch(config, batch=4)
    batch["labels"][0, 3] = -100  # the first token after left padding: its query row sees only padding

    reference(**batch).loss.backward()
    if options.get("pp"):
        model.run_train(**batch)
    else:
        model(**batch).loss.backward()

    ref_grads = [p.grad for p in reference.parameters() if p.grad is not None]
    results = {
        "norm": rel_err(op.grad_norm(model), torch.nn.utils.get_total_norm(ref_grads)),
        "inf": rel_err(op.grad_norm(model, math.inf), torch.nn.utils.get_total_norm(ref_grads, math.inf)),
        "l1": rel_err(op.grad_norm(model, 1), torch.nn.utils.get_total_norm(ref_grads, 1)),
    }
    max_norm = torch.nn.utils.get_total_norm(ref_grads).item() / 4
    before = op.clip_grad_norm_(model, max_norm)
    ref_before = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    results["clip_returns"] = rel_err(before, ref_before)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    clipped = [0.0]
    for param_name, param in model.named_parameters():
        if param.grad is None:
            continue
        layout = getattr(param, "shard_layout", None)
        expected = ref_params[param_name].grad
        clipped.append(rel_err(_whole(param.grad), layout.slice(expected) if layout is not None else expected))
    results["clipped_grads"] = max(clipped)
    results["counted_params"] = len(clipped) - 1
    return results


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_norm_and_clipping_equal_one_device(pool, name):
    for rank, result in enumerate(pool.run(check_norms, name)):
        errors = {k: v for k, v in result.items() if k != "counted_params"}
        assert max(errors.values()) <= TOL, f"rank {rank}: {result}"
        assert result["counted_params"] > 0, f"rank {rank}: {result}"


def test_single_process_equals_torch():
    """No mesh, one process: torch's own norm (a model that was never parallelized)."""
    import optimum_parallel as op

    config = tiny_config("llama")
    model, reference = build_model(config), build_model(config)
    batch = make_batch(config)
    for m in (model, reference):
        m(**batch).loss.backward()
    assert rel_err(op.clip_grad_norm_(model, 0.1), torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)) <= TOL
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) <= TOL


@pytest.mark.parametrize("norm_type", [0, -1, "2", True])
def test_bad_norm_type_names_the_key(norm_type):
    import optimum_parallel as op

    with pytest.raises(ValueError, match="norm_type"):
        op.grad_norm(build_model(tiny_config("llama")), norm_type)
