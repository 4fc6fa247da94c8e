"""Paddle's `parallelize` Llama example, translated to a real Hugging Face `LlamaForCausalLM`.

    torchrun --nproc-per-node 4 examples/parallelize_llama.py        # dp=2 x tp=2, on CPU (gloo) or GPUs (NCCL)

Module names follow HF (`q_proj`/`k_proj`/`v_proj` instead of Paddle's fused `qkv_proj`, `gate_proj`/`up_proj`
instead of `gate_up_proj`, `model.` instead of `llama.`). HF derives positions and the causal mask from the
embedding output, so the sequence is split at the first decoder layer's input instead of the embedding's output.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import optimum_parallel as op

PLAN = {
    "model.embed_tokens": op.RowWiseParallel(),  # vocab-parallel embedding
    "model.layers.0": op.SequenceParallelBegin(on="input"),
    "model.layers.*.self_attn.(q|k|v)_proj": op.ColWiseParallel(units=8),  # whole heads (8 q / 8 kv heads)
    "model.layers.*.self_attn.o_proj": op.RowWiseParallel(),
    "model.layers.*.self_attn": op.SequenceParallelDisable(),
    "model.layers.*.mlp.(gate|up)_proj": op.ColWiseParallel(),
    "model.layers.*.mlp.down_proj": op.RowWiseParallel(),
    "model.layers.*.mlp": op.SequenceParallelDisable(need_transpose=False),
    "model.layers.*.(input|post_attention)_layernorm": op.SequenceParallelEnable(),
    "model.norm": op.SequenceParallelEnable(),
    "lm_head.weight": op.ColWiseParallel(),  # vocab-parallel head + loss
    "lm_head": op.SequenceParallelEnd(),
}


def main(steps: int = 5) -> list[float]:
    mesh = op.init_mesh(dp=2, tp=2)
    op.set_mesh(mesh)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8
    )
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parallel_config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": PLAN}}
    model, optimizer = op.parallelize(model, optimizer, config=parallel_config)

    generator = torch.Generator().manual_seed(mesh.rank("dp"))  # each dp rank its own data
    losses = []
    for step in range(steps):
        input_ids = torch.randint(0, config.vocab_size, (2, 64), generator=generator)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        op.clip_grad_norm_(model, max_norm=1.0)  # the global norm: torch's would see one rank's shards
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if torch.distributed.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    return losses


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()
