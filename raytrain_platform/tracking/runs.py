"""What a training run and a sweep record in MLflow, for their drivers.

A training run: one MLflow run named ``run.name``; params are the resolved config,
flattened; tags the strategy, the world size, the model and the git commit. A sweep:
one parent run named after the sweep (its settings as params, results.csv, sweep.png
and best_config.yaml as artifacts), and one child run per trial whose params are the
trial's swept values.

>>> from raytrain_platform.config import load_config
>>> cfg = load_config({"model": {"name": "mlp"}, "data": {"source": "synthetic", "batch_size": 8},
...                    "train": {"max_steps": 5}, "run": {"name": "doc"}})
>>> training_params(cfg)["train.max_steps"], training_tags(cfg, commit=None)
('5', {'strategy': 'none', 'world_size': '1', 'model': 'mlp'})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_platform.config import JobConfig, RunConfig
from raytrain_platform.tracking.mlflow_runs import (
    TrackedRun,
    flatten_config,
    git_commit,
    open_mlflow_run,
    resolve_tracking_uri,
)

__all__ = [
    "SWEEP_PARENT_KEY",
    "open_sweep_run",
    "open_training_run",
    "pin_tracking_uri",
    "training_params",
    "training_tags",
]

# The key of a sweep's Tune param space that carries the parent run id to its trials.
SWEEP_PARENT_KEY = "tracking_parent"


def training_params(cfg: JobConfig) -> dict[str, str]:
    return flatten_config(cfg.to_dict())


def training_tags(cfg: JobConfig, *, commit: str | None) -> dict[str, str]:
    """Rank 0 overwrites world_size with the size the run actually got (elastic runs)."""
    tags = {"strategy": cfg.parallel.strategy, "world_size": str(cfg.scaling.num_workers),
            "model": cfg.model.name}
    if commit:
        tags.update({"git_commit": commit, "mlflow.source.git.commit": commit})
    return tags


def open_training_run(cfg: JobConfig, *, state_file: Path,
                      sweep_trial: dict[str, Any] | None = None) -> TrackedRun:
    """The MLflow run of one training run, or an inactive one (MLflow not in
    ``run.tracking``, or unreachable: warned). `sweep_trial`: ``{"parent_run_id", "params"}``
    for a sweep's trial; a None parent means the sweep's store was unreachable (the sweep
    already warned), and the trial does not try again."""
    r = cfg.run
    if "mlflow" not in r.tracking or (sweep_trial is not None and not sweep_trial.get("parent_run_id")):
        return TrackedRun()
    params = sweep_trial["params"] if sweep_trial else training_params(cfg)
    return open_mlflow_run(tracking_uri=r.tracking_uri, storage_path=r.storage_path,
                           experiment=r.experiment, name=r.name, state_file=state_file,
                           params=params, tags=training_tags(cfg, commit=git_commit()),
                           parent_run_id=sweep_trial["parent_run_id"] if sweep_trial else None)


def pin_tracking_uri(cfg: JobConfig, storage_root: str) -> JobConfig:
    """A sweep's base config with its MLflow store written in: the trials' storage is
    the sweep's runs/ folder, but they log beside their parent run."""
    if "mlflow" not in cfg.run.tracking:
        return cfg
    return cfg.replace({"run.tracking_uri": resolve_tracking_uri(cfg.run.tracking_uri, storage_root)})


def open_sweep_run(run: RunConfig, *, name: str, state_file: Path, settings: dict[str, Any]) -> TrackedRun:
    """The sweep's parent run (`run`: the base config's run section, URI pinned)."""
    if "mlflow" not in run.tracking:
        return TrackedRun()
    return open_mlflow_run(tracking_uri=run.tracking_uri, storage_path=run.storage_path,
                           experiment=run.experiment, name=name, state_file=state_file,
                           params=flatten_config(settings), tags={"kind": "sweep"})
