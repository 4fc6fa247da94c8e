"""The typed form of `parallelize`'s config (Paddle's dp_config / mp_config / pp_config), parsed from a dict.

Parsing checks the shape only (a dict of known sections, each a dict of known keys, the required ones present);
the values are the request's, checked by the engine's `validate` with the keys named as `parallelize` names them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields

from ..data_parallel.levels import DataParallelConfig
from ..pipeline import SplitPoint


@dataclass
class TensorParallelConfig:
    """`mp_config`: `parallelize_plan` maps module (or parameter) name regexes to a style or a list of styles."""

    parallelize_plan: Mapping[str, object]


@dataclass
class PipelineParallelConfig:
    """`pp_config`: `split_spec` (a layer-list prefix split evenly, or {"prefix.N": SplitPoint} exact cuts);
    `global_spec` (a module whose outputs every stage needs, e.g. "model.rotary_emb": each stage recomputes it);
    `schedule` (a name from `SCHEDULES`); `num_microbatches` (>= pp; default pp)."""

    split_spec: str | Mapping[str, SplitPoint]
    global_spec: str | None = None
    schedule: str = "1f1b"
    num_microbatches: int | None = None


SECTIONS = {"dp_config": DataParallelConfig, "mp_config": TensorParallelConfig, "pp_config": PipelineParallelConfig}


OPTIONS = ("shared_batch", "compile")  # top-level settings beside the sections


@dataclass
class ParallelConfig:
    """The sections, `shared_batch` ("check", "broadcast" or "trust": how the ranks of one batch replica get their
    batch, see `data_parallel/shared_batch.py`) and `compile` (each decoder block through torch.compile: True, a backend
    name or {"backend", "mode", "dynamic"}, see `engine/compile.py`)."""

    dp_config: DataParallelConfig | None = None
    mp_config: TensorParallelConfig | None = None
    pp_config: PipelineParallelConfig | None = None
    shared_batch: str = "check"
    compile: object = False

    @classmethod
    def parse(cls, config: ParallelConfig | Mapping | None) -> ParallelConfig:
        """Accept the typed form or Paddle's dict form; reject unknown keys and wrong types."""
        if config is None or isinstance(config, ParallelConfig):
            return config or cls()
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict or a ParallelConfig, got {type(config).__name__}")
        sections = {}
        for key, value in config.items():
            if key in OPTIONS:
                sections[key] = value
            elif key in SECTIONS:
                sections[key] = _parse_section(key, SECTIONS[key], value)
            else:
                raise ValueError(f"config key {key!r} is not allowed; allowed: {', '.join([*SECTIONS, *OPTIONS])}")
        return cls(**sections)

    @property
    def empty(self) -> bool:
        return self.dp_config is None and self.mp_config is None and self.pp_config is None and not self.compile


def _parse_section(key: str, section: type, value: object) -> object:
    if isinstance(value, section):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"config[{key!r}] must be a dict, got {type(value).__name__}")
    allowed = [f.name for f in fields(section)]
    for name in value:
        if name not in allowed:
            raise ValueError(f"{key} key {name!r} is not allowed; allowed: {', '.join(allowed)}")
    required = [f.name for f in fields(section) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in value]
    if missing:
        raise ValueError(f"{key} needs {', '.join(repr(m) for m in missing)}")
    return section(**value)
