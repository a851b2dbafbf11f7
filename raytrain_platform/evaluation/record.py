"""Where an evaluation's scores go: a JSON file in ``eval/`` of the run directory (or of
the export folder when no run is known), and the run's own trackers as its
``run.tracking`` names them: TensorBoard events in the run directory (beside
training's, tagged ``eval/<task>/<metric>``, at the checkpoint's step) and the run's
MLflow run (the one ``tracking.json`` records; the same metric names, the JSON as an
artifact under ``eval/``).

>>> tracker_metrics({"docmc": {"acc": 0.25, "acc_norm": 0.5}})
{'eval/docmc/acc': 0.25, 'eval/docmc/acc_norm': 0.5}
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from raytrain_platform.core.rundir import TRACKING_FILE, write_json
from raytrain_platform.evaluation.target import EvalTarget

__all__ = ["EVAL_DIR", "record_results", "tracker_metrics"]

EVAL_DIR = "eval"
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-./ ]")  # what MLflow takes in a metric name


def tracker_metrics(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    return {_UNSAFE.sub("_", f"{EVAL_DIR}/{task}/{metric}"): value
            for task, values in scores.items() for metric, value in values.items()}


def _results_file(target: EvalTarget, out: Path | None) -> Path:
    folder = out if out is not None else target.results_dir / EVAL_DIR
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return folder / f"step_{target.step:08d}_{stamp}.json"


def _to_tensorboard(run_dir: Path, step: int, metrics: dict[str, float]) -> None:
    from raytrain_platform.tracking.mlflow_runs import warn_unavailable
    from raytrain_platform.tracking.steps import TensorBoardSink

    try:
        sink = TensorBoardSink(str(run_dir), resume_step=None)  # adds to the run's events, purges none
        sink.log({"step": step, **metrics})
        sink.close()
    except Exception as exc:  # noqa: BLE001 - a tracker never fails the evaluation
        warn_unavailable("TensorBoard", str(run_dir), exc)


def _to_mlflow(target: EvalTarget, metrics: dict[str, float], path: Path, tracked: Any) -> None:
    """Into `tracked` (the training run still open at the end of `rtp train`), else the
    MLflow run the run directory records, else a run opened as training would."""
    from raytrain_platform.tracking.mlflow_runs import TrackedRun, mlflow_client, read_state
    from raytrain_platform.tracking.runs import open_training_run

    assert target.run_dir is not None and target.config is not None
    recorded = read_state(target.run_dir / TRACKING_FILE).get("mlflow") or {}
    opened = False
    if tracked is None and recorded.get("run_id"):
        tracked = TrackedRun(client=mlflow_client(recorded["tracking_uri"]), run_id=recorded["run_id"],
                             uri=recorded["tracking_uri"])
    elif tracked is None:
        tracked, opened = open_training_run(target.config, state_file=target.run_dir / TRACKING_FILE), True
    tracked.log_values(metrics, step=target.step)
    tracked.log_artifacts([path], EVAL_DIR)
    if opened:
        tracked.finish()


def record_results(target: EvalTarget, record: dict, *, out: Path | None = None, tracked: Any = None) -> Path:
    """Write `record` (``evaluate``'s, less any samples) as JSON and send its scores to
    the run's trackers; returns the JSON file."""
    path = _results_file(target, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {k: v for k, v in record.items() if k != "samples"})
    tracking = target.config.run.tracking if target.config is not None and target.run_dir is not None else []
    metrics = tracker_metrics(record["scores"])
    if "tensorboard" in tracking:
        _to_tensorboard(target.run_dir, target.step, metrics)  # type: ignore[arg-type]
    if "mlflow" in tracking:
        _to_mlflow(target, metrics, path, tracked)
    return path
