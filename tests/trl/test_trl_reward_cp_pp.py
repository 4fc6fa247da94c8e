"""TRL's RewardTrainer on a parallel model with context and pipeline parallelism: ParallelRewardTrainer at cp=2 and
at pp=2 logs, step by step, the loss, grad_norm, min / mean / max reward, accuracy, margin and num_tokens TRL's
RewardTrainer logs on one process (chosen and rejected completions of uneven lengths, right-padded rows: the row's
last real token, which one cp rank holds, or which the pipeline's last stage scores, is the one pooled), and so does
its evaluation; pp together with cp is refused by name before anything runs (gloo, 2 ranks). cp=2 x tp=2 with sp:
test_trl_reward_dp.py."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, perturbed_copy, save_tiny  # noqa: E402
from _reward import (  # noqa: E402
    cached_references,
    reward_checkpoint,
    train_parallel_reward,
    trl_reference,
)

WORLD_SIZE = 2
TOL = 1e-5  # relative, per step and metric, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)

CP2 = {"context_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}
CASES = {
    "cp2": ({}, CP2),
    "pp2": ({}, PP2),
    "pp2-centred": ({"center_rewards_coefficient": 0.01}, PP2),
}


@pytest.fixture(scope="module")
def reward_dirs(tmp_path_factory) -> tuple[str, str]:
    """The reward checkpoint and the same with its backbone perturbed by relative 1e-7 (for the noise floor)."""
    causal = save_tiny(tmp_path_factory.mktemp("hf") / "llama")
    moved = perturbed_copy(causal, tmp_path_factory.mktemp("perturbed") / "llama")
    return tuple(reward_checkpoint(path, tmp_path_factory.mktemp("reward")) for path in (causal, moved))


@pytest.fixture(scope="module")
def reference(reward_dirs, tmp_path_factory):
    return cached_references(reward_dirs, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_reward_matches_trl_on_one_process(pool, reward_dirs, reference, tmp_path, case):
    options, layout = CASES[case]
    expected, noise = reference(**options)
    assert len(expected) == 3 and 0 < expected[1]["accuracy"] < 1, expected  # a real comparison, not a constant
    assert "grad_norm" in expected[1], expected
    for rank, got in enumerate(pool.run(train_parallel_reward, reward_dirs[0], str(tmp_path), options, layout)):
        worst = check_against(got, expected, noise, TOL)
        print(case, rank, {k: f"{v:.1e}" for k, v in worst.items()})


@pytest.mark.parametrize("layout", [CP2, PP2], ids=["cp2", "pp2"])
def test_evaluation_matches_trl_on_one_process(pool, reward_dirs, tmp_path, tmp_path_factory, layout):
    expected = trl_reference(reward_dirs[0], str(tmp_path_factory.mktemp("ref")), evaluate=True)
    assert "loss" in expected[1] and "margin" in expected[1], expected
    noise = dict.fromkeys(expected[1], 0.0)
    for rank, got in enumerate(pool.run(train_parallel_reward, reward_dirs[0], str(tmp_path), {}, layout, True)):
        worst = check_against(got, expected, noise, TOL)
        print("evaluate", layout, rank, {k: f"{v:.1e}" for k, v in worst.items()})


def refused(hf_dir: str, output_dir: str, layout: dict) -> str:
    from _reward import reward_args
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelRewardConfig, ParallelRewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    try:
        ParallelRewardTrainer(hf_dir, args=ParallelRewardConfig(**reward_args(output_dir, **layout)),
                              train_dataset=None, processing_class=tokenizer)  # fmt: skip
    except ValueError as err:
        return str(err)
    return "no error"


def test_pipeline_with_context_parallelism_is_refused_by_name_before_anything_runs(pool, reward_dirs, tmp_path):
    """Refused before the model is loaded or the dataset read (no dataset is even given)."""
    for message in pool.run(refused, reward_dirs[0], str(tmp_path), {**PP2, **CP2}):
        words = "pipeline_parallel_size=2 with context_parallel_size=2 is not supported by ParallelRewardTrainer"
        assert words in message and "allowed with pp > 1: context_parallel_size=1" in message, message


def classifier_at_cp2() -> dict[str, float]:
    """A three-label sequence classifier at cp=2 (dp x cp reduction at level 0) against the same model on one process,
    with per-row labels: the loss, every gradient, the logits without a graph, the loss after two AdamW steps. The
    rows are right-padded to uneven lengths, one holding the pad token among its real tokens (only trailing pad tokens
    are skipped) and one ending in a chunk the other cp rank holds."""
    import copy

    import torch
    import torch.distributed as dist
    from _models import rel_err, tiny_config
    from transformers import AutoModelForSequenceClassification

    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training

    mesh = op.init_mesh(dp=dist.get_world_size() // 2, cp=2)
    config = tiny_config("llama", num_hidden_layers=2, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    reference = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").float().eval()
    model = op.ParallelizersManager.parallelizer_for_model(reference).parallelize(copy.deepcopy(reference))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = compose_training(model, optimizer, mesh, {}, op.DataParallelConfig(sharding_level=0))
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, config.vocab_size, (3, 19), generator=gen)
    mask = torch.ones_like(input_ids)
    for row, length in enumerate((19, 7, 12)):
        input_ids[row, length:], mask[row, length:] = 0, 0
    input_ids[0, 3] = 0  # the pad token as a real token
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": torch.tensor([2, 0, 1])}

    errors = {}
    for step in range(3):
        loss, ref_loss = model(**batch).loss, reference(**batch).loss
        loss.backward()
        ref_loss.backward()
        errors[f"loss{step}"] = rel_err(loss, ref_loss)
        if step == 0:
            expected = dict(reference.named_parameters())
            errors["grad"] = max(rel_err(p.grad, expected[n].grad) for n, p in model.named_parameters())
            with torch.no_grad():
                errors["logits"] = rel_err(model(**batch).logits, reference(**batch).logits)
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    return errors


def test_a_sequence_classifier_with_labels_at_cp2_matches_one_process(pool):
    for rank, errors in enumerate(pool.run(classifier_at_cp2)):
        print("classifier cp2", rank, {k: f"{v:.1e}" for k, v in errors.items()})
        assert all(error <= TOL for error in errors.values()), errors
