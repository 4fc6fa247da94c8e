"""SFT's token metrics (`entropy`, `mean_token_accuracy`) from the logits the model's own loss reads, on every layout.

TRL's `SFTTrainer` reads them from its fused LM head; `ParallelSFTTrainer` trains with the model's own loss
(vocab-parallel under tp, summed over cp, on the last stage under pp), so the numbers come from where that loss is
computed: `TokenMetrics` wraps the model's `loss_function` and, while a training or evaluation step records, adds up
per token the entropy, the argmax hits and the labelled tokens of the logits it is given (`token_statistics`: this
rank's vocabulary slice, its chunks of the sequence, its micro-batches). `collect` sums them over the pp stages (only
the last one holds any), the cp ranks and the batch replicas: every rank then holds the whole batch's sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...mesh import ParallelMesh
from ...state import parallel_state
from ...tensor_parallel.logprobs import IGNORE_INDEX, token_statistics, vocab_slice


class TokenMetrics:
    """Wraps `model.loss_function` (see the module docstring); `with metrics.recording(): ...` turns it on."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.inner = model, model.loss_function
        self.records: list[torch.Tensor] = []  # per loss call: entropy, hits, labelled tokens
        self.recording = False

    @classmethod
    def install(cls, model: nn.Module) -> TokenMetrics:
        metrics = cls(model)
        model.loss_function = metrics
        return metrics

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX, **kwargs):
        loss = self.inner(
            logits=logits,
            labels=labels,
            vocab_size=vocab_size,
            num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index,
            **kwargs,
        )
        if self.recording:
            self._record(logits, labels, kwargs.get("shift_labels"), ignore_index)
        return loss

    def _record(self, logits, labels, shift_labels, ignore_index: int) -> None:
        if parallel_state(self.model).context_parallel is not None:
            targets = labels  # the input split shifted and cut them
        elif shift_labels is not None:
            targets = shift_labels
        else:  # the causal shift every transformers causal-LM loss makes
            targets = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        head = vocab_slice(self.model)
        stats = token_statistics(logits, targets, head.group, head.vocab_start, head.vocab_size, ignore_index)
        sums = [stats.entropy.double().sum(), stats.correct.double().sum(), (targets != ignore_index).double().sum()]
        self.records.append(torch.stack(sums))

    def collect(self, mesh: ParallelMesh, device: torch.device, last: int | None = None) -> tuple[float, float] | None:
        """(entropy, mean token accuracy) of what was recorded since the last call (of the `last` loss calls only:
        under pp, torch's pipelining calls the loss once more at a schedule's first step, on placeholder outputs, to
        infer the gradients' shapes), over the whole batch (a collective over pp, cp and the batch replicas); None
        when no labelled token was seen."""
        records = self.records if last is None else self.records[-last:]
        sums = torch.stack(records).sum(0) if records else torch.zeros(3, dtype=torch.double, device=device)
        self.records = []
        for dim in ("pp", "cp", "batch"):
            if mesh.size(dim) > 1:
                dist.all_reduce(sums, group=mesh.group(dim))
        entropy, hits, count = sums.tolist()
        return None if count == 0 else (entropy / count, hits / count)
