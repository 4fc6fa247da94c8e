"""ParallelTrainer keeps the contract with uneven batches: rows carry right padding and -100 labels, so dp replicas,
gradient-accumulation steps and pipeline micro-batches hold different numbers of labelled tokens, and the logged loss
and gradient norm of every step (and the trained weights) are the single-process `transformers.Trainer`'s on the
global batch (its token mean, `average_tokens_across_devices` as transformers defaults it). The README's arguments
run verbatim on CPU (no `use_cpu`) under the pool's gloo processes."""

from __future__ import annotations

import pytest
import torch
from _models import build_model, rel_err, tiny_config
from test_trainer import LOAD, curve
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

TOL = 1e-5
ROWS, SEQ, GLOBAL_BATCH = 32, 16, 8  # 4 optimizer steps an epoch


class UnevenRows(torch.utils.data.Dataset):
    """Right-padded rows of 1 to SEQ tokens with a few more -100 labels: from 0 to 15 labelled tokens after the
    causal shift (row 3 has none)."""

    def __init__(self, seed: int = 0, uneven: bool = True) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, tiny_config("llama").vocab_size, (ROWS, SEQ), generator=gen)
        lengths = (torch.arange(ROWS) * 7) % SEQ + 1 if uneven else torch.full((ROWS,), SEQ)
        self.attention_mask = (torch.arange(SEQ) < lengths[:, None]).long()
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, -100)
        if uneven:
            self.labels[::3, 2] = -100

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "labels": self.labels[index]}  # fmt: skip


def readme_args(output_dir: str) -> dict:
    """README's "Fine-tuning with the Hugging Face Trainer" arguments, verbatim (no use_cpu), plus logging only."""
    readme = dict(output_dir=output_dir, tensor_parallel_size=2, per_device_train_batch_size=4, save_steps=100)
    return {**readme, "logging_steps": 1, "report_to": "none", "disable_tqdm": True}


def common_args(output_dir: str) -> dict:
    """A few steps that move the weights (lr 5e-3, decay, clipping on), fp32, no checkpoints."""
    return dict(
        output_dir=output_dir, learning_rate=5e-3, weight_decay=0.1, warmup_steps=1, num_train_epochs=2,
        logging_steps=1, seed=0, save_strategy="no", report_to="none", disable_tqdm=True, ddp_timeout=60,
    )  # fmt: skip


def single_process(hf_dir: str, args: dict, final_weights: bool = False, uneven: bool = True) -> dict:
    """transformers.Trainer on one process on the global batch (in the test process)."""
    args = TrainingArguments(**args)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, **LOAD)
    trainer = Trainer(model, args, train_dataset=UnevenRows(uneven=uneven), eval_dataset=UnevenRows(1, uneven))
    trainer.train()
    out = {"curve": curve(trainer.state.log_history), "eval": trainer.evaluate()["eval_loss"]}
    if final_weights:
        out["weights"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return out


def worst_relative(actual: dict[int, dict], expected: dict[int, dict], keys=("loss", "grad_norm")) -> float:
    """max |actual - expected| / |expected| of `keys` over every expected step (the same steps must be logged)."""
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    worst = 0.0
    for step, values in expected.items():
        for key in keys:
            if key in values:
                worst = max(worst, abs(actual[step][key] - values[key]) / abs(values[key]))
    return worst


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hf") / "llama"
    build_model(tiny_config("llama"), seed=3).save_pretrained(path)
    return str(path)


def test_labelled_tokens_are_uneven():
    data = UnevenRows()
    counts = data.labels[:, 1:].ne(-100).sum(1)
    assert counts.min() == 0 and counts.max() == SEQ - 1 and len(set(counts.tolist())) > 8, counts


# ----------------------------------------------------------------------------------------------- in the pool


def train_parallel(hf_dir: str, args: dict, consolidate_to: str | None = None, uneven: bool = True) -> dict:
    """One ParallelTrainer run on this rank; its logged curve, a final evaluation and what transformers set up."""
    from optimum_parallel.integrations.transformers.trainer import ParallelTrainer
    from optimum_parallel.integrations.transformers.training_args import ParallelTrainingArguments

    args = ParallelTrainingArguments(**args)
    trainer = ParallelTrainer(hf_dir, args, model_kwargs=LOAD, train_dataset=UnevenRows(uneven=uneven),
                              eval_dataset=UnevenRows(1, uneven))  # fmt: skip
    trainer.train()
    out = {"curve": curve(trainer.state.log_history), "eval": trainer.evaluate()["eval_loss"]}
    if consolidate_to:
        trainer.save_model(consolidate_to)
    out["setup"] = (args.world_size, args.process_index, args.device.type, args.use_cpu, args.ddp_backend)
    return out


def test_readme_arguments_train_on_cpu_without_use_cpu(pool, hf_dir, tmp_path):
    """dp=2 x tp=2 with the README's arguments: gloo, every rank its own process index, the reference curve."""
    args = readme_args(str(tmp_path / "parallel"))
    results = pool.run(train_parallel, hf_dir, {**args, "per_device_eval_batch_size": 4})
    reference = {k: v for k, v in readme_args(str(tmp_path / "reference")).items() if k != "tensor_parallel_size"}
    expected = single_process(hf_dir, {**reference, "per_device_train_batch_size": GLOBAL_BATCH})  # eval: 8 a batch
    assert [r["setup"] for r in results] == [(4, rank, "cpu", True, "gloo") for rank in range(4)]
    assert sorted(expected["curve"]) == list(range(1, 13))  # README's defaults: 3 epochs of 4 steps
    for result in results:
        assert worst_relative(result["curve"], expected["curve"]) <= TOL, (result["curve"], expected["curve"])
        assert abs(result["eval"] - expected["eval"]) <= TOL * expected["eval"], (result["eval"], expected["eval"])


LAYOUTS = {  # per-device batch x dp x accumulation = the global batch of 8
    "dp4_tp1_accumulate2": dict(tensor_parallel_size=1, per_device_train_batch_size=1, gradient_accumulation_steps=2),
    "dp2_tp2": dict(tensor_parallel_size=2, per_device_train_batch_size=4),
}


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory) -> dict:
    args = common_args(str(tmp_path_factory.mktemp("reference")))
    return single_process(hf_dir, {**args, "per_device_train_batch_size": GLOBAL_BATCH}, final_weights=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_weighted_data_parallel(pool, hf_dir, reference, tmp_path, layout):
    """Each replica's loss is its token sum over the global token count (times dp, as DDP averages): the loss and
    gradients of the global token mean, whatever each replica (and accumulation step) holds."""
    args = {**common_args(str(tmp_path / "out")), **LAYOUTS[layout], "per_device_eval_batch_size": 2}
    consolidated = tmp_path / "consolidated"
    results = pool.run(train_parallel, hf_dir, args, str(consolidated))
    for result in results:
        assert worst_relative(result["curve"], reference["curve"]) <= TOL, (result["curve"], reference["curve"])
    trained = AutoModelForCausalLM.from_pretrained(consolidated, **LOAD).state_dict()
    worst = max(rel_err(trained[name], value) for name, value in reference["weights"].items())
    assert worst <= TOL, worst


def test_per_device_token_count_is_not_divided_by_tp(pool, hf_dir, tmp_path):
    """`average_tokens_across_devices=False` (each replica its own token mean, as transformers defines it) at
    dp=2 x tp=2 on rows of equal length, where that mean is the global one: the single-process curve and eval loss,
    not tp times it (transformers divides its per-device count by the ranks sharing a batch)."""
    args = {**common_args(str(tmp_path / "out")), **LAYOUTS["dp2_tp2"], "per_device_eval_batch_size": 4}
    results = pool.run(train_parallel, hf_dir, {**args, "average_tokens_across_devices": False}, uneven=False)
    expected = single_process(hf_dir, {**common_args(str(tmp_path / "reference")),
                                       "per_device_train_batch_size": GLOBAL_BATCH}, uneven=False)  # fmt: skip
    for result in results:
        assert worst_relative(result["curve"], expected["curve"]) <= TOL, (result["curve"], expected["curve"])
        assert abs(result["eval"] - expected["eval"]) <= TOL * expected["eval"], (result["eval"], expected["eval"])


@pytest.mark.parametrize("across_devices", [True, False])
def test_pipeline_with_uneven_micro_batches(pool, hf_dir, reference, tmp_path, across_devices):
    """dp=2 x pp=2, 4 micro-batches of one row each: run_train gets the Trainer's global token count (or, when
    transformers counts per device, counts the global batch's itself); the logged loss is the global batch's."""
    args = dict(pipeline_parallel_size=2, pipeline_parallel_num_microbatches=4, per_device_train_batch_size=4)
    args["average_tokens_across_devices"] = across_devices
    results = pool.run(train_parallel, hf_dir, {**common_args(str(tmp_path / "out")), **args,
                                                "per_device_eval_batch_size": 4})  # fmt: skip
    for result in results:
        assert worst_relative(result["curve"], reference["curve"]) <= TOL, (result["curve"], reference["curve"])


def arguments_error_when_accelerate_sees_one_process(output_dir: str) -> str:
    """As on a device accelerate does not distribute over (MPS, say): the arguments refuse, naming use_cpu."""
    from optimum_parallel.integrations.transformers import training_args

    no_accelerator, training_args._no_accelerator = training_args._no_accelerator, lambda: False
    try:
        training_args.ParallelTrainingArguments(**readme_args(output_dir))
    except ValueError as error:
        return str(error)
    finally:
        training_args._no_accelerator = no_accelerator
    return "no error"


def test_a_launched_world_transformers_does_not_see_is_refused(pool, tmp_path):
    for message in pool.run(arguments_error_when_accelerate_sees_one_process, str(tmp_path)):
        assert "4 processes were launched" in message and "set up 1" in message and "use_cpu=True" in message, message
