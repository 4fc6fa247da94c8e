"""Communication: autograd-aware region ops, the overlapped tp entry, and the shared-memory transport."""
