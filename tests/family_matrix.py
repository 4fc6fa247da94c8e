"""The family matrix: tiny models built from transformers' own config classes for today's families, each run at
every layout against one process on the whole batch (loss, every gradient, the loss after 3 AdamW steps), or refused
before anything changes with one error naming the module that blocks it.

Shared by `tests/test_family_matrix.py` (a handful in `make test`), `tests/families/test_matrix.py` (the whole
matrix, `make test-families`) and `scripts/supported_models.py` (the README's table, from a run's results).

Every replica of the data-parallel dim gets the same batch (left padding, -100 labels), so the replicas' average is
the one-process gradient exactly. The tolerance is the contract's 1e-5, widened to twice a family's fp32 noise floor
where that is higher: the same one-process run from weights perturbed by a relative 1e-7.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
from test_expert_parallel_layouts import reference_slice, whole
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

WORLD_SIZE = 4
TOL = 1e-5
STEPS = 3
LR = 1e-3  # a fine-tuning rate: 1e-2 turns fp32 noise in near-zero gradients into visible loss differences
SEQ = 16

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE4 = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# DeepSeek-style routed experts: groups of experts, one shared expert, a dense first layer
GROUPED_MOE = dict(
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
    first_k_dense_replace=1,
)  # fmt: skip
MLA = dict(q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)

# model type -> tiny config overrides on BASE (hidden 64, 2 layers: one of each kind where a family mixes them)
FAMILIES: dict[str, dict] = {
    # hand-written families
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "gemma": {},
    "gpt_neox": {},  # fused per-head query_key_value, parallel residual
    "gemma2": dict(sliding_window=8, final_logit_softcapping=3.0, attn_logit_softcapping=2.0),
    "gemma3_text": dict(sliding_window=8),
    "phi3": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "qwen3_moe": dict(MOE4, mlp_only_layers=[]),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8),
    # automatic plans (transformers' base_model_tp_plan), what they support beyond tp derived from their structure
    "qwen3_5_text": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "qwen3_5_moe_text": dict(
        MOE4,
        shared_expert_intermediate_size=48,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "gemma4_text": dict(
        sliding_window=8, hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"]
    ),
    "llama4_text": dict(
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size=64,
        intermediate_size_mlp=96,
        interleave_moe_layer_step=1,
        attention_chunk_size=8,
        no_rope_layers=[1, 0],
    ),
    "deepseek_v3": dict(MLA, **GROUPED_MOE, q_lora_rank=16, head_dim=8, num_key_value_heads=4),
    "glm4_moe": dict(GROUPED_MOE),
    "glm4": {},
    "olmo3": dict(sliding_window=8),
    "olmoe": dict(MOE4, intermediate_size=64),
    "ministral3": {},
    "exaone4": dict(sliding_window=8),
    "smollm3": {},
    "seed_oss": {},
    "cohere2": dict(sliding_window=8),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1),
    "falcon_h1": dict(
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=8,
    ),  # fmt: skip
    "jamba": dict(
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
    ),  # fmt: skip
    "lfm2": dict(
        layer_types=["conv", "full_attention"], conv_L_cache=3, block_ff_dim=96, block_auto_adjust_ff_dim=False
    ),
    "qwen3_next": dict(
        MOE4,
        shared_expert_intermediate_size=48,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "kimi_linear": dict(
        MOE4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        linear_head_dim=16,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        num_local_experts=4,
    ),
    "hunyuan_v1_dense": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),  # MLP with a layer_idx
    "apertus": {},  # xIELU activations: learnable scalars beside a split MLP
    "longcat_flash": dict(  # MLA, identity ("zero") experts beside routed ones, two attention blocks a layer
        num_key_value_heads=4,
        num_hidden_layers=4,  # two layers: its config derives num_hidden_layers as 2 x num_layers
        ffn_hidden_size=96,
        expert_ffn_hidden_size=32,
        n_routed_experts=4,
        zero_expert_num=2,
        moe_topk=2,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
    ),
    "minimax": dict(  # lightning attention (a linear recurrence with per-head decay) beside softmax attention
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        layer_types=["linear_attention", "full_attention"],
        block_size=8,
    ),
    "bamba": dict(
        attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8
    ),
    "granitemoehybrid": dict(
        intermediate_size=32,
        shared_intermediate_size=48,
        layer_types=["mamba", "attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=8,
    ),
    "deepseek_v4": dict(  # shared-kv attention with a compressor (CSA: its indexer picks 2 of 4 entries; HCA), sinks,
        # a grouped low-rank output, hyper-connections, routed and shared experts
        num_key_value_heads=1,
        moe_intermediate_size=32,
        q_lora_rank=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        sliding_window=8,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["moe", "moe"],  # hash routing reads a table of zeros in a fresh model: no gradient to check
        num_nextn_predict_layers=0,
        hc_mult=2,
        hc_sinkhorn_iters=3,
    ),
}
MOE_TYPES = {
    "mixtral", "qwen3_moe", "gpt_oss", "qwen3_5_moe_text", "llama4_text", "deepseek_v3", "glm4_moe", "olmoe",
    "granitemoe", "phimoe", "ernie4_5_moe", "jamba", "qwen3_next", "kimi_linear", "granitemoehybrid", "minimax",
    "longcat_flash", "deepseek_v4", "qwen3_vl_moe", "qwen3_5_moe",
}  # fmt: skip

# layout -> mesh sizes over 4 ranks and how it is asked for
LAYOUTS: dict[str, dict] = {
    "tp2+sp": dict(mesh=dict(dp=2, tp=2), sequence_parallel=True),
    "pp2": dict(mesh=dict(dp=2, pp=2), microbatches=2),
    "cp2": dict(mesh=dict(dp=2, cp=2)),
    "ep2": dict(mesh=dict(dp=4, ep=2)),
    "tp2xdp2-L3": dict(mesh=dict(dp=2, tp=2), level=3),
}


# vision-language models: tiny configs and image batches of tests/_vlm.py (images and image tokens that match)
VLM_TYPES = ("llava", "gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")


def layouts_for(model_type: str) -> list[str]:
    """The layouts the matrix runs for `model_type` (ep only for a MoE)."""
    return [name for name in LAYOUTS if name != "ep2" or model_type in MOE_TYPES]


def model_types() -> list[str]:
    """Every family of the matrix: the text families, then the vision-language models."""
    return [*FAMILIES, *VLM_TYPES]


def family_config(model_type: str):
    if model_type in VLM_TYPES:
        from _vlm import TINY_VLM_CONFIGS

        return TINY_VLM_CONFIGS[model_type]()
    return AutoConfig.for_model(model_type, **{**BASE, **FAMILIES[model_type]})


def build(config, seed: int = 0):
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if config.model_type in VLM_TYPES else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="eager").float()
    model.eval()  # no dropout: identical math on every rank
    gen = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():  # biases and norm offsets initialised to zero would check nothing on the first step
        for param in model.parameters():
            if not param.any():
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    return model


def batch_for(config, rows: int = 2) -> dict[str, torch.Tensor]:
    """An image-text batch for a VLM (_vlm.make_vlm_inputs: images, their tokens, padding, -100 labels); else
    left-padded rows (uneven token counts) with -100 on padding and one more position each. The first real token
    after the padding is predicted from a padding position, whose output no model defines alike (transformers
    attends it to masked keys, ring attention to none): its label is ignored too."""
    if config.model_type in VLM_TYPES:
        from _vlm import make_vlm_inputs

        return make_vlm_inputs(config, batch=rows)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, config.vocab_size, (rows, SEQ), generator=gen)
    attention_mask = torch.ones(rows, SEQ, dtype=torch.long)
    attention_mask[0, :3] = 0
    input_ids[attention_mask == 0] = config.pad_token_id
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, 3] = -100
    labels[1, SEQ // 2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _err(actual: torch.Tensor, expected: torch.Tensor, scale: float) -> float:
    return ((actual.detach().double() - expected.detach().double()).abs().max() / max(scale, 1e-30)).item()


def _module_scales(model) -> dict[str, float]:
    """The largest gradient of each module (weight and bias): a gradient's error is measured on its module's scale
    (a key projection's bias has an analytically-zero gradient whose fp32 value is rounding noise)."""
    scales: dict[str, float] = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            owner = name.rpartition(".")[0]
            scales[owner] = max(scales.get(owner, 0.0), param.grad.abs().max().item())
    return scales


def _step(model, optimizer, batch, pipeline: bool) -> torch.Tensor:
    loss = model.run_train(**batch) if pipeline else model(**batch).loss
    if not pipeline:
        loss.backward()
    return loss


def noise_floor(model_type: str, config=None) -> dict[str, float]:
    """The errors of one process against itself from weights perturbed by a relative 1e-7 (loss, worst gradient,
    loss over the steps): fp32's noise floor for this family's tiny model (`config`: a variant of it)."""
    config = config or family_config(model_type)
    reference, perturbed = build(config), build(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.mul_(1 + 1e-7 * torch.randn(param.shape, generator=gen))
    return _compare(reference, perturbed, None, batch_for(config), pipeline=False)


def _compare(reference, model, optimizer, batch, pipeline: bool, per_parameter: bool = False) -> dict:
    """Loss and every gradient now, then the loss over STEPS AdamW steps, against `reference` on the same batch
    (`per_parameter`: every gradient's error too, under "grads")."""
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    loss = _step(model, optimizer, batch, pipeline)
    scales = _module_scales(reference)
    expected = dict(reference.named_parameters())
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None and expected[name].grad is None:
            continue
        if param.grad is None or expected[name].grad is None:
            raise AssertionError(f"{name}: a gradient on one side only")
        scale = scales[name.rpartition(".")[0]]
        actual, wanted = whole(param.grad), reference_slice(param, expected[name].grad)
        if actual.shape != wanted.shape:
            raise AssertionError(
                f"{name}: gradient of shape {tuple(actual.shape)}, this rank's slice {tuple(wanted.shape)}"
            )
        grads[name] = _err(actual, wanted, scale)
    errors: dict = {"loss": _err(loss, ref_loss, ref_loss.abs().item())}
    if per_parameter:
        errors["grads"] = dict(grads)
    errors["grad"] = max(grads.values())
    errors["worst"] = max(grads, key=grads.get)
    steps = []
    for _ in range(STEPS):
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        loss = _step(model, optimizer, batch, pipeline)
        steps.append(_err(loss, ref_loss, ref_loss.abs().item()))
    errors["steps"] = max(steps)
    return errors


def held_fraction(model, reference) -> float:
    """This rank's parameter elements over the one-process model's (0.5 at tp=2 is every weight split)."""
    return sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in reference.parameters())


def check_layout(model_type: str, layout: str, config=None, spec: dict | None = None) -> dict:
    """One family at one layout on this rank: {'errors', 'held'} or {'refused': the message, 'untouched': bool}.
    `config` / `spec`: a variant of the family's tiny config, a layout outside `LAYOUTS` (a dedicated test's)."""
    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training

    spec = spec or LAYOUTS[layout]
    mesh = op.init_mesh(**spec["mesh"], timeout=60)  # a failing rank ends the cell instead of waiting 10 minutes
    config = config or family_config(model_type)
    reference = build(config)
    model = copy.deepcopy(reference)
    before = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    held = None
    try:
        if mesh.size("tp") > 1 or mesh.size("pp") > 1 or mesh.size("cp") > 1:
            parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
            model = parallelizer.parallelize(
                model,
                sequence_parallel_enabled=spec.get("sequence_parallel", False),
                pipeline_parallel_num_microbatches=spec.get("microbatches", 1),
            )
            optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
            if mesh.size("tp") > 1:
                held = held_fraction(model, reference)
        if mesh.size("ep") > 1:  # the experts split over ep by `op.parallelize`, with data parallelism
            model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
        else:
            level = op.DataParallelConfig(spec.get("level", 0))
            model, optimizer = compose_training(model, optimizer, mesh, {}, level)
    except (NotImplementedError, ValueError) as err:
        untouched = all(p is before[n] for n, p in model.named_parameters())
        return {"refused": f"{type(err).__name__}: {err}", "untouched": untouched}
    errors = _compare(reference, model, optimizer, batch_for(config), pipeline=mesh.size("pp") > 1)
    return {"errors": errors, "held": held}


def tolerance(floor: dict[str, float]) -> float:
    """The contract's 1e-5, or twice the family's noise floor where that is higher (one perturbation draws one
    sample of the floor; Gemma 4's k/v norms over small random keys put it near 1e-3)."""
    return max(TOL, 2 * max(floor["loss"], floor["grad"], floor["steps"]))


def verdict(results: list[dict], floor: dict[str, float]) -> tuple[str, str]:
    """('equal' | 'refused' | 'FAILED', detail) from every rank's result."""
    if all("refused" in r for r in results):
        messages = {r["refused"] for r in results}
        detail = messages.pop()
        if messages:
            return "FAILED", f"ranks refused differently: {detail}"
        if not all(r["untouched"] for r in results):
            return "FAILED", f"refused after changing the model: {detail}"
        return "refused", detail
    if any("refused" in r for r in results):
        return "FAILED", "some ranks refused: " + next(r["refused"] for r in results if "refused" in r)
    tol = tolerance(floor)
    errors = max((r["errors"] for r in results), key=lambda e: max(e["loss"], e["grad"], e["steps"]))
    worst = max(errors["loss"], errors["grad"], errors["steps"])
    detail = f"worst {worst:.1e} (tol {tol:.1e})"
    if worst > tol:
        detail += (
            f": loss {errors['loss']:.1e}, grad {errors['grad']:.1e} ({errors['worst']}), steps {errors['steps']:.1e}"
        )
    return ("equal" if worst <= tol else "FAILED"), detail


def record(path: Path, model_type: str, layout: str, outcome: str, detail: str, held: float | None) -> None:
    """Append one cell to a results file (JSON lines) that `scripts/supported_models.py` reads."""
    with open(path, "a") as out:
        out.write(json.dumps({"type": model_type, "layout": layout, "outcome": outcome, "detail": detail, "held": held})
                  + "\n")  # fmt: skip


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
