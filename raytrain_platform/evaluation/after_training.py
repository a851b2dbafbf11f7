"""``run.eval_tasks``: the same evaluation as `rtp eval`, at the end of `rtp train` on the
run's final checkpoint, in the driver (lm_eval's hf model on the CPU). Its tasks are
checked with the config, before Ray starts; its scores go to the run's ``eval/``
folder and into the MLflow run still open for the training.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from raytrain_platform.config import JobConfig
from raytrain_platform.errors import ConfigError
from raytrain_platform.evaluation.harness import EvalSpec, evaluate
from raytrain_platform.evaluation.record import record_results
from raytrain_platform.evaluation.target import exports_hf, prepared_target
from raytrain_platform.evaluation.tasks import check_loadable, check_tasks

__all__ = ["absolute_eval_paths", "check_run_eval", "evaluate_after_training"]

_FIELDS = ("run.eval_tasks", "run.eval_include")


def absolute_eval_paths(cfg: JobConfig) -> JobConfig:
    """Task YAML files and include folders made absolute: a sweep's trials run elsewhere."""
    r = cfg.run
    if not r.eval_tasks:
        return cfg
    tasks = [os.path.abspath(t) if t.endswith((".yaml", ".yml")) else t for t in r.eval_tasks]
    return cfg.replace({"run.eval_tasks": tasks, "run.eval_include": [os.path.abspath(d) for d in r.eval_include]})


def check_run_eval(cfg: JobConfig) -> None:
    """``run.eval_tasks`` can run: an hf model, lm_eval installed, every task known and its data read."""
    r = cfg.run
    if not r.eval_tasks:
        return
    if not exports_hf(cfg.model.name):
        raise ConfigError("run.eval_tasks", r.eval_tasks, f"[] for model.name {cfg.model.name!r}: lm_eval reads a "
                          "Hugging Face folder, which only hf runs export")
    check_loadable(check_tasks(r.eval_tasks, r.eval_include, fields=_FIELDS), r.eval_tasks, field=_FIELDS[0])


def evaluate_after_training(run_dir: Path, cfg: JobConfig, *, tracked: Any,
                            emit: Callable[[str], None]) -> Path:
    """Score the run's latest checkpoint on ``run.eval_tasks``; returns the results file."""
    spec = EvalSpec(tasks=list(cfg.run.eval_tasks), include=list(cfg.run.eval_include))
    with prepared_target(run_dir, trust_builder=True) as target:  # this run's own config built it
        record = evaluate(target, spec)
        path = record_results(target, record, tracked=tracked)
    for task, scores in record["scores"].items():
        emit(f"eval {task}: " + ", ".join(f"{metric} {value:.4f}" for metric, value in scores.items()))
    emit(f"eval results in {path}")
    return path
