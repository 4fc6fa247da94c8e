"""optimum-parallel: tensor/sequence/pipeline/data parallelism for Hugging Face Transformers models."""

from .checkpoint import consolidate_checkpoint, reshard_checkpoint
from .engine.data_parallel import DataParallelConfig
from .engine.grad_norm import clip_grad_norm_, grad_norm
from .engine.lazy_optimizer import make_optimizer_constructor_lazy
from .frontends.config import ParallelConfig, PipelineParallelConfig, TensorParallelConfig
from .frontends.manager import ParallelizersManager, UnsupportedModelError
from .frontends.parallelize import parallelize
from .frontends.parallelizer import Parallelizer
from .integrations.peft import register as _register_peft
from .integrations.transformers.lazy_loading import lazy_load_for_parallelism
from .mesh import ParallelMesh, get_mesh, init_mesh, set_mesh
from .pipeline import SplitPoint
from .plan import apply_plan, check_plan, logits_mode, parallel_layouts
from .state import ParallelState, parallel_state
from .styles import (
    ColWiseParallel,
    ParallelStyle,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
    optional,
)

_register_peft()  # PEFT layers around planned modules are split with them (peft itself is imported only if used)

__version__ = "0.1.0"

_LAZY = {
    "ParallelTrainer": ".integrations.transformers.trainer",
    "ParallelTrainingArguments": ".integrations.transformers.training_args",
    "save_plan": ".planning.plan_files",
    "load_plan": ".planning.plan_files",
    "check_plan_fits": ".planning.plan_files",
    "plan_file_parallelizer": ".planning.plan_files",
    "estimate_memory": ".planning.memory_planner",
    "suggest_layouts": ".planning.memory_planner",
    "MemoryPlanner": ".planning.memory_planner",
}


def __getattr__(name: str):
    """The Trainer, plan files and memory planner import heavy parts of transformers: load them on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "clip_grad_norm_",
    "grad_norm",
    "ParallelState",
    "parallel_state",
    "ColWiseParallel",
    "ParallelMesh",
    "MemoryPlanner",
    "ParallelStyle",
    "ParallelTrainer",
    "ParallelTrainingArguments",
    "Parallelizer",
    "ParallelizersManager",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallelBegin",
    "SequenceParallelDisable",
    "SequenceParallelEnable",
    "SequenceParallelEnd",
    "UnsupportedModelError",
    "DataParallelConfig",
    "ParallelConfig",
    "PipelineParallelConfig",
    "SplitPoint",
    "TensorParallelConfig",
    "apply_plan",
    "check_plan",
    "check_plan_fits",
    "estimate_memory",
    "load_plan",
    "logits_mode",
    "plan_file_parallelizer",
    "save_plan",
    "suggest_layouts",
    "parallelize",
    "consolidate_checkpoint",
    "lazy_load_for_parallelism",
    "make_optimizer_constructor_lazy",
    "reshard_checkpoint",
    "get_mesh",
    "init_mesh",
    "optional",
    "parallel_layouts",
    "set_mesh",
]
