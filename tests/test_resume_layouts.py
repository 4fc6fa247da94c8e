"""Resume anywhere: a ParallelTrainer checkpoint saved after step 3 on one layout resumes on another (the Trainer
reshards it) and logs the uninterrupted run's loss and gradient norm for steps 4-6, its optimizer's param groups intact
(AdamW with weight decay: the Trainer's decay and no-decay groups, each parameter in the group it started in).

The reference is the uninterrupted tp=2 run. The tolerance is 10 x the fp32 noise floor: the largest difference
between the reference and the same run from weights perturbed by a relative 1e-7 (at least one fp32 spacing of the
logged value, the finest difference a log can show). Rows are right-padded by different amounts and carry -100 labels,
so ranks and micro-batches hold different numbers of labelled tokens."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from _models import build_model, tiny_config
from _pool import WorkerPool
from test_expert_parallel import MOE

from optimum_parallel.checkpoint.optimizer_groups import regroup, saved_hyper_parameters
from optimum_parallel.io.errors import CheckpointError

WORLD_SIZE = 2
STEPS, SAVE_AT, ROWS, SEQ = 6, 3, 4, 16  # the global batch is ROWS rows whatever the layout
METRICS = ("loss", "grad_norm")
LOAD = {"dtype": torch.float32, "attn_implementation": "eager"}


class PaddedRows(torch.utils.data.Dataset):
    """Rows of a fixed token-to-token chain (learnable, so the losses move), right-padded by 0-6 tokens, -100 on the
    padding and on one more token of every other row."""

    def __init__(self, vocab: int, count: int) -> None:
        gen = torch.Generator().manual_seed(11)
        chain = torch.randperm(vocab - 1, generator=gen) + 1  # token 0 is the padding
        ids = [torch.randint(1, vocab, (count,), generator=gen)]
        for _ in range(SEQ - 1):
            ids.append(chain[ids[-1] - 1])
        self.ids = torch.stack(ids, dim=1)
        self.mask = torch.ones(count, SEQ, dtype=torch.long)
        self.labels = self.ids.clone()
        for row in range(count):
            pad = (5 * row) % 7
            self.ids[row, SEQ - pad :], self.mask[row, SEQ - pad :], self.labels[row, SEQ - pad :] = 0, 0, -100
            if row % 2:
                self.labels[row, SEQ // 2] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def train(hf_dir: str, output_dir: str, tp: int = 1, pp: int = 1, *, resume=None, stop_at=None, **extra) -> dict:
    """One ParallelTrainer run on this rank: {"curve": {step: {loss, grad_norm}} of the steps this run took,
    "decay": {parameter: its group's weight_decay}, "expected": {parameter: the one the Trainer gives it}}."""
    from transformers import AutoConfig, TrainerCallback

    from optimum_parallel.checkpoint.collect import parameter_names
    from optimum_parallel.integrations.transformers.trainer import ParallelTrainer
    from optimum_parallel.integrations.transformers.training_args import ParallelTrainingArguments

    class StopAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == stop_at

    dp = int(os.environ["WORLD_SIZE"]) // (tp * pp * extra.get("context_parallel_size", 1))
    settings = dict(
        output_dir=output_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        pipeline_parallel_num_microbatches=2 if pp > 1 else 1, per_device_train_batch_size=ROWS // dp,
        max_steps=STEPS, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="steps", save_steps=SAVE_AT, report_to=[], seed=0, disable_tqdm=True,
        use_cpu=True, ddp_timeout=60,
    )  # fmt: skip
    args = ParallelTrainingArguments(**{**settings, **extra})
    vocab = AutoConfig.from_pretrained(hf_dir).vocab_size
    trainer = ParallelTrainer(
        hf_dir,
        args,
        model_kwargs=LOAD,
        train_dataset=PaddedRows(vocab, ROWS * STEPS),
        callbacks=[StopAfterSave()] if stop_at else None,
    )
    first = trainer.state.global_step  # 0; a resumed run's log history starts with the saved steps
    trainer.train(resume_from_checkpoint=resume)
    first = SAVE_AT if resume else first
    curve: dict[int, dict] = {}
    for entry in trainer.state.log_history:
        if entry["step"] > first:
            curve.setdefault(entry["step"], {}).update({k: entry[k] for k in METRICS if k in entry})
    names = parameter_names(trainer.model)
    decay = {names[id(p)]: g["weight_decay"] for g in trainer.optimizer.param_groups for p in g["params"]}
    decayed = set(trainer.get_decay_parameter_names(trainer.model))
    return {"curve": curve, "decay": decay, "expected": {n: args.weight_decay * (n in decayed) for n in decay}}


def _save(root, name: str, config, perturb: bool = False) -> str:
    """A tiny model saved as a transformers checkpoint; `perturb`: every weight scaled by 1 + 1e-7 x N(0, 1)."""
    model = build_model(config, seed=3)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters() if perturb else []:
            param.copy_(param.double() * (1 + 1e-7 * torch.randn(param.shape, generator=gen, dtype=torch.float64)))
    model.save_pretrained(root / name)
    return str(root / name)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    llama, mixtral = tiny_config("llama"), tiny_config("mixtral", **MOE["mixtral"])
    return {
        "llama": _save(root, "llama", llama),
        "llama-perturbed": _save(root, "llama-perturbed", llama, perturb=True),
        "mixtral": _save(root, "mixtral", mixtral),
        "mixtral-perturbed": _save(root, "mixtral-perturbed", mixtral, perturb=True),
    }


def _reference(pool, hf_dirs: dict, model: str, out, **extra) -> dict:
    """The uninterrupted tp=2 run of `model`, and each metric's tolerance from its noise floor."""
    curve = pool.run(train, hf_dirs[model], str(out / model), 2, **extra)[0]["curve"]
    perturbed = pool.run(train, hf_dirs[f"{model}-perturbed"], str(out / f"{model}-perturbed"), 2, **extra)[0]["curve"]
    floor = {k: max(abs(perturbed[s][k] - curve[s][k]) for s in curve) for k in METRICS}
    spacing = {k: max(math.ulp(curve[s][k]) for s in curve) for k in METRICS}  # float32: 2**29 x float64's ulp
    tolerance = {k: 10 * max(floor[k], spacing[k] * 2**29) for k in METRICS}
    print(f"\n{model} reference {curve}\n  noise floor {floor}, tolerance {tolerance}")
    return {"curve": curve, "tolerance": tolerance}


@pytest.fixture(scope="module")
def references(pool, hf_dirs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("reference")
    refs = {model: _reference(pool, hf_dirs, model, out) for model in ("llama", "mixtral")}
    # weight_decay=0: the decay and no-decay groups have the same hyper-parameters (the case of issue 48)
    refs["llama-wd0"] = {**refs["llama"], "curve": pool.run(train, hf_dirs["llama"], str(out / "wd0"), 2,
                                                             weight_decay=0.0)[0]["curve"]}  # fmt: skip
    return refs


SAVED = {  # name: (model, tp, pp, extra settings) of the runs ended after the step-3 save
    "llama-tp2": ("llama", 2, 1, {}),
    "llama-pp2": ("llama", 1, 2, {}),
    "llama-wd0-tp2": ("llama", 2, 1, {"weight_decay": 0.0}),
    "mixtral-tp2": ("mixtral", 2, 1, {}),
    "mixtral-ep2": ("mixtral", 1, 1, {"expert_parallel_size": 2}),
}


@pytest.fixture(scope="module")
def saved(pool, hf_dirs, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("saved")
    checkpoints = {}
    for name, (model, tp, pp, extra) in SAVED.items():
        pool.run(train, hf_dirs[model], str(out / name), tp, pp, stop_at=SAVE_AT, **extra)
        checkpoints[name] = str(out / name / f"checkpoint-{SAVE_AT}")
    return checkpoints


def check_resumed(results: list[dict], reference: dict, name: str) -> None:
    expected, tolerance = reference["curve"], reference["tolerance"]
    for rank, result in enumerate(results):
        got = result["curve"]
        assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1)), (name, rank, got)
        worst = {k: max(abs(got[s][k] - expected[s][k]) for s in got) for k in METRICS}
        print(f"{name} rank {rank}: {got}\n  worst difference {worst}")
        assert all(worst[k] <= tolerance[k] for k in METRICS), (name, rank, worst, tolerance)
        assert result["decay"] == result["expected"], (name, rank)  # every parameter in its own group


RESUMES = {  # id: (saved checkpoint, reference, tp, pp, extra settings of the resumed run)
    "tp2-to-pp2": ("llama-tp2", "llama", 1, 2, {}),
    "tp2-to-dp2": ("llama-tp2", "llama", 1, 1, {}),
    "tp2-to-dp2-zero1": ("llama-tp2", "llama", 1, 1, {"sharding_level": 1}),
    "tp2-to-dp2-fsdp": ("llama-tp2", "llama", 1, 1, {"sharding_level": 3}),
    "tp2-to-cp2": ("llama-tp2", "llama", 1, 1, {"context_parallel_size": 2}),
    "pp2-to-tp2": ("llama-pp2", "llama", 2, 1, {}),
    "pp2-to-dp2-fsdp": ("llama-pp2", "llama", 1, 1, {"sharding_level": 3}),
    "wd0-tp2-to-pp2": ("llama-wd0-tp2", "llama-wd0", 1, 2, {"weight_decay": 0.0}),
    "moe-tp2-to-ep2": ("mixtral-tp2", "mixtral", 1, 1, {"expert_parallel_size": 2}),
    "moe-ep2-to-tp2": ("mixtral-ep2", "mixtral", 2, 1, {}),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_resumes_on_another_layout(pool, hf_dirs, references, saved, tmp_path, case):
    source, reference, tp, pp, extra = RESUMES[case]
    model = SAVED[source][0]
    results = pool.run(train, hf_dirs[model], str(tmp_path / "out"), tp, pp, resume=saved[source], **extra)
    check_resumed(results, references[reference], case)
    assert not list((tmp_path / "out").glob(".checkpoint-*"))  # the resharded copy is removed


def test_resumes_on_four_ranks(hf_dirs, references, saved, tmp_path):
    """tp=2 -> tp=2 x pp=2 (four ranks, in a pool of their own)."""
    four = WorkerPool(4)
    try:
        results = four.run(train, hf_dirs["llama"], str(tmp_path / "out"), 2, 2, resume=saved["llama-tp2"])
    finally:
        four.close()
    check_resumed(results, references["llama"], "tp2-to-tp2-pp2")


def test_parameters_regrouped_otherwise_are_refused():
    """A running group whose parameters were saved in groups with different hyper-parameters is refused by name."""
    saved = [{"weight_decay": 0.1, "params": ["a", "b"]}, {"weight_decay": 0.0, "params": ["c"]}]
    assert saved_hyper_parameters("ckpt", saved, [["b", "a"], ["c"]]) == [{"weight_decay": 0.1}, {"weight_decay": 0.0}]
    merged = [{"weight_decay": 0.0, "params": ["a", "b"]}]  # a reshard merged two groups with equal hyper-parameters
    assert saved_hyper_parameters("ckpt", merged, [["a"], ["b"]]) == [{"weight_decay": 0.0}] * 2
    emptied = [{"weight_decay": 0.1, "params": ["a", "b"]}, {"weight_decay": 0.0, "params": []}]  # by position
    assert saved_hyper_parameters("ckpt", emptied, [["a", "b"], []])[1] == {"weight_decay": 0.0}
    with pytest.raises(CheckpointError, match="different hyper-parameters"):
        saved_hyper_parameters("ckpt", saved, [["a", "c"], ["b"]])
    with pytest.raises(CheckpointError, match="holds none of them: \\['c'\\]"):
        saved_hyper_parameters("ckpt", saved, [["a", "b"]])


def test_regrouping_keeps_each_group():
    """A reshard to other stages keeps the groups as the Trainer lists them (the empty no-decay group too), and
    merges by hyper-parameters only stages that dropped different empty groups (`optimizer_for_mp`)."""
    names = ["model.embed_tokens.weight", "model.layers.0.w", "model.layers.0.norm", "model.layers.1.w", "lm_head.w"]
    decay, plain = {"weight_decay": 0.0, "lr": 1.0}, {"weight_decay": 0.0, "lr": 1.0}  # equal: weight_decay=0
    one_stage = {"0": [{**decay, "params": [n for n in names if "norm" not in n]}, {**plain, "params": names[2:3]}]}
    index = SimpleNamespace(optimizer={"param_groups": one_stage}, tied={}, tensors=dict.fromkeys(names))
    assert regroup(index, 2) == {
        "0": [{**decay, "params": names[:2]}, {**plain, "params": names[2:3]}],
        "1": [{**decay, "params": names[3:]}, {**plain, "params": []}],
    }
    # groups A, B, C: stage 0 holds A and B, stage 1 holds B and C (as many groups, at other positions)
    a, b, c = ({"weight_decay": wd, "lr": 1.0} for wd in (0.1, 0.2, 0.3))
    index.optimizer["param_groups"] = {
        "0": [{**a, "params": names[:2]}, {**b, "params": names[2:3]}],
        "1": [{**b, "params": ["model.layers.1.norm"]}, {**c, "params": names[3:]}],
    }
    index.tensors["model.layers.1.norm"] = None
    merged = regroup(index, 1)["0"]
    assert merged == [
        {**a, "params": names[:2]},
        {**b, "params": [names[2], "model.layers.1.norm"]},
        {**c, "params": names[3:]},
    ]
