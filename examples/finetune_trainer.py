"""Fine-tune a causal LM on a local text file with `ParallelTrainer` (tensor, sequence, pipeline, data parallelism).

One machine, 4 processes as dp=2 x tp=2 (CPU/gloo or GPUs/NCCL):

    torchrun --nproc-per-node 4 examples/finetune_trainer.py --model_name_or_path MODEL_DIR --text_file data.txt \
        --output_dir out --tensor_parallel_size 2 --per_device_train_batch_size 4 --save_steps 100

Resume (also at another --tensor_parallel_size / --pipeline_parallel_size: the checkpoint is resharded) with
`--resume_from_checkpoint out/checkpoint-100` (or `last`). At the end `out/` holds a consolidated checkpoint that
`AutoModelForCausalLM.from_pretrained("out")` loads. Every `TrainingArguments` option works as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, HfArgumentParser, TrainerCallback

from optimum_parallel.integrations.transformers.trainer import ParallelTrainer
from optimum_parallel.integrations.transformers.training_args import ParallelTrainingArguments


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "A local Hugging Face checkpoint directory."})
    text_file: str = field(metadata={"help": "UTF-8 text to fine-tune on."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training sequence (the text is packed)."})
    eval_blocks: int = field(default=0, metadata={"help": "Blocks held out at the end of the text for evaluation."})
    byte_tokens: bool = field(
        default=False, metadata={"help": "Use the text's UTF-8 bytes as token ids (models without a tokenizer)."}
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "Dtype of the loaded weights; for mixed precision keep float32, add --bf16."},
    )


class Blocks(torch.utils.data.Dataset):
    """Fixed-length blocks of token ids; every token is a label, so every sequence weighs the same in the loss."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index].clone()}


def packed_blocks(script: ScriptArguments, tokenizer) -> tuple[Blocks, Blocks | None]:
    """The text's tokens cut into `block_size` blocks (the tail dropped); the last `eval_blocks` for evaluation."""
    with open(script.text_file, encoding="utf-8") as f:
        text = f.read()
    ids = list(text.encode()) if tokenizer is None else tokenizer(text)["input_ids"]
    count = len(ids) // script.block_size
    if count <= script.eval_blocks:
        raise ValueError(
            f"{script.text_file}: {len(ids)} tokens make {count} blocks of {script.block_size}; "
            f"need more than eval_blocks={script.eval_blocks}"
        )
    blocks = torch.tensor(ids[: count * script.block_size]).view(count, script.block_size)
    train, held_out = blocks[: count - script.eval_blocks], blocks[count - script.eval_blocks :]
    return Blocks(train), (Blocks(held_out) if script.eval_blocks else None)


def main(argv: list[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> ParallelTrainer:
    parser = HfArgumentParser((ScriptArguments, ParallelTrainingArguments))
    script, args = parser.parse_args_into_dataclasses(args=argv)
    if not isinstance(getattr(torch, script.dtype, None), torch.dtype):
        raise ValueError(f"--dtype {script.dtype!r} is not a torch dtype; allowed e.g.: float32, bfloat16, float16")
    tokenizer = None if script.byte_tokens else AutoTokenizer.from_pretrained(script.model_name_or_path)
    train, evaluation = packed_blocks(script, tokenizer)
    trainer = ParallelTrainer(
        script.model_name_or_path,  # loaded lazily: each rank reads only its own slice of the weights
        args,
        model_kwargs={"dtype": getattr(torch, script.dtype)},
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # "last": the newest complete one, if any
    trainer.save_model()  # consolidated: loads with from_pretrained(args.output_dir)
    return trainer


if __name__ == "__main__":
    main()
