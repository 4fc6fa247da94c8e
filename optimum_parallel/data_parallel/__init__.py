"""Data parallelism over the ranks holding the same parameters: DDP / ZeRO-1 / FSDP2 levels, the experts' replica
groups, the flat gradient all-reduce, and two guards: the ranks of one batch replica are given the same batch
(`shared_batch.py`), and replicated tensors are checked equal (`replica_watch.py`)."""
