"""What the test workers' forkserver imports once, so that every forked worker starts with it: the package is lazy
(`import optimum_parallel` loads nothing), so its heavy modules and torch's distributed modules are named here."""

import peft  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.optim  # noqa: F401  (before any process group: see mesh/init.py)
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401

import optimum_parallel.engine.compose  # noqa: F401
import optimum_parallel.engine.grad_norm  # noqa: F401
import optimum_parallel.frontends.manager  # noqa: F401
import optimum_parallel.frontends.parallelize  # noqa: F401
import optimum_parallel.integrations.transformers.lazy_loading  # noqa: F401
import optimum_parallel.pipeline.torch_pipelining  # noqa: F401
