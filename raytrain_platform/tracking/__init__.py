"""Experiment tracking: MLflow and TensorBoard, switched on by ``run.tracking``.

    run:
      tracking: [mlflow, tensorboard]
      tracking_uri: null      # MLFLOW_TRACKING_URI, else sqlite:///<storage_path>/mlflow.db
      experiment: null        # "raytrain_platform"

The driver opens the MLflow run (`open_training_run`, `open_sweep_run`) and logs the
run directory's files at the end; rank 0 of the workers sends every report to both
trackers (`open_step_trackers`). A tracker that cannot be reached is one
`TrackingUnavailable` warning: the run goes on and metrics.jsonl is still written.

Layer: below ``core`` (the engine feeds rank 0's trackers, also under torchrun),
above ``config``. No Ray here; the run directory's file names come from the callers.
"""

from raytrain_platform.tracking.mlflow_runs import (
                                                    TrackedRun,
                                                    TrackingUnavailable,
                                                    flatten_config,
                                                    resolve_tracking_uri,
)
from raytrain_platform.tracking.runs import (
                                                    SWEEP_PARENT_KEY,
                                                    open_sweep_run,
                                                    open_training_run,
                                                    pin_tracking_uri,
)
from raytrain_platform.tracking.steps import StepTrackers, open_step_trackers

__all__ = [
                                                    "SWEEP_PARENT_KEY",
                                                    "StepTrackers",
                                                    "TrackedRun",
                                                    "TrackingUnavailable",
                                                    "flatten_config",
                                                    "open_step_trackers",
                                                    "open_sweep_run",
                                                    "open_training_run",
                                                    "pin_tracking_uri",
                                                    "resolve_tracking_uri",
]
