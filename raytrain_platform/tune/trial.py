"""One sweep trial, in Ray Train V2's pattern: the Tune trial is the driver of one
TorchTrainer run (built by `launch`, like `rtp train`'s), and the run's reports reach
Tune through `TuneReportCallback`.

This module runs inside Tune's trial actors; nothing here parses sweep files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raytrain_platform.core.rundir import SUMMARY_FILE
from raytrain_platform.tracking.runs import SWEEP_PARENT_KEY

__all__ = ["TrialFailed", "trial_driver", "failure_reason", "recorded_reason", "recorded_user_error", "trial_error",
           "trial_dirname", "release_trial"]


class TrialFailed(RuntimeError):
    """A trial's run failed; the message is the one-line reason shown in the results.
    `user_error`: the reason is our own bad-input error (config, data, checkpoint),
    raised inside the trial: the trial is recorded as invalid, not failed."""

    def __init__(self, reason: str, user_error: bool = False):
        super().__init__(reason)
        self.user_error = user_error

    def __reduce__(self):  # Tune pickles it to the driver: keep the flag
        return (type(self), (str(self), self.user_error))


def recorded_user_error(error: BaseException | None) -> bool:
    """Whether a trial Tune recorded as errored failed on our own bad-input error."""
    from raytrain_platform.errors import user_cause

    cause = getattr(error, "cause", error)
    if isinstance(cause, TrialFailed):
        return cause.user_error
    return error is not None and user_cause(error) is not None


def failure_reason(exc: BaseException) -> str:
    """One line for a failed run: a `UserError` found anywhere in the chain (a bad
    combination), else the exception type and the failing rank's last line."""
    from raytrain_platform.errors import describe_error  # the CLI's own rule

    return describe_error(exc)


def recorded_reason(error: BaseException | None) -> str:
    """The reason of a trial Tune recorded as errored: Tune wraps the trial's
    `TrialFailed` (``RayTaskError.cause``); anything else is described as it is."""
    if error is None:
        return "failed (no error recorded)"
    cause = getattr(error, "cause", error)
    if isinstance(cause, TrialFailed):
        return str(cause)
    return failure_reason(cause if isinstance(cause, BaseException) else error)


def trial_error(trial: Any) -> BaseException | None:
    """The error Tune recorded for a trial: the driver's local copy first (it reaches
    the sweep directory only at Tune's next sync), then the synced one."""
    import ray.cloudpickle

    local = trial.pickled_error_file
    if local and Path(local).is_file():
        with open(local, "rb") as f:
            return ray.cloudpickle.load(f)
    return trial.get_pickled_error()


def trial_dirname(trial: Any) -> str:
    """Tune's own folder for a trial: the trial's name (trial_000, ...)."""
    return trial.config["trial"]["name"]


def _objective_callback(metric: str):
    from ray.tune.integration.ray_train import TuneReportCallback

    class ObjectiveReport(TuneReportCallback):
        """Forward only the reports that carry the objective: a checkpoint-only report
        (no validation at that step) would fail Tune's strict metric check."""

        def after_report(self, run_context, metrics, checkpoint):
            if metrics and metric in metrics[0]:
                super().after_report(run_context, metrics, checkpoint)

    return ObjectiveReport()


PLACEMENT_GROUP_FILE = ".placement_group"  # in the trial's run dir: its workers' placement group


def _placement_group_recorder(run_dir: Path):
    """A Train worker-group callback (it runs in the Train controller) that writes the
    run's placement group id to the run directory. A trial the scheduler stops is
    killed with its controller, whose placement group would otherwise stay reserved
    until Ray Train's cleaner actor notices (it needs Ray's state API, which fails when
    several Ray instances share the machine): the sweep releases it (`release_trial`)."""
    from raytrain_platform.compat.ray_private import worker_group_callback

    class PlacementGroupRecorder(worker_group_callback()):  # type: ignore[misc]
        def after_worker_group_start(self, worker_group) -> None:
            handle = worker_group.get_worker_group_state().placement_group_handle
            (run_dir / PLACEMENT_GROUP_FILE).write_text(handle.placement_group.id.hex())

    return PlacementGroupRecorder()


def release_trial(run_dir: str | Path) -> bool:
    """Remove the placement group a stopped trial left reserved; True if there was one."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    from raytrain_platform.compat.ray_private import placement_group_id

    path = Path(run_dir) / PLACEMENT_GROUP_FILE
    if not path.is_file():
        return False
    pg_id = path.read_text().strip()
    path.unlink()
    state = ray.util.placement_group_table().get(pg_id, {}).get("state")
    if state not in ("CREATED", "PENDING", "RESCHEDULING"):
        return False
    remove_placement_group(PlacementGroup(placement_group_id(pg_id)))
    return True


def _finished_metrics(run_dir: Path, total_steps: int) -> dict | None:
    """The final metrics of a run that already ended (a resumed sweep whose state was
    saved before Tune recorded the trial as done), else None."""
    try:
        final = json.loads((run_dir / SUMMARY_FILE).read_text()).get("final") or {}
    except (OSError, json.JSONDecodeError):
        return None
    return final if final.get("step") == total_steps else None


def trial_driver(config: dict) -> None:
    """The Tune function trainable. ``config["trial"]`` holds the trial's name, params
    and full job config (validated before the sweep started); ``config["metric"]``
    is the objective Tune schedules on."""
    import ray.tune

    from raytrain_platform.launch.trainer import prepare, run_job

    trial = config["trial"]
    try:
        job = prepare(trial["config"])
        done = _finished_metrics(Path(job.config.run.run_dir), job.total_steps)
        if done is not None:
            ray.tune.report(done)
            return
        run_dir = Path(job.config.run.run_dir)
        # MLflow: a child of the sweep's parent run, with the swept values as its params.
        sweep_trial = ({"parent_run_id": config[SWEEP_PARENT_KEY], "params": trial["params"]}
                       if SWEEP_PARENT_KEY in config else None)
        run_job(job, emit=lambda line: None, tail=False, sweep_trial=sweep_trial,
                callbacks=[_objective_callback(config["metric"]), _placement_group_recorder(run_dir)])
    except Exception as exc:
        from raytrain_platform.errors import user_cause

        raise TrialFailed(failure_reason(exc), user_error=user_cause(exc) is not None) from None
