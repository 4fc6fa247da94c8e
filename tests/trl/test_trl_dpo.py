"""TRL's DPOTrainer on a parallel model: ParallelDPOTrainer at tp=2, tp=2 + sp, cp=2 and pp=2 logs, step by step, the
loss, rewards, log-probabilities and the other metrics TRL's DPOTrainer logs on one process (sigmoid, ipo, apo_zero;
Llama and Qwen3, and at cp=2 a Qwen3.5 hybrid; a reference loaded in parallel, precomputed, or a LoRA policy's base);
the options a layout cannot run and a dataset without chosen / rejected are refused on every rank before any step
(gloo, 2 ranks). dp=2 x tp=2 at sharding level 3, dp=2 x cp=2 and pp=2 x tp=2: test_trl_dpo_dp.py."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import (  # noqa: E402
    check_against,
    noise_floor,
    perturbed_copy,
    save_tiny,
    train_parallel_dpo,
    trl_reference,
)

WORLD_SIZE = 2
TOL = 1e-5  # relative, per step and metric, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)

TP2 = {"tensor_parallel_size": 2}
SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
CP2 = {"context_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 2}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: save_tiny(tmp_path_factory.mktemp("hf") / name, name) for name in ("llama", "qwen3", "qwen3_5_text")}


@pytest.fixture(scope="module")
def reference(hf_dirs, tmp_path_factory):
    """TRL's DPOTrainer on one process, each (model, options) trained once: its metrics per step, and their fp32
    noise floor (the same run from weights perturbed by relative 1e-7)."""
    done: dict[tuple, tuple] = {}
    perturbed = {
        name: perturbed_copy(path, tmp_path_factory.mktemp("perturbed") / name) for name, path in hf_dirs.items()
    }

    def run(model_type: str, **options) -> tuple[dict, dict]:
        key = (model_type, repr(sorted(options.items())))
        if key not in done:
            expected = trl_reference(hf_dirs[model_type], str(tmp_path_factory.mktemp("ref")), **options)
            moved = trl_reference(perturbed[model_type], str(tmp_path_factory.mktemp("ref")), **options)
            done[key] = expected, noise_floor(expected, moved)
            print("noise", model_type, options, {k: f"{v:.1e}" for k, v in done[key][1].items()})
        return done[key]

    return run


def lora():
    from peft import LoraConfig

    # random A and B: the policy differs from its base (the reference) from the first step
    targets = ["q_proj", "v_proj", "down_proj"]
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)


CASES = {
    "tp2-sigmoid": ("llama", {}, TP2),
    "sp-sigmoid": ("llama", {}, SP),
    "cp2-sigmoid": ("llama", {}, CP2),
    "tp2-ipo": ("llama", {"loss_type": ["ipo"]}, TP2),
    "cp2-ipo": ("llama", {"loss_type": ["ipo"]}, CP2),
    "sp-apo_zero": ("llama", {"loss_type": ["apo_zero"]}, SP),
    "cp2-apo_zero": ("llama", {"loss_type": ["apo_zero"]}, CP2),
    "pp2-sigmoid": ("llama", {}, PP2),
    "pp2-ipo": ("llama", {"loss_type": ["ipo"]}, PP2),
    "pp2-apo_zero": ("llama", {"loss_type": ["apo_zero"]}, PP2),
    "qwen3-tp2-sigmoid": ("qwen3", {}, TP2),
    "qwen3-pp2-sigmoid": ("qwen3", {}, PP2),
    "qwen3-cp2-sigmoid": ("qwen3", {}, CP2),
    "qwen3_5_text-cp2-sigmoid": ("qwen3_5_text", {}, CP2),  # a gated delta net layer, then an attention layer
    "tp2-precomputed-reference": ("llama", {"precompute_ref_log_probs": True}, TP2),
    "cp2-precomputed-reference": ("llama", {"precompute_ref_log_probs": True}, CP2),
    "pp2-precomputed-reference": ("llama", {"precompute_ref_log_probs": True}, PP2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_matches_trl_on_one_process(pool, hf_dirs, reference, tmp_path, case):
    model_type, options, layout = CASES[case]
    expected, noise = reference(model_type, **options)
    results = pool.run(train_parallel_dpo, hf_dirs[model_type], str(tmp_path), options, layout)
    for rank, got in enumerate(results):
        worst = check_against(got, expected, noise, TOL)
        print(case, rank, {k: f"{v:.1e}" for k, v in worst.items()})


@pytest.mark.parametrize("layout", [TP2, CP2, PP2], ids=["tp2", "cp2", "pp2"])
def test_evaluation_matches_trl_on_one_process(pool, hf_dirs, tmp_path, tmp_path_factory, layout):
    expected = trl_reference(hf_dirs["llama"], str(tmp_path_factory.mktemp("ref")), evaluate=True)
    assert "loss" in expected[1] and "rewards/margins" in expected[1], expected
    noise = dict.fromkeys(expected[1], 0.0)
    for rank, got in enumerate(pool.run(train_parallel_dpo, hf_dirs["llama"], str(tmp_path), {}, layout, True)):
        worst = check_against(got, expected, noise, TOL)
        print("evaluate", layout, rank, {k: f"{v:.1e}" for k, v in worst.items()})


def train_lora_dpo(hf_dir: str, output_dir: str, layout: dict) -> dict:
    return train_parallel_dpo(hf_dir, output_dir, {"peft_config": lora()}, layout)


@pytest.mark.parametrize("layout", [TP2, CP2], ids=["tp2", "cp2"])
def test_lora_policy_with_its_base_as_reference(pool, hf_dirs, reference, tmp_path, layout):
    expected, noise = reference("llama", peft_config=lora())
    for rank, got in enumerate(pool.run(train_lora_dpo, hf_dirs["llama"], str(tmp_path), layout)):
        worst = check_against(got, expected, noise, TOL)
        print("lora", rank, {k: f"{v:.1e}" for k, v in worst.items()})


def refused(hf_dir: str, output_dir: str, option: dict, layout: dict, dataset_rows=None) -> str:
    from _dpo import dpo_args, preference_dataset
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelDPOConfig, ParallelDPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    dataset = preference_dataset(tokenizer.vocab_size)
    if dataset_rows is not None:
        from datasets import Dataset

        dataset = Dataset.from_list(dataset_rows)
    try:
        args = ParallelDPOConfig(**dpo_args(output_dir, **option, **layout))
        ParallelDPOTrainer(hf_dir, args=args, train_dataset=dataset, processing_class=tokenizer)
    except (ValueError, KeyError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    "option,layout,words",
    [
        (PP2, CP2, "pipeline_parallel_size=2 with context_parallel_size=2"),
        ({"sync_ref_model": True}, TP2, "sync_ref_model=True"),
        ({"use_liger_kernel": True}, TP2, "use_liger_kernel=True"),
    ],
    ids=["pp-with-cp", "sync_ref_model", "liger"],
)
def test_options_a_layout_cannot_run_are_refused_by_name(pool, hf_dirs, tmp_path, option, layout, words):
    for message in pool.run(refused, hf_dirs["llama"], str(tmp_path), option, layout):
        assert words in message and "allowed" in message, message


def test_a_dataset_without_chosen_and_rejected_gets_trls_error_on_every_rank(pool, hf_dirs, tmp_path):
    rows = [{"prompt": "t5 t6", "completion": " t7"}] * 4
    for message in pool.run(refused, hf_dirs["llama"], str(tmp_path), {}, TP2, rows):
        assert message.startswith("KeyError") and "chosen" in message, message


def fused_head_check(layout: dict) -> tuple[bool, float]:
    import torch
    from _models import build_model, tiny_config

    import optimum_parallel as op
    from optimum_parallel.integrations.trl import install_fused_head

    reference = build_model(tiny_config("llama"), seed=0)
    model = build_model(tiny_config("llama"), seed=0)
    op.init_mesh(**layout)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    install_fused_head(model)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    same = torch.equal(model.generate(input_ids=ids, max_new_tokens=4, do_sample=False),
                       reference.generate(input_ids=ids, max_new_tokens=4, do_sample=False))  # fmt: skip
    labels = ids.masked_fill(torch.arange(6) < 2, -100)
    got = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
    expected = torch.log_softmax(reference(input_ids=ids).logits[:, :-1].double(), -1)
    expected = expected.gather(-1, ids[:, 1:, None]).squeeze(-1) * (labels[:, 1:] != -100)
    return same, ((got - expected).abs().max() / expected.abs().max()).item()


def test_fused_head_scores_labels_and_keeps_generate(pool):
    """The parallel fused head (what GRPO and DPO read) at tp=2: log p(label) as one device gives it, and
    `generate` (which checks its arguments against the forward's signature) unchanged."""
    for same, err in pool.run(fused_head_check, {"tp": 2}):
        assert same and err <= TOL, (same, err)
