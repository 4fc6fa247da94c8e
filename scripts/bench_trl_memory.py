"""Benchmark the peak memory per rank of one DPO training step: TRL's DPOTrainer on one process against
ParallelDPOTrainer at tp=1 (one process) and tp=2 (two processes, gloo), on CPU (issue 49, "the head's memory").

What it runs
    A random Llama built from LlamaConfig (no hub access), saved once with save_pretrained with a word-level
    tokenizer (token i is the word `t{i}`): hidden 896, MLP 4864, 14 heads, 2 kv heads, vocab 128256, untied head,
    24 layers by default (Qwen2.5-0.5B's geometry with Llama 3's vocabulary, ~0.59B parameters), fp32. One
    preference pair whose prompt + chosen and prompt + rejected rows are --seq tokens each (default 2048: 4096
    tokens in the step, nearly all of them completion tokens the head scores), per_device_train_batch_size=1, one
    step (max_steps=1) of DPO with --optim (default adamw_torch), gradient checkpointing on (DPOConfig's default)
    and precompute_ref_log_probs=True (no reference model held: the reference's log-probabilities come from the
    policy's forward before training, without a graph), identically for every configuration.
    DPO is the trainer that scores through TRL's fused LM head here (TRL's SFTTrainer's parallel counterpart uses the
    model's own vocab-parallel loss): TRL's `add_fused_lm_head` multiplies the hidden states by the head in tiles of
    4096 tokens x 32768 vocabulary ids and never holds the tokens x vocab logits; ParallelDPOTrainer's head
    (`integrations/trl/fused_head.py`) scores chunks of tokens against this rank's vocabulary slice
    (`tensor_parallel/logprobs.head_token_scores`, CHUNK_ELEMENTS logits a chunk).
    --configs unchunked-tp1 / unchunked-tp2 add the parallel trainer with the model's own forward computing the
    whole local logits (the path a head the chunked path cannot use takes), to show what chunking saves.

How it measures
    Each configuration runs in its own freshly spawned processes (one intra-op thread each, MALLOC_MMAP_THRESHOLD_
    =65536 so glibc unmaps freed blocks of 64 KiB or more and the RSS follows the live tensors), one after the other.
    In the worker: the peak RSS of the whole process (VmHWM: imports, loading the checkpoint, the reference pass,
    the step) and the peak of the training step alone (VmHWM reset through /proc/self/clear_refs just before
    `train()`), per rank; the table shows the rank with the most and the ratios to TRL's.

Size and time on the 2-core development machine
    A core does about 27 GFLOP/s of fp32 there (shared with other jobs), so a step of the 24-layer model would take
    an estimated 10 minutes a configuration. The run committed with issue 49 used `--layers 4` (0.289B parameters,
    the same vocabulary 128256, the same 4096 tokens, AdamW; 12 minutes in all, steps of 2-3 minutes): the head and
    the embedding are then most of the parameters, which is where the head's memory shows. The script prints the
    model and the step it ran above the table.

How to run
    python scripts/bench_trl_memory.py                          # the 0.5B model: an estimated 30-45 min on 2 cores
    python scripts/bench_trl_memory.py --layers 4               # ~12 minutes on 2 cores
    python scripts/bench_trl_memory.py --layers 4 --configs trl tp1 unchunked-tp1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers
from _common import (
    Stopwatch,
    add_llama_args,
    add_run_args,
    llama_config,
    print_table,
    proc_status_bytes,
    quiet_transformers,
)
from _ranks import run_on_ranks

MMAP_THRESHOLD_ENV, MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_", 64 * 1024  # glibc: mmap (and unmap) large blocks
PROMPT_TOKENS = 16
CONFIGS = {  # name: (trainer, processes = tp, chunked head)
    "trl": ("TRL DPOTrainer", 1, True),
    "tp1": ("ParallelDPOTrainer tp=1", 1, True),
    "tp2": ("ParallelDPOTrainer tp=2", 2, True),
    "unchunked-tp1": ("ParallelDPOTrainer tp=1, whole local logits", 1, False),
    "unchunked-tp2": ("ParallelDPOTrainer tp=2, whole local logits", 2, False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llama_args(parser, seq=2048, layers=24, vocab=128256, seq_help="tokens per row (a pair is 2 rows)")
    parser.set_defaults(hidden=896, intermediate=4864, heads=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim (sgd: no optimizer state)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["trl", "tp1", "tp2"])
    add_run_args(parser, deadline=3600, deadline_help="seconds before a configuration's workers are killed")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------------------
# The checkpoint, the pair, the trainer


def word_tokenizer(vocab_size: int):
    """Token i is the word `t{i}` (no hub download)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("t[0-9]+"), "isolated")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t2", unk_token="t1")


def save_checkpoint(rank: int, world: int, args: argparse.Namespace, path: str) -> int:
    """The random model and its tokenizer at `path` (in a worker, so the parent stays small); its parameter count."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    config = llama_config(args, longest=args.seq + 8)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 2, None
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    model.save_pretrained(path)
    word_tokenizer(args.vocab).save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def preference_pair(args: argparse.Namespace):
    """One pair: a prompt of PROMPT_TOKENS words, chosen and rejected completions filling --seq tokens a row (TRL
    appends the eos)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(args.seed + 1)

    def words(n: int) -> str:
        return " ".join(f"t{i}" for i in torch.randint(3, args.vocab, (n,), generator=gen).tolist())

    completion = args.seq - PROMPT_TOKENS - 1
    return Dataset.from_list([{"prompt": words(PROMPT_TOKENS), "chosen": " " + words(completion),
                               "rejected": " " + words(completion)}])  # fmt: skip


def trainer_args(args: argparse.Namespace, output_dir: str, tp: int | None) -> dict:
    options = dict(
        output_dir=output_dir, per_device_train_batch_size=1, max_steps=1, learning_rate=1e-5, optim=args.optim,
        logging_steps=1, seed=args.seed, report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no",
        bf16=False, beta=0.1, max_length=args.seq + 8, precompute_ref_log_probs=True, gradient_checkpointing=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    if tp is not None:
        options.update(tensor_parallel_size=tp, ddp_timeout=600)
    return options


# --------------------------------------------------------------------------------------------------------------
# Measuring


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


@dataclass
class RankMemory:
    process_peak: int  # VmHWM over the process's life, bytes
    step_peak: int | None  # VmHWM during train() alone
    before_step: int  # VmRSS just before train()
    seconds: float  # of train()
    loss: float


def run_config(rank: int, world: int, name: str, args: argparse.Namespace, model_dir: str) -> list[RankMemory]:
    """One configuration on this rank; rank 0 returns every rank's numbers."""
    import datasets
    from transformers import AutoTokenizer

    quiet_transformers()
    datasets.disable_progress_bars()
    _, tp, chunked = CONFIGS[name]
    if not chunked:  # the model's own forward computes the whole local logits
        from optimum_parallel.integrations.trl import fused_head

        fused_head.head_projection = lambda model: None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = preference_pair(args)
    output_dir = tempfile.mkdtemp(prefix="bench_trl_memory_")
    if name == "trl":
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(**trainer_args(args, output_dir, None), model_init_kwargs={"dtype": torch.float32})
        trainer = DPOTrainer(model_dir, args=config, train_dataset=data, processing_class=tokenizer)
    else:
        from optimum_parallel.integrations.trl import ParallelDPOConfig, ParallelDPOTrainer

        config = ParallelDPOConfig(**trainer_args(args, output_dir, tp))
        trainer = ParallelDPOTrainer(model_dir, args=config, train_dataset=data, processing_class=tokenizer,
                                     model_kwargs={"dtype": torch.float32})  # fmt: skip
    before, peak_before = proc_status_bytes("VmRSS"), proc_status_bytes("VmHWM")
    resettable = reset_peak_rss()
    with Stopwatch() as watch:
        trainer.train()
    seconds = watch.seconds
    loss = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    peak = proc_status_bytes("VmHWM")
    mine = RankMemory(max(peak, peak_before), peak if resettable else None, before, seconds, loss)
    if world == 1:
        return [mine]
    everyone: list[RankMemory | None] = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone  # type: ignore[return-value]


def launch(name: str, args: argparse.Namespace, model_dir: str) -> list[RankMemory]:
    os.environ[MMAP_THRESHOLD_ENV] = str(MMAP_THRESHOLD)
    return run_on_ranks(CONFIGS[name][1], run_config, (name, args, model_dir), args.deadline, name)


# --------------------------------------------------------------------------------------------------------------
# Report


def gib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.2f}"


def ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}x"


def report(results: dict[str, list[RankMemory]]) -> None:
    base = results.get("trl")
    base_peak = max(r.process_peak for r in base) if base else None
    base_step = max(r.step_peak or 0 for r in base) if base else None
    rows = []
    for name, ranks in results.items():
        peak = max(r.process_peak for r in ranks)
        step = None if any(r.step_peak is None for r in ranks) else max(r.step_peak for r in ranks)
        rows.append((
            CONFIGS[name][0], str(len(ranks)), gib(peak), ratio(peak, base_peak), gib(step), ratio(step, base_step),
            gib(max(r.before_step for r in ranks)), f"{max(r.seconds for r in ranks):.0f}", f"{ranks[0].loss:.4f}",
        ))  # fmt: skip
    header = ("configuration", "processes", "peak RSS GiB / rank", "x TRL", "step peak GiB / rank", "x TRL",
              "RSS before step", "step s", "loss")  # fmt: skip
    print("\nPeak memory per rank of one DPO step (the rank with the most; GiB = 2^30 bytes)\n")
    print_table(header, rows, align_numbers=True)
    goals = {"tp1": 1.0, "tp2": 0.6}  # issue 49: the parallel trainer's peak per rank against TRL's
    met = [f"{CONFIGS[n][0]} {max(r.process_peak for r in results[n]) / base_peak:.2f}x <= {goal}x: "
           f"{'met' if max(r.process_peak for r in results[n]) <= goal * base_peak else 'NOT met'}"
           for n, goal in goals.items() if n in results and base_peak]  # fmt: skip
    if met:
        print("\ngoal (peak RSS per rank against TRL's): " + "; ".join(met))
    print(
        "\npeak RSS: VmHWM over the process's life (imports, loading, the reference pass, the step); step peak: VmHWM "
        "reset just before train(), so the step's own high-water mark (the RSS it started from included).\n"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_transformers()
    tokens = 2 * args.seq
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, gloo, {os.cpu_count()} CPUs, "
        "1 thread a process",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench_trl_memory_model_") as model_dir:
        print("saving the random checkpoint ...", file=sys.stderr, flush=True)
        params = run_on_ranks(1, save_checkpoint, (args, model_dir), args.deadline, "checkpoint")
        note = "" if args.layers == 24 else f" (fewer layers than the 0.5B geometry's 24: --layers {args.layers})"
        print(
            f"model: Llama, hidden {args.hidden}, MLP {args.intermediate}, {args.heads} heads / {args.kv_heads} kv, "
            f"{args.layers} layers{note}, vocab {args.vocab}, untied head: {params / 1e9:.3f}B parameters, fp32\n"
            f"step: DPO, one pair = 2 rows x {args.seq} tokens = {tokens} tokens ({PROMPT_TOKENS}-token prompt), "
            f"optim {args.optim}, gradient checkpointing, precompute_ref_log_probs=True, max_steps=1",
            flush=True,
        )
        results = {}
        for name in args.configs:
            print(f"{CONFIGS[name][0]} on {CONFIGS[name][1]} process(es) ...", file=sys.stderr, flush=True)
            results[name] = launch(name, args, model_dir)
    report(results)


if __name__ == "__main__":
    main()
