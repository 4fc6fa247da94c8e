"""What the GRPO tests share (2 ranks in test_trl_grpo, 4 in test_trl_grpo_dp): a tiny Llama and a word-level
tokenizer saved to a directory (no hub), a prompt dataset with prompts of several lengths, reward functions, TRL's
`GRPOTrainer` on one process, and completions fixed by the prompt, its place in the generation batch and the step
(sampling made deterministic whatever the layout), with EOS at several places and some truncated."""

from __future__ import annotations

import torch

VOCAB = 128
PAD, UNK, EOS = 0, 1, 2
COMPLETION_LENGTH = 8
STEPS = 3


def make_tokenizer(vocab_size: int = VOCAB):
    """Token "t{i}" is id i; words split on spaces; t0 pads, t2 ends a completion."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t2", unk_token="t1")


# Qwen3.5's text model (tests/families/test_hybrid_families.py's tiny config): a gated delta net layer, then an
# attention layer
HYBRID = dict(
    intermediate_size=96, head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
)  # fmt: skip
TINY = {"llama": {}, "qwen3_5_text": HYBRID}


def save_tiny(path: str, model_type: str = "llama") -> str:
    """A tiny `model_type` model (vocab 128, hidden 64, 2 layers) and the tokenizer, saved to `path`."""
    from _models import build_model, tiny_config

    config = tiny_config(model_type, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, **TINY[model_type])
    build_model(config, seed=3).save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def save_tiny_llama(path: str) -> str:
    return save_tiny(path, "llama")


def prompts(count: int = 12):
    """Prompts of 2 to 6 tokens (left padding in every batch)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(count):
        length = int(torch.randint(2, 7, (1,), generator=gen))
        rows.append(" ".join(f"t{int(t)}" for t in torch.randint(3, VOCAB, (length,), generator=gen)))
    return Dataset.from_dict({"prompt": rows})


def even_tokens(completions, **kwargs) -> list[float]:
    """A reward: the share of even token ids in the completion."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(int(w[1:]) % 2 == 0 for w in words) / (1 + len(words)))
    return out


def short(completions, **kwargs) -> list[float]:
    """A second reward: shorter completions score higher."""
    return [1.0 / (1 + len(text.split())) for text in completions]


def fixed_completion(prompt_ids: list[int], index: int, step: int) -> list[int]:
    """A completion decided by the prompt, its index in the generation batch and the step: 1 to 8 tokens, ending in
    EOS unless it runs to the length limit."""
    seed = (sum((i + 1) * t for i, t in enumerate(prompt_ids)) * 1009 + index * 31 + step) % (2**31)
    gen = torch.Generator().manual_seed(seed)
    length = int(torch.randint(1, COMPLETION_LENGTH + 1, (1,), generator=gen))
    tokens = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
    return tokens if length == COMPLETION_LENGTH else tokens[:-1] + [EOS]


class FixedCompletions:
    """Completions by `fixed_completion`, wherever the prompts are: the batch index of a process's first prompt is
    its process index (the replica's, in ParallelGRPOTrainer) times its prompt count, as TRL's sampler lays them."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        first = self.accelerator.process_index * len(prompt_ids)
        step = self.state.global_step
        return [fixed_completion(list(ids), first + i, step) for i, ids in enumerate(prompt_ids)], None


class RecordedCompletions:
    """Real generation, each call's completion ids kept in order (`self.drawn`): the tokens a layout sampled."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        self.__dict__.setdefault("drawn", []).append([list(map(int, ids)) for ids in out[0]])
        return out


def grpo_args(output_dir: str, **extra) -> dict:
    return dict(
        output_dir=output_dir, per_device_train_batch_size=12, max_steps=STEPS, learning_rate=2e-2, logging_steps=1,
        seed=0, report_to="none", disable_tqdm=True, use_cpu=True, bf16=False, gradient_checkpointing=False,
        num_generations=4, max_completion_length=COMPLETION_LENGTH, beta=0.1, save_strategy="no", ddp_timeout=60,
        eval_strategy="steps", eval_steps=STEPS,
        per_device_eval_batch_size=extra.get("per_device_train_batch_size", 12),
    ) | extra  # fmt: skip


METRICS = ("loss", "kl", "reward", "entropy", "completions/mean_length")
EVAL_METRICS = ("eval_loss", "eval_kl", "eval_reward", "eval_entropy")


def logged(log_history: list[dict]) -> dict[int, dict[str, float]]:
    """Per step: the loss, kl, mean reward, entropy and mean completion length TRL logged, and after the last step
    the evaluation's (on `prompts(6)`: 24 completions, whole groups in every batch)."""
    steps = {e["step"]: {k: e[k] for k in METRICS if k in e} for e in log_history if "loss" in e}
    for entry in log_history:
        if "eval_loss" in entry:
            steps[entry["step"]].update({k: entry[k] for k in EVAL_METRICS if k in entry})
    return steps


NOT_FIGURES = ("step", "epoch", "step_time", "eval_step_time")  # the place in training and wall times


def every_figure(log_history: list[dict]) -> dict[int, dict[str, float]]:
    """Per step, every figure TRL logged (loss, grad norm, rewards and their std, kl, entropy, clip ratios,
    completion lengths, token count, ...; after the last step the evaluation's), wall times left out."""
    steps: dict[int, dict[str, float]] = {}
    for entry in log_history:
        if "loss" in entry or "eval_loss" in entry:
            figures = {k: v for k, v in entry.items() if k not in NOT_FIGURES and not k.endswith(("runtime", "second"))}
            steps.setdefault(entry["step"], {}).update(figures)
    return steps


def lora_config():
    """LoRA adapters on attention and MLP projections (column- and row-parallel under tp)."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def trl_reference(
    hf_dir: str, output_dir: str, peft: bool = False, every: bool = False, fixed: bool = True, **options
) -> dict:
    """TRL's GRPOTrainer on this one process (fixed completions unless `fixed=False`; LoRA adapters with `peft`), its
    metrics per step (`every`: every figure it logged); with `fixed=False` also what `train_parallel` returns."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    class FixedGRPOTrainer(FixedCompletions, GRPOTrainer):
        pass

    class SampledGRPOTrainer(RecordedCompletions, GRPOTrainer):
        pass

    args = GRPOConfig(**grpo_args(output_dir, **options))
    trainer = (FixedGRPOTrainer if fixed else SampledGRPOTrainer)(
        hf_dir, reward_funcs=[even_tokens, short], args=args, train_dataset=prompts(),
        eval_dataset=prompts(6), processing_class=AutoTokenizer.from_pretrained(hf_dir),
        peft_config=lora_config() if peft else None,
    )  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    if not fixed:
        return {"logged": logged(history), "every": every_figure(history), "drawn": trainer.drawn}
    return (every_figure if every else logged)(history)


def train_parallel(hf_dir: str, output_dir: str, fixed: bool = True, peft: bool = False, **options) -> dict:
    """ParallelGRPOTrainer on this rank (fixed completions unless `fixed=False`; LoRA adapters with `peft`): its
    logged metrics per step, every figure it logged and the completions it logged."""
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelGRPOConfig, ParallelGRPOTrainer

    class FixedParallelGRPOTrainer(FixedCompletions, ParallelGRPOTrainer):
        pass

    class SampledParallelGRPOTrainer(RecordedCompletions, ParallelGRPOTrainer):
        pass

    args = ParallelGRPOConfig(**grpo_args(output_dir, **options))
    trainer = (FixedParallelGRPOTrainer if fixed else SampledParallelGRPOTrainer)(
        hf_dir, reward_funcs=[even_tokens, short], args=args, train_dataset=prompts(),
        eval_dataset=prompts(6), processing_class=AutoTokenizer.from_pretrained(hf_dir),
        model_kwargs={"dtype": torch.float32},
        peft_config=lora_config() if peft else None,
    )  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    return {"logged": logged(history), "every": every_figure(history), "completions": list(trainer._logs["completion"]),
            "drawn": getattr(trainer, "drawn", None), "replica": trainer.mesh.rank("batch")}  # fmt: skip


def worst_errors(got: dict, expected: dict) -> dict[str, float]:
    """Per metric, the worst relative error over the steps (absolute where the expected value is 0)."""
    worst: dict[str, float] = {}
    for step, want in expected.items():
        for key, value in want.items():
            err = abs(got[step][key] - value) / (abs(value) if value != 0 else 1.0)
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


def print_table(layout: str, got: dict, expected: dict) -> None:
    """The steps' loss and kl next to TRL's, with their relative errors (seen with `pytest -s`)."""
    print(f"\n{layout}: step | loss (TRL) | loss ({layout}) | rel err | kl (TRL) | kl ({layout}) | rel err")
    for step in sorted(expected):
        row = [step]
        for key in ("loss", "kl"):
            want, have = expected[step][key], got[step][key]
            row += [f"{want:.9g}", f"{have:.9g}", f"{abs(have - want) / abs(want) if want else abs(have):.2e}"]
        print(" | ".join(str(x) for x in row))
    print("worst relative error per metric:", {k: f"{v:.1e}" for k, v in worst_errors(got, expected).items()})
