"""TRL's GRPOTrainer with tools, environments and a rollout function (gloo, 2 ranks): ParallelGRPOTrainer at tp=2
runs them on the replica's first rank only and hands their results to the other rank, and logs, step by step, every
figure TRL's GRPOTrainer logs on one process with the same completions and tool results (a tiny Llama with a byte-level
BPE tokenizer and Qwen3's chat template; the completions are scripted, tool calls included: a random model emits
none). A policy given as a path is loaded as TRL loads it: float32 unless `model_init_kwargs` names a dtype."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from _grpo import even_tokens, every_figure, grpo_args, prompts, save_tiny_llama, worst_errors  # noqa: E402

WORLD_SIZE = 2
TOL = 1e-5  # relative, per step and figure (fp32)
VOCAB = 512
COMPLETION_LENGTH = 96
TOOL_OPTIONS = {"max_completion_length": COMPLETION_LENGTH, "eval_strategy": "no", "max_steps": 2}

CALLS: list = []  # this process's tool calls, environment resets and rollouts, in order


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    CALLS.append(("multiply", a, b))
    return a * b


async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0)
    CALLS.append(("add", a, b))
    return a + b


class Ledger:
    """An environment: `reset` observes the prompt, its tools add to a total that `get_reward` returns."""

    def __init__(self) -> None:
        CALLS.append(("made",))
        self.total = 0

    def reset(self, **kwargs) -> str:
        CALLS.append(("reset",))
        self.total = len(kwargs["prompt"][-1]["content"])
        return f" Start at {self.total}."

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        CALLS.append(("multiply", a, b))
        self.total += a * b
        return self.total

    async def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        CALLS.append(("add", a, b))
        self.total += a + b
        return self.total

    def get_reward(self) -> float:
        return self.total / 100


def save_tool_model(path: str) -> str:
    """A tiny Llama (vocab 512, hidden 64, 2 layers) and a byte-level BPE tokenizer with Qwen3's chat template (its
    merges learnt from a rendered tool-calling conversation, so prompts with tool schemas stay short), saved."""
    import trl
    from _models import build_model, tiny_config
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")) as f:
        template = f.read()
    sample = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    sample.chat_template = template
    conversation = [
        {"role": "user", "content": "What is 3 times 4?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("multiply", 3, 4)]},
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "It is 12."},
    ]
    corpus = sample.apply_chat_template(conversation, tools=[multiply, add], tokenize=False)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    learner = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator([corpus], trainer=learner)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    config = tiny_config(
        "llama", vocab_size=VOCAB, max_position_embeddings=1024, pad_token_id=fast.pad_token_id,
        eos_token_id=fast.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    build_model(config, seed=3).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def _call(name: str, a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}


def questions(count: int = 6):
    """Conversational prompts."""
    from datasets import Dataset

    rows = [[{"role": "user", "content": f"What is {3 + i} times {i * 7 % 5 + 2}?"}] for i in range(count)]
    return Dataset.from_dict({"prompt": rows})


def scripted_text(prompt_ids: list[int], index: int, step: int, tool_turns: int) -> str:
    """A completion decided by the prompt, its index in the generation batch and the step: tool calls (one, two of
    which one async, an unknown tool, wrong arguments) or an answer; after a tool turn another call or the answer."""
    seed = (sum((i + 1) * t for i, t in enumerate(prompt_ids)) * 1009 + index * 31 + step) % (2**31)
    gen = torch.Generator().manual_seed(seed)
    kind, a, b = (int(x) for x in torch.randint(0, 7, (3,), generator=gen))

    def call(name: str, **arguments: int) -> str:
        return json.dumps({"name": name, "arguments": arguments})

    calls = {
        0: [call("multiply", a=a, b=b)],
        1: [call("multiply", a=a, b=b), call("add", a=b, b=a)],
        2: [call("divide", a=a, b=b)],  # no such tool
        3: [call("multiply", x=a)],  # wrong arguments
        4: [call("add", a=a, b=b)],
    }
    if (tool_turns == 0 and kind in calls) or (tool_turns == 1 and kind in (0, 1)):
        return "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls[kind]) + "<|im_end|>"
    return f"It is {a * b + tool_turns}." + ("<|im_end|>" if kind != 6 else " " * 200)  # 6: truncated


class ScriptedCompletions:
    """Completions by `scripted_text` (tool calls included), wherever the prompts are (see _grpo.FixedCompletions)."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        tokenizer = self.processing_class
        response = tokenizer.convert_tokens_to_ids("<tool_response>")
        first = self.accelerator.process_index * len(prompt_ids)
        out = []
        for i, ids in enumerate(prompt_ids):
            text = scripted_text(list(ids), first + i, self.state.global_step, list(ids).count(response))
            out.append(tokenizer.encode(text, add_special_tokens=False)[: self.max_completion_length])
        return out, None


def tool_reward(completions, **kwargs) -> list[float]:
    """A reward reading the tool results: their sum over 100, minus 0.1 per failed call, plus 0.01 per word."""
    out = []
    for messages in completions:
        score = 0.0
        for message in messages:
            content = message.get("content") or ""
            if message["role"] == "tool":
                score += float(content) / 100 if content.lstrip("-").isdigit() else -0.1
            else:
                score += 0.01 * len(str(content).split())
        out.append(score)
    return out


def run_tools(hf_dir: str, output_dir: str, parallel: bool, environment: bool = False, **options) -> dict:
    """TRL's GRPOTrainer on this process, or ParallelGRPOTrainer on this rank, with the tools (or the `Ledger`
    environment) and scripted completions: every figure logged, the completions logged and this process's calls."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from optimum_parallel.integrations.trl import ParallelGRPOConfig, ParallelGRPOTrainer

    base, config = (ParallelGRPOTrainer, ParallelGRPOConfig) if parallel else (GRPOTrainer, GRPOConfig)
    trainer_class = type("Scripted" + base.__name__, (ScriptedCompletions, base), {})
    CALLS.clear()
    args = config(**grpo_args(output_dir, **TOOL_OPTIONS, **options))
    extra = {"environment_factory": Ledger} if environment else {"tools": [multiply, add]}
    trainer = trainer_class(
        hf_dir, reward_funcs=tool_reward, args=args, train_dataset=questions(),
        processing_class=AutoTokenizer.from_pretrained(hf_dir), **extra,
    )  # fmt: skip
    trainer.train()
    return {"every": every_figure(trainer.state.log_history), "completions": list(trainer._logs["completion"]),
            "calls": list(CALLS)}  # fmt: skip


def check_figures(got: dict, expected: dict, rank: int) -> None:
    assert sorted(got) == sorted(expected), (rank, got, expected)
    for step in expected:
        assert sorted(got[step]) == sorted(expected[step]), (rank, step, got[step], expected[step])
    worst = worst_errors(got, expected)
    assert max(worst.values()) <= TOL, (rank, worst, got, expected)


def print_figures(name: str, got: dict, expected: dict) -> None:
    """TRL's loss, reward, kl and tool figures per step, and the worst relative error of every figure (`pytest -s`)."""
    shown = ("loss", "reward", "kl", "tools/")
    for step, figures in sorted(expected.items()):
        print(f"{name} step {step} (TRL):", {k: f"{v:.6g}" for k, v in figures.items() if k.startswith(shown)})
    worst = {k: f"{v:.1e}" for k, v in worst_errors(got, expected).items() if v}
    print(f"{name} at tp=2, worst relative error (the others exact):", worst)


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory) -> str:
    return save_tool_model(str(tmp_path_factory.mktemp("hf") / "tools"))


@pytest.mark.parametrize("environment", [False, True], ids=["tools", "environment"])
def test_tools_at_tp2_match_trl_on_one_process(pool, tool_dir, tmp_path, environment):
    """Sync and async tools (or an environment's methods, its `reset` observation and `get_reward`) run on rank 0
    only, as TRL runs them on its one process; rank 1 makes no environment and calls nothing; both ranks log TRL's
    completions (tool messages included) and every figure (tool call and failure frequencies included)."""
    expected = run_tools(tool_dir, str(tmp_path / "reference"), parallel=False, environment=environment)
    assert expected["every"][1]["tools/call_frequency"] > 0 and expected["every"][1]["tools/failure_frequency"] > 0
    assert any(call[0] == "add" for call in expected["calls"])  # the async tool ran
    results = pool.run(run_tools, tool_dir, str(tmp_path / "parallel"), True, environment, tensor_parallel_size=2)
    for rank, result in enumerate(results):
        check_figures(result["every"], expected["every"], rank)
        assert result["completions"] == expected["completions"], rank
    assert results[0]["calls"] == expected["calls"] and results[1]["calls"] == []
    print_figures("environment" if environment else "tools", results[0]["every"], expected["every"])


def rollout(prompts: list, trainer) -> dict:
    """A rollout function: completions of random length and tokens from the default generator (on one process its
    stream; at tp=2 rank 0's, whose state reaches rank 1 with the result), an extra field for the reward and an
    env_mask hiding each completion's second token from the loss."""
    CALLS.append(("rollout", len(prompts)))
    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    completion_ids = []
    for _ in prompts:
        length = int(torch.randint(1, 9, ()))
        completion_ids.append(torch.randint(3, 128, (length,)).tolist()[:-1] + [2])
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": [[-1.0] * len(ids) for ids in completion_ids],
        "env_mask": [[1] + [0] + [1] * (len(ids) - 2) if len(ids) > 2 else [1] * len(ids) for ids in completion_ids],
        "bonus": [len(ids) / 10 for ids in completion_ids],
    }


def bonus(completions, bonus, **kwargs) -> list[float]:
    return bonus


ROLLOUT_OPTIONS = {"per_device_train_batch_size": 6, "steps_per_generation": 2, "eval_strategy": "no"}


def run_rollout(hf_dir: str, output_dir: str, parallel: bool, **options) -> dict:
    """TRL's GRPOTrainer on this process, or ParallelGRPOTrainer on this rank, with `rollout`: every figure logged,
    the completions logged and this process's rollouts."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from optimum_parallel.integrations.trl import ParallelGRPOConfig, ParallelGRPOTrainer

    trainer_class, config = (ParallelGRPOTrainer, ParallelGRPOConfig) if parallel else (GRPOTrainer, GRPOConfig)
    CALLS.clear()
    args = config(**grpo_args(output_dir, **ROLLOUT_OPTIONS, **options))
    trainer = trainer_class(
        hf_dir, reward_funcs=[even_tokens, bonus], args=args, train_dataset=prompts(),
        processing_class=AutoTokenizer.from_pretrained(hf_dir), rollout_func=rollout,
    )  # fmt: skip
    trainer.train()
    return {"every": every_figure(trainer.state.log_history), "completions": list(trainer._logs["completion"]),
            "calls": list(CALLS)}  # fmt: skip


def test_rollout_func_at_tp2_matches_trl_on_one_process(pool, tmp_path):
    """The rollout function runs on rank 0 only; its completions, extra field and env_mask reach rank 1, and so do
    the random states it drew from (TRL then shuffles the generation batch for its 2 steps with them)."""
    hf_dir = save_tiny_llama(str(tmp_path / "llama"))
    expected = run_rollout(hf_dir, str(tmp_path / "reference"), parallel=False)
    results = pool.run(run_rollout, hf_dir, str(tmp_path / "parallel"), True, tensor_parallel_size=2)
    for rank, result in enumerate(results):
        check_figures(result["every"], expected["every"], rank)
        assert result["completions"] == expected["completions"], rank
    print_figures("rollout_func", results[0]["every"], expected["every"])
    assert results[0]["calls"] == expected["calls"] and len(expected["calls"]) == 2 and results[1]["calls"] == []


def loaded_dtypes(hf_dir: str, output_dir: str, init_kwargs: dict | None) -> tuple[str, str, list[str]]:
    """The policy's and the reference's parameter dtypes, the policy given as a path at tp=2, and what TRL warned."""
    import logging

    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelGRPOConfig, ParallelGRPOTrainer

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    kept = Kept()
    logging.getLogger("trl.trainer.grpo_trainer").addHandler(kept)
    args = ParallelGRPOConfig(**grpo_args(output_dir, eval_strategy="no", tensor_parallel_size=2,
                                          model_init_kwargs=init_kwargs))  # fmt: skip
    trainer = ParallelGRPOTrainer(hf_dir, reward_funcs=even_tokens, args=args, train_dataset=prompts(),
                                  processing_class=AutoTokenizer.from_pretrained(hf_dir))  # fmt: skip
    logging.getLogger("trl.trainer.grpo_trainer").removeHandler(kept)
    policy = {p.dtype for p in trainer.model.parameters()}
    reference = {p.dtype for p in trainer.ref_model.parameters()}
    return str(policy), str(reference), kept.messages


def test_a_path_policy_is_loaded_in_float32_unless_model_init_kwargs_name_a_dtype(pool, tmp_path):
    """A bfloat16 checkpoint (transformers' "auto" would keep bfloat16): float32 by default as TRL loads it, and the
    dtype `model_init_kwargs` names otherwise, the reference alike; TRL does not warn that they were ignored."""
    from transformers import AutoModelForCausalLM

    hf_dir = save_tiny_llama(str(tmp_path / "llama"))
    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(hf_dir)
    for init_kwargs, want in ((None, torch.float32), ({"dtype": "bfloat16"}, torch.bfloat16),
                              ({"dtype": "float32"}, torch.float32)):  # fmt: skip
        for policy, reference, warned in pool.run(loaded_dtypes, hf_dir, str(tmp_path / "out"), init_kwargs):
            assert policy == reference == str({want}), (init_kwargs, policy, reference)
            assert not any("model_init_kwargs" in message for message in warned), warned
