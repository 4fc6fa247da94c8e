"""What the TRL trainers share under pipeline parallelism: the refusal of pp with cp (`check_whole_rows`) and the loss
swap of their two-pass step's second pass (`surrogate_loss`), where the pipeline backpropagates a surrogate loss whose
gradient is that of TRL's loss."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from ..transformers.training_args import ParallelTrainingArguments


def check_whole_rows(args: ParallelTrainingArguments, trainer: str, why: str) -> None:
    """ValueError naming `trainer` for pp > 1 with cp > 1: its pipeline works on whole rows (`why` says how)."""
    if args.pipeline_parallel_size > 1 and args.context_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size={args.pipeline_parallel_size} with context_parallel_size="
            f"{args.context_parallel_size} is not supported by {trainer} ({why}); allowed with pp > 1: "
            "context_parallel_size=1"
        )


@contextlib.contextmanager
def surrogate_loss(root: nn.Module, loss_function: Callable) -> Iterator[None]:
    """For the block, `root.loss_function` (the loss the pipeline's `run_train` backpropagates) is `loss_function`."""
    previous, root.loss_function = root.loss_function, loss_function
    try:
        yield
    finally:
        root.loss_function = previous
