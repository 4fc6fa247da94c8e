"""TRL's SFTTrainer with packing (BFD packing, padding-free rows) on a parallel model: ParallelSFTTrainer at tp=2, cp=2
and pp=2 (and with `padding_free=True` alone, at cp=2 and pp=2) logs, step by step, the losses, entropy,
mean_token_accuracy and num_tokens TRL's SFTTrainer logs on one process on the same dataset, and its saved model
loads with `from_pretrained`; the TRL options a layout cannot run are refused before training, by name (gloo,
2 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from _models import build_model, tiny_config  # noqa: E402

WORLD_SIZE = 2
TOL = 1e-6  # relative, per step: fp32 noise is ~1e-7 here; bf16 autocast or cross-document attention is ~1e-5
STEPS = 3


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer over the model's vocabulary (no hub): the datasets are already token ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="t0", eos_token="t2", unk_token="t1"
    )


def dataset(vocab_size: int):
    """24 documents of 3 to 29 tokens: BFD packing makes rows of up to 48 tokens, each of several documents."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(3, 30, (24,), generator=gen).tolist()
    docs = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": docs})


def sft_args(output_dir: str, **extra) -> dict:
    return dict(
        output_dir=output_dir, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=5e-3, logging_steps=1,
        seed=0, report_to="none", disable_tqdm=True, use_cpu=True, packing=True, max_length=48,
        gradient_checkpointing=False, save_strategy="no", ddp_timeout=60, bf16=False,  # SFTConfig's default: True
    ) | extra  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hf") / "llama"
    config = tiny_config("llama", pad_token_id=0, eos_token_id=2)
    build_model(config, seed=3).save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return str(path)


def losses(log_history: list[dict]) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in log_history if "loss" in entry}


TOKEN_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")


def token_metrics(log_history: list[dict]) -> dict[int, dict[str, float]]:
    """TRL's metrics from its fused LM head, per step."""
    return {e["step"]: {k: e[k] for k in TOKEN_METRICS if k in e} for e in log_history if "loss" in e}


PADDING_FREE = {"packing": False, "padding_free": True, "max_length": None}  # each batch flattened in one row


def document_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """sdpa under each document's causal mask, the documents read from the restarting position ids: what
    flash-attention's varlen path computes on a GPU. transformers' sdpa and eager read the documents from position ids
    only without an attention_mask and a key/value cache; otherwise a packed row's tokens attend to the earlier
    documents of their row."""
    positions = kwargs["position_ids"]
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    segments = starts.cumsum(-1)
    length = positions.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory):
    """TRL's SFTTrainer on one process (attention: `document_attention`): `reference(**options)` its losses per
    step, each set of options trained once."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    AttentionInterface.register("documents", document_attention)

    done: dict[tuple, dict] = {}

    def run(**options) -> dict:
        key = tuple(sorted(options.items()))
        if key not in done:
            model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="documents")
            tokenizer = AutoTokenizer.from_pretrained(hf_dir)
            args = SFTConfig(**sft_args(str(tmp_path_factory.mktemp("reference")), **options))
            data = dataset(model.config.vocab_size)
            trainer = SFTTrainer(model, args, train_dataset=data, processing_class=tokenizer)
            assert trainer.padding_free  # BFD packing or flattening: one padding-free row, position ids restarting
            trainer.train()
            done[key] = {
                "losses": losses(trainer.state.log_history),
                "metrics": token_metrics(trainer.state.log_history),
            }
        return done[key]

    return run


def train_sft(hf_dir: str, output_dir: str, **layout) -> dict:
    """ParallelSFTTrainer on this rank; its losses, and the sums of the trained model's whole tensors."""
    from transformers import AutoTokenizer

    import optimum_parallel as op
    from optimum_parallel.integrations.trl import ParallelSFTConfig, ParallelSFTTrainer

    args = ParallelSFTConfig(**sft_args(output_dir, **layout))
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    trainer = ParallelSFTTrainer(
        hf_dir,
        args,
        model_kwargs={"dtype": torch.float32},
        train_dataset=dataset(tokenizer.vocab_size),
        processing_class=tokenizer,
    )
    trainer.train()
    trained = {name: tensor.double().sum().item() for name, tensor in op.full_state_dict(trainer.model).items()}
    trainer.save_model(output_dir + "/final")
    return {
        "losses": losses(trainer.state.log_history),
        "metrics": token_metrics(trainer.state.log_history),
        "final": output_dir + "/final",
        "trained": trained,
    }


@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_parallel_size": 2},
        {"context_parallel_size": 2},
        {"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 2},
        {"context_parallel_size": 2, **PADDING_FREE},
        {"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 2, **PADDING_FREE},
    ],
    ids=["tp2", "cp2", "pp2", "cp2-padding-free", "pp2-padding-free"],
)
def test_packed_sft_matches_trl_on_one_process(pool, hf_dir, reference, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    results = pool.run(train_sft, hf_dir, str(tmp_path), **layout)
    reference_run = reference(**{k: v for k, v in layout.items() if k in PADDING_FREE})
    expected = reference_run["losses"]
    assert sorted(expected) == list(range(1, STEPS + 1))
    for rank, result in enumerate(results):
        got = result["losses"]
        assert sorted(got) == sorted(expected), (rank, got)
        worst = max(abs(got[s] - expected[s]) / abs(expected[s]) for s in expected)
        assert worst <= TOL, (rank, got, expected)
        # entropy, token accuracy and token count, as TRL's fused head gives them on one process
        metrics = result["metrics"]
        for step, values in reference_run["metrics"].items():
            assert sorted(metrics[step]) == sorted(TOKEN_METRICS), (rank, step, metrics[step])
            for key in TOKEN_METRICS:
                err = abs(metrics[step][key] - values[key]) / max(abs(values[key]), 1e-3)
                print(layout, rank, step, key, metrics[step][key], values[key], f"{err:.1e}")
                assert err <= TOL, (rank, step, key, metrics[step][key], values[key])
    # the consolidated model is the trained one (its weights are not compared with TRL's: after AdamW's normalised
    # steps, gradients within fp32 noise of each other move their near-zero elements by +-lr apart)
    loaded = AutoModelForCausalLM.from_pretrained(results[0]["final"], dtype=torch.float32).state_dict()
    trained = results[0]["trained"]
    assert sorted(trained) == sorted(k for k in loaded if k in trained) and len(trained) == len(dict(loaded))
    for name, total in trained.items():
        assert abs(loaded[name].double().sum().item() - total) <= 1e-6 * max(1.0, abs(total)), name


def own_loss(outputs, labels, num_items_in_batch=None):
    """A `compute_loss_func` (module level: the workers unpickle it by name)."""
    return outputs.loss


def refused(hf_dir: str, output_dir: str, option: dict, layout: dict) -> str:
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelSFTConfig, ParallelSFTTrainer

    kwargs = {}
    if "compute_loss_func" in option:
        kwargs["compute_loss_func"] = option.pop("compute_loss_func")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    try:
        args = ParallelSFTConfig(**sft_args(output_dir, **option, **layout))
        ParallelSFTTrainer(hf_dir, args, train_dataset=dataset(tokenizer.vocab_size), processing_class=tokenizer,
                           **kwargs)  # fmt: skip
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "option,layout,words",
    [
        ({"loss_type": "dft"}, {"tensor_parallel_size": 2}, "loss_type='dft'"),
        ({"compute_loss_func": own_loss}, {"context_parallel_size": 2}, "compute_loss_func"),
        ({"label_smoothing_factor": 0.1}, {"tensor_parallel_size": 2}, "label_smoothing_factor=0.1"),
    ],
    ids=["dft", "compute_loss_func", "label_smoothing"],
)
def test_options_a_layout_cannot_run_are_refused_by_name(pool, hf_dir, tmp_path, option, layout, words):
    for message in pool.run(refused, hf_dir, str(tmp_path), option, layout):
        assert words in message and "allowed" in message, message
