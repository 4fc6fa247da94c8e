"""optimum-parallel: tensor/sequence/pipeline/context/data parallelism for Hugging Face Transformers models.

Every public name loads its module on first use, so `import optimum_parallel` and the command line's `--help` cost
next to nothing (integrations register through entry points, see `plan/wrappers.py`).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {  # public name -> the module defining it
    "consolidate_checkpoint": ".checkpoint",
    "reshard_checkpoint": ".checkpoint",
    "find_last_checkpoint": ".checkpoint",
    "Capabilities": ".autoplan.capabilities",
    "LLAMA_ACTIVATIONS": ".autoplan.capabilities",
    "DataParallelConfig": ".data_parallel.levels",
    "clip_grad_norm_": ".engine.grad_norm",
    "check_replicas": ".data_parallel.replica_watch",
    "full_state_dict": ".engine.full_model",
    "grad_norm": ".engine.grad_norm",
    "make_optimizer_constructor_lazy": ".engine.lazy_optimizer",
    "ParallelConfig": ".frontends.config",
    "PipelineParallelConfig": ".frontends.config",
    "TensorParallelConfig": ".frontends.config",
    "ParallelizersManager": ".frontends.manager",
    "UnsupportedModelError": ".frontends.manager",
    "parallelize": ".frontends.parallelize",
    "Parallelizer": ".frontends.parallelizer",
    "lazy_load_for_parallelism": ".integrations.transformers.lazy_loading",
    "ParallelMesh": ".mesh",
    "get_mesh": ".mesh",
    "init_mesh": ".mesh",
    "set_mesh": ".mesh",
    "SplitPoint": ".pipeline",
    "apply_plan": ".plan",
    "check_plan": ".plan",
    "logits_mode": ".plan",
    "parallel_layouts": ".plan",
    "ParallelState": ".state",
    "parallel_state": ".state",
    "ColWiseParallel": ".styles",
    "ExpertParallel": ".styles",
    "TensorParallelExperts": ".styles",
    "ParallelStyle": ".styles",
    "PrepareLayerInput": ".styles",
    "PrepareLayerOutput": ".styles",
    "RowWiseParallel": ".styles",
    "SequenceParallelBegin": ".styles",
    "SequenceParallelDisable": ".styles",
    "SequenceParallelEnable": ".styles",
    "SequenceParallelEnd": ".styles",
    "optional": ".styles",
    "ParallelTrainer": ".integrations.transformers.trainer",
    "ParallelTrainingArguments": ".integrations.transformers.training_args",
    "ParallelTrainerMixin": ".integrations.transformers.trainer",
    "ParallelSFTTrainer": ".integrations.trl",
    "ParallelSFTConfig": ".integrations.trl",
    "ParallelDPOTrainer": ".integrations.trl",
    "ParallelDPOConfig": ".integrations.trl",
    "ParallelGRPOTrainer": ".integrations.trl",
    "ParallelGRPOConfig": ".integrations.trl",
    "ParallelKTOTrainer": ".integrations.trl",
    "ParallelKTOConfig": ".integrations.trl",
    "ParallelRLOOTrainer": ".integrations.trl",
    "ParallelRLOOConfig": ".integrations.trl",
    "ParallelRewardTrainer": ".integrations.trl",
    "ParallelRewardConfig": ".integrations.trl",
    "ParallelDistillationTrainer": ".integrations.trl",
    "ParallelDistillationConfig": ".integrations.trl",
    "save_plan": ".memory_planner.plan_files",
    "load_plan": ".memory_planner.plan_files",
    "check_plan_fits": ".memory_planner.plan_files",
    "plan_file_parallelizer": ".memory_planner.plan_files",
    "estimate_memory": ".memory_planner.estimate",
    "suggest_layouts": ".memory_planner.estimate",
    "MemoryPlanner": ".memory_planner.estimate",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = sorted(_EXPORTS)
