"""The current mixture-of-experts families (and the families whose automatic plans needed a translation of their own)
against the real single-device transformers model on the whole batch (gloo, 4 ranks): tp=2 (x dp=2), ep=2 (x dp=4)
and tp=2 x ep=2 (x dp=2) at sharding level 0: the loss, every gradient (each slice against the single-device one,
on its module's scale), the global gradient norm and the loss over 3 AdamW steps. Each replica trains its own rows,
left-padded and with -100 labels. A layout a family's structure cannot take must be refused with a message naming
the module that blocks it (`REFUSED`).

`TINY_CONFIGS` (the tiny config kwargs per model type, from transformers' own config classes: hidden 64, 2 layers,
4 experts top-2, vocab 128) is imported by the family matrix.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _models import rel_err
from test_expert_parallel_layouts import labelled, reference_slice, replica_mean, uneven_batch, whole
from test_families import grad_err

WORLD_SIZE = 4
TOL = 1e-5

_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Multi-head latent attention (DeepSeek-V3's): 4 heads of 8 + 8 (no rope | rope), values 16, a 32-wide kv latent
_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4)
# DeepSeek sparse attention (deepseek_v32, glm_moe_dsa, axk2): an indexer of 2 heads picks 8 of the 16 keys
_DSA = dict(index_topk=8, index_head_dim=16, index_n_heads=2)
_DEEPSEEK_MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
# deepseek_v32 and glm_moe_dsa: the same MLA, sparse-attention indexer and grouped experts
_SPARSE_ATTENTION_MOE = (
    dict(
        _BASE,
        intermediate_size=96,
        **_DEEPSEEK_MOE,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=24,
        **_DSA,
    )
    | _MLA
)

TINY_CONFIGS: dict[str, dict] = {
    # shared expert + routed experts fed the sigmoid-scored inputs, expert-major (ep exchanges every token's rows of
    # each rank's experts); chunked attention, no-rope layers, qk L2 norm
    "llama4_text": dict(
        _BASE,
        intermediate_size=48,
        intermediate_size_mlp=96,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_layers=[0],  # layer 1 keeps a dense MLP
        no_rope_layers=[1, 0],  # layer 1 takes no rope (and no qk norm)
        attention_chunk_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "apertus": dict(_BASE, intermediate_size=96, head_dim=16),  # xIELU with learnable alpha_p / alpha_n
    "doge": dict(_BASE, intermediate_size=96),
    "longcat_flash": dict(
        _BASE,
        num_layers=1,  # each layer holds two attention + MLP sub-blocks
        ffn_hidden_size=96,
        expert_ffn_hidden_size=32,
        n_routed_experts=4,
        zero_expert_num=2,
        moe_topk=2,
        q_lora_rank=24,
        **_MLA,
    ),
    "deepseek_v3": dict(
        _BASE, intermediate_size=96, **_DEEPSEEK_MOE, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24
    )
    | _MLA,
    "glm4_moe_lite": dict(_BASE, intermediate_size=96, **_DEEPSEEK_MOE, n_group=1, topk_group=1, q_lora_rank=24) | _MLA,
    "ernie4_5_moe": dict(
        _BASE,
        intermediate_size=96,
        moe_intermediate_size=32,
        moe_num_experts=4,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    ),
    "qwen3_5_moe_text": dict(
        _BASE,
        head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    ),
    "glm4_moe": dict(
        _BASE, intermediate_size=96, **_DEEPSEEK_MOE, n_group=1, topk_group=1, first_k_dense_replace=1, head_dim=16
    ),
    "minimax": dict(
        _BASE,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        block_size=8,
        layer_types=["linear_attention", "full_attention"],
    ),
    "minimax_m2": dict(_BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "hunyuan_v1_moe": dict(_BASE, intermediate_size=32, num_experts=4, moe_topk=2, head_dim=16),
    "dots1": dict(_BASE, intermediate_size=96, **_DEEPSEEK_MOE, first_k_dense_replace=1, head_dim=16),
    "flex_olmo": dict(_BASE, intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(
        _BASE, intermediate_size=96, **_DEEPSEEK_MOE, first_k_dense_replace=1, q_lora_rank=24, topk_method="greedy"
    )
    | _MLA,
    "minicpm3": dict(_BASE, intermediate_size=96, q_lora_rank=24, **{**_MLA, "head_dim": 16}),
    "deepseek_v32": dict(_SPARSE_ATTENTION_MOE),
    "glm_moe_dsa": dict(_SPARSE_ATTENTION_MOE),
    "axk2": dict(
        _BASE,
        intermediate_size=96,
        **_DEEPSEEK_MOE,
        first_k_dense_replace=1,
        q_lora_rank=24,
        **_DSA,
        gated_norm_rank=4,
    )
    | _MLA,
    "aria_text": dict(
        _BASE, intermediate_size=32, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, head_dim=16
    ),  # Llama 4's transposed [E, in, out] experts, fed as transformers' routed contract
}

LAYOUTS = {"tp2": dict(dp=2, tp=2), "ep2": dict(dp=4, ep=2), "tp2xep2": dict(dp=2, tp=2, ep=2)}


def family_config(model_type: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], **overrides})


def build(model_type: str, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = family_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():  # parameters transformers initialises to constants get random values, so each is checked
        gen = torch.Generator().manual_seed(5)
        for name, param in model.named_parameters():
            if param.dim() <= 1 and not name.endswith("norm.weight") and param.unique().numel() == 1:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    for param in model.parameters():  # as from_pretrained leaves them: ERNIE's e_score_correction_bias trainable too
        param.requires_grad_(True)
    model.eval()  # no dropout: identical math on every rank
    return model


def parallel_model(model_type: str, sizes: dict, overrides: dict, level: int = 0):
    """The reference, and its copy made parallel over `sizes` (tp through the automatic plan, then ep and dp at
    sharding level 0) with its AdamW."""
    import optimum_parallel as op

    mesh = op.init_mesh(**sizes)
    reference = build(model_type, **overrides)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if mesh.tp_size > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})
    return mesh, reference, model, optimizer


def check_layout(model_type: str, sizes: dict, overrides: dict | None = None, steps: int = 3, level: int = 0) -> dict:
    """This rank's errors against one process on the whole batch (and the noise floor of the losses after AdamW
    steps), the share of the model's elements it holds, or {"refused": message}."""
    import optimum_parallel as op

    try:
        mesh, reference, model, optimizer = parallel_model(model_type, sizes, overrides or {}, level)
    except (ValueError, TypeError, NotImplementedError) as err:
        return {"refused": f"{type(err).__name__}: {err}"}
    nudged = copy.deepcopy(reference)  # the fp32 noise floor: one process from weights perturbed by relative 1e-7
    with torch.no_grad():
        gen = torch.Generator().manual_seed(9)
        for param in nudged.parameters():
            param.mul_(1 + 1e-7 * torch.randn(param.shape, generator=gen))
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    nudged_optimizer = torch.optim.AdamW(nudged.parameters(), lr=1e-2, weight_decay=0.1)
    floors = {}
    replicas, replica = mesh.data_parallel_size, mesh.data_parallel_rank
    config = reference.config
    batch = uneven_batch(config, 2 * replicas)
    local = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
    share = torch.tensor(labelled(batch["labels"]) / replicas)  # each replica: token sum / (global count / replicas)
    ref_params = dict(reference.named_parameters())
    errors: dict[str, float] = {}
    for step in range(steps + 1):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        loss = model(**local, num_items_in_batch=share).loss
        loss.backward()
        errors[f"loss {step}"] = rel_err(replica_mean(loss, mesh), ref_loss)
        nudged_loss = nudged(**batch).loss
        nudged_loss.backward()
        floors[f"loss {step}"] = rel_err(nudged_loss, ref_loss)
        if step == 0:
            scale: dict[str, float] = {}
            for name, param in ref_params.items():
                if param.grad is not None:
                    owner = name.rpartition(".")[0]
                    scale[owner] = max(scale.get(owner, 0.0), param.grad.abs().max().item())
            for name, param in model.named_parameters():
                expected = ref_params[name].grad
                if expected is None or param.grad is None:
                    assert expected is None and param.grad is None, f"{name}: gradient on one side only"
                    continue
                errors[f"grad {name}"] = grad_err(
                    whole(param.grad), reference_slice(param, expected), scale[name.rpartition(".")[0]]
                )
            ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
            errors["grad_norm"] = rel_err(op.grad_norm(model), ref_norm)
        for opt in (ref_optimizer, optimizer, nudged_optimizer):
            opt.step()
            opt.zero_grad()
    split = sum(
        getattr(p, "shard_layout", None) is not None or getattr(p, "expert_layout", None) is not None
        for p in model.parameters()
    )
    held = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in reference.parameters())
    return {"errors": errors, "floors": floors, "split": split, "params": len(ref_params), "held": held}


def tolerance(result: dict, key: str) -> float:
    """1e-5, or for the loss after AdamW steps 10x the fp32 noise floor where that is higher (AdamW's first updates,
    lr x sign, flip with gradient elements that cancel to ~1e-9)."""
    return max(TOL, 10 * result["floors"].get(key, 0.0))


def beyond_tolerance(results: list[dict]) -> dict[str, float]:
    return {k: v for r in results for k, v in r["errors"].items() if v > tolerance(r, k)}


def summary(results: list[dict]) -> str:
    """`equal (max error)`, `refused (message)` or `DIFFERS (quantities beyond tolerance)` over every rank."""
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:
        return f"refused ({refused[0]})"
    bad = beyond_tolerance(results)
    if bad:
        return f"DIFFERS ({', '.join(f'{k}: {v:.1e}' for k, v in sorted(bad.items(), key=lambda kv: -kv[1])[:4])})"
    worst = max(v for r in results for v in r["errors"].values())
    floor = max(v for r in results for v in r["floors"].values())
    held = max(r["held"] for r in results)
    return f"equal ({worst:.1e}; noise floor {floor:.1e}; held {held:.2f})"


# What each family's structure allows (every other layout of TINY_CONFIGS x LAYOUTS must equal one process).
REFUSED = {
    # gate_up_proj holds the identity experts' slices too: no one expert dim to split
    ("longcat_flash", "ep2"): "'model.layers.0.mlp.experts' (LongcatFlashExperts:",
    ("longcat_flash", "tp2xep2"): "(LongcatFlashExperts:",
    ("apertus", "ep2"): "ApertusForCausalLM has no stacked experts module",
    ("apertus", "tp2xep2"): "ApertusForCausalLM has no stacked experts module",
    ("minicpm3", "ep2"): "MiniCPM3ForCausalLM has no stacked experts module",
    ("minicpm3", "tp2xep2"): "MiniCPM3ForCausalLM has no stacked experts module",
    # KNOWN_BAD_PLANS: its dt_proj mixes every kv head into each head's mask gate
    ("doge", "tp2"): "model type 'doge' is not supported",
    ("doge", "tp2xep2"): "model type 'doge' is not supported",
    ("doge", "ep2"): "DogeForCausalLM has no stacked experts module",
}
# Beyond this module's tolerance at tp=2 (no longer a crash: the gated q_proj's heads are counted by share now): the
# delta net's A_log / dt_bias gradients differ by 1.1e-5 / 1.9e-5 relative, against a 1e-5 floor here, where the
# mixers' own checks (tests/families/test_hybrid_families.py) measure their fp32 noise floor at 1e-4..1e-3
BROKEN = {("qwen3_5_moe_text", "tp2"), ("qwen3_5_moe_text", "tp2xep2")}
CASES = [(family, layout) for family in TINY_CONFIGS for layout in LAYOUTS]


def _marks(case: tuple[str, str]) -> list:
    if case in BROKEN:
        return [pytest.mark.xfail(reason="delta net A_log / dt_bias gradients 1-2e-5 over the tolerance", strict=True)]
    return []


@pytest.mark.parametrize(
    "family,layout", [pytest.param(*case, marks=_marks(case)) for case in CASES], ids=[f"{f}-{lay}" for f, lay in CASES]
)
def test_family_layout_equals_one_process_or_is_refused_by_name(pool, family, layout):
    results = pool.run(check_layout, family, LAYOUTS[layout])
    expected = REFUSED.get((family, layout))
    if expected is not None:
        messages = {r.get("refused", "not refused") for r in results}
        assert len(messages) == 1 and expected in next(iter(messages)), messages  # the same error on every rank
        return
    for rank, result in enumerate(results):
        assert "refused" not in result, f"rank {rank}: {result['refused']}"
        assert not beyond_tolerance([result]), f"rank {rank}: {beyond_tolerance([result])}"
        assert result["held"] < 0.9 and result["split"] > 0, f"rank {rank}: held {result['held']:.2f} of the model"


def test_translations_of_the_families_refused_before():
    """llama4_text, apertus, longcat_flash and the MLA families translate; colwise expert tensors beside no packed
    gate|up (nemotron_h's up_proj) stay untranslated (one process, no model built)."""
    from optimum_parallel.frontends.auto_plan import auto_parallelizer, tp_plan_of, unsupported_entries

    for model_type in ("llama4_text", "apertus", "longcat_flash", "glm4_moe_lite", "deepseek_v2", "minicpm3"):
        assert auto_parallelizer(model_type) is not None, model_type
    assert unsupported_entries(tp_plan_of("nemotron_h")) == {"layers.*.mixer.experts.up_proj": "colwise"}
    assert auto_parallelizer("doge") is None
