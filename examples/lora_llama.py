"""LoRA fine-tuning of a Llama at tensor-parallel size 2 with PEFT, then a standard adapter any one device loads.

    torchrun --nproc-per-node 2 examples/lora_llama.py --output_dir lora-out     # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/lora_llama.py --model_name_or_path MODEL_DIR --output_dir lora-out

Without a model directory it trains a small random Llama. The adapters are split like the layers they adapt and
add no collective; only they train (the base stays frozen and bit-identical); `save_pretrained` writes whole
adapter tensors that `PeftModel.from_pretrained(base_model, output_dir)` loads on one device.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

import optimum_parallel as op


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", default=None)
    parser.add_argument("--output_dir", default="lora-out")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)

    op.init_mesh(tp=dist.get_world_size() if dist.is_initialized() else 2)
    torch.manual_seed(0)  # every rank draws the same adapter init
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    else:
        config = LlamaConfig(
            vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8
        )
        model = AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model = get_peft_model(model, lora)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    generator = torch.Generator().manual_seed(0)  # one data stream: the tp ranks share the batch
    losses = []
    for step in range(args.steps):
        input_ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=generator)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        op.clip_grad_norm_(model, max_norm=1.0)  # the global norm: torch's would see one rank's shards
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    model.save_pretrained(args.output_dir)  # on every rank: the adapter shards are gathered, rank 0 writes
    if dist.get_rank() == 0:
        print(f"adapter saved to {args.output_dir}")
    return losses


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
