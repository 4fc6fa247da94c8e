"""Data parallelism over the ranks holding the same parameters: DDP / ZeRO-1 / FSDP2 levels, the experts' replica
groups, the flat gradient all-reduce, and the habits of batch replicas (one shared batch, replicas kept equal)."""
