"""What the benchmark scripts share: the random Llama they build (its arguments, config and batch; the ~0.5B one
of the load and checkpoint benchmarks), the timing harness (one clock, `now`; timed steps after a warm-up, in rounds
over variants, the slowest rank's time, median and p90; a `Stopwatch` for one-off spans), the result rows every
benchmark reports in one schema (`record`, and every `print_table` row; `scripts/bench.py NAME --json` writes them),
the table printer (optimum_parallel/memory_planner/tables.py's, as markdown), quiet transformers, and byte counts of
tensors and of the process.

    parser = argparse.ArgumentParser(...)
    add_llama_args(parser, seq=256, layers=4, vocab=8192)
    args = parser.parse_args()
    model = build_llama(args, "sdpa")                 # the same fp32 weights in every process (args.seed)
    batch = random_batch(args.vocab, args.batch, args.seq, args.seed)
    seconds = timed_steps(lambda: train_step(model, batch, optimizer), timed=args.steps, warmup=args.warmup)
    print_table(("variant", "median ms"), [("eager", f"{seconds.median * 1e3:.1f}")])  # seconds.p90 too
    with Stopwatch() as watch:                        # a one-off span (a load, a save) on the same clock
        load()
    record("load", "time", watch.seconds, "s")        # a result row that is not in a printed table

The result schema (`results_document`, version 1): {"schema": 1, "benchmark": NAME, "config": {the parsed
arguments}, "argv": [...], "tables": [{"name", "columns"}], "rows": [{"table", "row", "variant", "metric", "value",
"unit", "ratio_to", "text"}], "environment": {torch, transformers, python, platform, cpus, load average, date,
git}}. A row's `value` is a number where its cell reads as one (else null, with the cell in `text`), `ratio_to` the
"(0.94x)" beside it; `row` the printed table's row (absent for a `record`ed one: its variant is its row);
`scripts/readme_tables.py` prints the tables back from `text`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from optimum_parallel.memory_planner.tables import table

Batch = dict[str, torch.Tensor]

LLAMA_0_5B = dict(  # ~0.5B parameters: the Llama of bench_load.py and bench_checkpoint.py
    vocab_size=32000,
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@dataclass
class StepResult:
    """The step times (ms) and loss of one benchmark variant, or why it failed."""

    name: str
    times_ms: list[float] = field(default_factory=list)
    loss: float | None = None
    error: str | None = None

    @property
    def median(self) -> float:
        return StepTimes(self.times_ms).median

    @property
    def p90(self) -> float:
        return StepTimes(self.times_ms).p90


def train_step(model: nn.Module, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Forward, backward, optimizer step, gradients set to None: the step the benchmarks time; its loss, detached."""
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


now = time.perf_counter  # the one clock every benchmark times with (seconds)


class Stopwatch:
    """The seconds of the `with` block on `now`: `with Stopwatch() as watch: ...` then `watch.seconds`."""

    def __enter__(self) -> Stopwatch:
        self.start = now()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = now() - self.start


class StepTimes(list):
    """Step times (seconds, or whatever unit they were put in) with their median and 90th percentile."""

    @property
    def median(self) -> float:
        return statistics.median(self)

    @property
    def p90(self) -> float:
        """The value at the nearest rank to 90% (a time a step took, not an interpolation)."""
        ordered = sorted(self)
        return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def timed_rounds(
    steps: Sequence[Callable[[], object]],
    *,
    timed: int,
    warmup: int = 0,
    before: Callable[[], object] | None = None,
    across_ranks: bool = False,
) -> list[StepTimes]:
    """The seconds of each of `steps` over `timed` rounds after `warmup` untimed ones; a round calls each step once,
    so a change in the machine's load falls on every variant alike. `before()` (a barrier, a device synchronize)
    runs before each call, outside the time; with `across_ranks`, each time is the slowest rank's."""
    seconds = [StepTimes() for _ in steps]
    for round_ in range(warmup + timed):
        for step, times in zip(steps, seconds, strict=True):
            if before is not None:
                before()
            start = now()
            step()
            elapsed = now() - start
            if round_ >= warmup:
                times.append(elapsed)
    return [slowest_rank(times) for times in seconds] if across_ranks else seconds


def timed_steps(
    step: Callable[[], object],
    *,
    timed: int,
    warmup: int = 0,
    before: Callable[[], object] | None = None,
    across_ranks: bool = False,
) -> StepTimes:
    """The seconds of `timed` calls of `step` after `warmup` untimed ones (see `timed_rounds`)."""
    return timed_rounds([step], timed=timed, warmup=warmup, before=before, across_ranks=across_ranks)[0]


def slowest_rank(seconds: list[float]) -> StepTimes:
    """Each step's time on the slowest rank (a step ends when every rank is done); as is on one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return StepTimes(seconds)
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return StepTimes(slowest.tolist())


def markdown_lines(
    header: Sequence[str], rows: Iterable[Sequence[object]], *, align_numbers: bool = False
) -> list[str]:
    """A markdown table, padded by the planning reports' printer (`memory_planner/tables.py`): columns as wide as their
    widest cell; with `align_numbers`, every column but the first right-aligned."""
    lines = table(list(header), [list(row) for row in rows], align_numbers=align_numbers)
    widths = [len(rule) for rule in lines[1].split("  ")]  # the printer's rule: one run of dashes per column
    out = []
    for line in lines:
        starts = [sum(widths[:c]) + 2 * c for c in range(len(widths))]
        cells = [line[start : start + w].ljust(w) for start, w in zip(starts, widths, strict=True)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def print_table(
    header: Sequence[str], rows: Iterable[Sequence[object]], *, align_numbers: bool = False, title: str = ""
) -> None:
    """`markdown_lines` printed, and every row recorded as result rows (`record_table`) under `title`."""
    rows = [[str(cell) for cell in row] for row in rows]
    record_table(header, rows, title=title)
    print("\n".join(markdown_lines(header, rows, align_numbers=align_numbers)))


# Results: one schema for every benchmark


@dataclass
class Results:
    """What this process's benchmark reported: its rows, its tables' columns, its parsed arguments."""

    benchmark: str = ""
    config: dict = field(default_factory=dict)
    tables: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)


RESULTS = Results()
UNITS = ("tokens/s", "ms", "us", "s", "MiB", "GiB", "KiB", "MB", "GB", "B", "x", "%")
_UNIT_WORDS = {"seconds": "s", "sec": "s"}
_NUMBER = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)\s*([A-Za-z/%]*)\s*(?:\(([-+]?\d+(?:\.\d+)?)x\))?")


def record(
    variant: str,
    metric: str,
    value: float | None,
    unit: str = "",
    *,
    ratio_to: float | None = None,
    table: str = "",
    text: str | None = None,
) -> None:
    """One result row: `variant`'s `metric` (a number in `unit`, or None), `ratio_to` a reference where it has one."""
    if text is None:
        text = "" if value is None else f"{value:g}"
    if not any(t["name"] == table for t in RESULTS.tables):
        RESULTS.tables.append({"name": table, "columns": ["", metric]})
    columns = next(t for t in RESULTS.tables if t["name"] == table)["columns"]
    if metric not in columns:
        columns.append(metric)
    RESULTS.rows.append(
        {"table": table, "variant": variant, "metric": metric, "value": value, "unit": unit, "ratio_to": ratio_to,
         "text": text}
    )  # fmt: skip


def parse_cell(text: str, header: str = "") -> tuple[float | None, str, float | None]:
    """A printed cell as (value, unit, ratio): "12.02 (0.94x)" -> (12.02, "", 0.94); the unit from the cell
    ("3.2 GiB") or else the header's last word ("median ms"); (None, "", None) for text that is not a number."""
    match = _NUMBER.match(text.replace(",", ""))
    if not match or text.strip() in ("-", ""):
        return None, "", None
    number, unit, ratio = match.groups()
    if unit not in UNITS:
        words = header.replace("(", " ").replace(")", " ").split()
        last = _UNIT_WORDS.get(words[-1], words[-1]) if words else ""
        unit = last if last in UNITS else ""
    return float(number), unit, float(ratio) if ratio else None


def record_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, title: str = "") -> None:
    """Each row of a printed table as result rows: its first cell the variant, every other column a metric."""
    name = title or f"table {len(RESULTS.tables) + 1}"
    RESULTS.tables.append({"name": name, "columns": [str(h) for h in header]})
    for index, row in enumerate(rows):
        for column, cell in zip(header[1:], row[1:], strict=True):
            value, unit, ratio = parse_cell(cell, column)
            RESULTS.rows.append(
                {"table": name, "row": index, "variant": row[0], "metric": str(column), "value": value, "unit": unit,
                 "ratio_to": ratio, "text": cell}
            )  # fmt: skip


def environment() -> dict:
    """Where the numbers came from: versions, the machine's CPUs and load, the date, the commit."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": commit,
    }


def results_document(argv: Sequence[str] = ()) -> dict:
    """The result schema (module docstring) of what this process recorded."""
    return {
        "schema": 1,
        "benchmark": RESULTS.benchmark,
        "config": RESULTS.config,
        "argv": list(argv),
        "tables": RESULTS.tables,
        "rows": RESULTS.rows,
        "environment": environment(),
    }


def add_llama_args(
    parser: argparse.ArgumentParser,
    *,
    seq: int,
    layers: int = 4,
    vocab: int = 8192,
    heads_help: str | None = None,
    vocab_help: str | None = None,
    seq_help: str | None = None,
) -> None:
    """--seq, --layers, --hidden, --intermediate, --heads and --vocab of the benchmark's Llama."""
    parser.add_argument("--seq", type=int, default=seq, help=seq_help)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument(
        "--intermediate", type=int, default=None, help="MLP size (default: Llama's 11008/4096 x hidden)"
    )
    parser.add_argument("--heads", type=int, default=8, help=heads_help)
    parser.add_argument("--vocab", type=int, default=vocab, help=vocab_help)


def add_run_args(parser: argparse.ArgumentParser, *, deadline: float, deadline_help: str) -> None:
    """--seed (of the weights and the batches) and --deadline (seconds before the workers are killed)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=deadline, help=deadline_help)


def llama_config(args: argparse.Namespace, longest: int | None = None) -> LlamaConfig:
    """The Llama of `add_llama_args`'s arguments (kv heads: --kv-heads where a script has it, else --heads),
    that fits `longest` tokens (default --seq), untied head."""
    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or args.hidden * 11008 // 4096,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=getattr(args, "kv_heads", None) or args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(512, longest or args.seq),
        tie_word_embeddings=False,
    )


def build_llama(args: argparse.Namespace, attn: str, config: LlamaConfig | None = None) -> nn.Module:
    """The same random fp32 model in every process (seeded by --seed); train mode (Llama has no dropout:
    train() and eval() compute the same thing)."""
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config or llama_config(args), attn_implementation=attn)
    return model.float().train()


def random_batch(vocab: int, rows: int, seq: int, seed: int) -> Batch:
    """input_ids of `rows` x `seq` random tokens (generator seeded with seed + 1) and the same ids as labels."""
    generator = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def quiet_transformers() -> None:
    """No warnings or progress bars from transformers in the benchmark output."""
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 parameters, gradients, optimizer state, transformers' TP); any other
    tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Iterable[object]) -> int:
    """Bytes of this rank's data of the tensors among `tensors` (DTensors by their local shard)."""
    total = 0
    for t in tensors:
        if torch.is_tensor(t):
            t = local_tensor(t)
            total += t.numel() * t.element_size()
    return total


def proc_status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM, ...) in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not in /proc/self/status")
