"""Typed job config: one root (`JobConfig`) with sections model, data, train,
parallel, scaling, run. Loaded from YAML, overridden with ``--set a.b=value``
(values parsed as YAML scalars), or built from Python.

No torch or Ray import here: validation runs before any Ray resource is asked for.

>>> cfg = JobConfig.from_dict({
...     "model": {"name": "mlp"},
...     "data": {"source": "synthetic", "batch_size": 32},
...     "train": {"max_steps": 10},
...     "run": {"name": "demo"},
... })
>>> cfg.parallel.strategy, cfg.scaling.num_workers
('none', 1)
"""

from raytrain_platform.config.job import JobConfig, load_config
from raytrain_platform.config.parse import add_set_flag, apply_overrides, parse_override, read_yaml
from raytrain_platform.config.sections import (
    TRACKERS,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    ScalingConfig,
    TrainConfig,
)

__all__ = [
    "JobConfig",
    "read_yaml",
    "ModelConfig",
    "DataConfig",
    "TrainConfig",
    "ParallelConfig",
    "ScalingConfig",
    "RunConfig",
    "TRACKERS",
    "load_config",
    "apply_overrides",
    "add_set_flag",
    "parse_override",
]

