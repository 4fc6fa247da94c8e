"""The typed form of `parallelize`'s config (Paddle's dp_config / mp_config / pp_config), parsed from a dict.

Every problem raises one error that names the key and what is allowed, before anything is modified.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields

from ..engine.data_parallel import DataParallelConfig
from ..pipeline import SplitPoint, check_schedule


@dataclass
class TensorParallelConfig:
    """`mp_config`: `parallelize_plan` maps module (or parameter) name regexes to a style or a list of styles."""

    parallelize_plan: Mapping[str, object]

    def __post_init__(self) -> None:
        if not isinstance(self.parallelize_plan, Mapping):
            raise TypeError(
                f"mp_config['parallelize_plan'] must be a dict of name regex -> style, "
                f"got {type(self.parallelize_plan).__name__}"
            )


@dataclass
class PipelineParallelConfig:
    """`pp_config`: `split_spec` (a layer-list prefix split evenly, or {"prefix.N": SplitPoint} exact cuts);
    `global_spec` (a module whose outputs every stage needs, e.g. "model.rotary_emb": each stage recomputes it);
    `schedule` (a name from `SCHEDULES`); `num_microbatches` (>= pp; default pp)."""

    split_spec: str | Mapping[str, SplitPoint]
    global_spec: str | None = None
    schedule: str = "1f1b"
    num_microbatches: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.split_spec, Mapping):
            for name, point in self.split_spec.items():
                if not isinstance(point, SplitPoint):
                    raise ValueError(
                        f"pp_config['split_spec'][{name!r}] = {point!r}; allowed: SplitPoint.BEGINNING, SplitPoint.END"
                    )
        elif not isinstance(self.split_spec, str):
            raise TypeError(f"pp_config['split_spec'] must be a str or a dict, got {type(self.split_spec).__name__}")
        if self.global_spec is not None and not isinstance(self.global_spec, str):
            raise TypeError(f"pp_config['global_spec'] must be a str, got {type(self.global_spec).__name__}")
        check_schedule(self.schedule, "pp_config['schedule']")
        if self.num_microbatches is not None and (
            isinstance(self.num_microbatches, bool) or not isinstance(self.num_microbatches, int)
        ):
            raise TypeError(f"pp_config['num_microbatches'] must be an int, got {self.num_microbatches!r}")


SECTIONS = {"dp_config": DataParallelConfig, "mp_config": TensorParallelConfig, "pp_config": PipelineParallelConfig}


@dataclass
class ParallelConfig:
    dp_config: DataParallelConfig | None = None
    mp_config: TensorParallelConfig | None = None
    pp_config: PipelineParallelConfig | None = None

    @classmethod
    def parse(cls, config: ParallelConfig | Mapping | None) -> ParallelConfig:
        """Accept the typed form or Paddle's dict form; reject unknown keys and wrong types."""
        if config is None or isinstance(config, ParallelConfig):
            return config or cls()
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict or a ParallelConfig, got {type(config).__name__}")
        sections = {}
        for key, value in config.items():
            if key not in SECTIONS:
                raise ValueError(f"config key {key!r} is not allowed; allowed: {', '.join(SECTIONS)}")
            sections[key] = _parse_section(key, SECTIONS[key], value)
        return cls(**sections)

    @property
    def empty(self) -> bool:
        return self.dp_config is None and self.mp_config is None and self.pp_config is None


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
