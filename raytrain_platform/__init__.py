"""raytrain_platform: one YAML config -> distributed training on Ray Train.

>>> import raytrain_platform as rtp
>>> rtp.load_config({"model": {"name": "mlp"}, "data": {"source": "synthetic", "batch_size": 8},
...                  "train": {"max_steps": 5}, "run": {"name": "doc"}}).run.name
'doc'

Heavy parts (torch, Ray) load on first use, so ``import raytrain_platform`` and
``rtp validate`` stay fast.
"""

from __future__ import annotations

from typing import Any

from raytrain_platform._version import __version__
from raytrain_platform.config import JobConfig, load_config
from raytrain_platform.errors import CheckpointError, ConfigError, DataError, UserError

__all__ = ["JobConfig", "load_config", "train", "TrainResult", "sweep", "SweepResult",
           "export_checkpoint", "UserError",
           "ConfigError", "DataError", "CheckpointError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("train", "TrainResult"):
        from raytrain_platform.launch import trainer

        return getattr(trainer, name)
    if name in ("sweep", "SweepResult"):
        from raytrain_platform.tune import sweep

        return getattr(sweep, name)
    if name == "export_checkpoint":
        from raytrain_platform.export import export_checkpoint

        return export_checkpoint
    raise AttributeError(f"module 'raytrain_platform' has no attribute {name!r}")
