"""Tune callbacks on the sweep driver: `TrialTable`, the console progress, one compact
line per trial event (start, each report to Tune, end) instead of Ray's own logs; and
`ReleaseStopped`, which frees what a stopped trial's killed Train run left reserved
and ends the MLflow run its killed driver left RUNNING.

    trial        step    val_loss  status    params
    trial_000       5      1.2911  running   lr=0.05 batch_size=8
    trial_000      20      0.9534  done      lr=0.05 batch_size=8
    trial_001       5      1.3862  stopped   lr=0.0001 batch_size=8
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray.tune import Callback
from ray.tune.progress_reporter import ProgressReporter

from raytrain_platform.core.rundir import TRACKING_FILE
from raytrain_platform.tracking.mlflow_runs import end_if_running
from raytrain_platform.tune.trial import recorded_reason, release_trial, trial_error

if TYPE_CHECKING:
    from ray.tune.stopper import Stopper

__all__ = ["TrialTable", "ReleaseStopped", "NoTuneReport", "format_params", "trial_status"]


def format_params(params: dict[str, Any]) -> str:
    """``{"train.lr": 0.05}`` -> ``"lr=0.05"`` (the last path part, unless two share it)."""
    tails = [p.rsplit(".", 1)[-1] for p in params]
    names = [t if tails.count(t) == 1 else p for t, p in zip(tails, params)]
    return " ".join(f"{n}={_short(v)}" for n, v in zip(names, params.values()))


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def trial_status(last_step: int | None, total_steps: int) -> str:
    """A trial Tune ended without error: done, or stopped early by the scheduler."""
    return "done" if last_step == total_steps else "stopped"


class TrialTable(Callback):
    """Tune callback printing the table; `trials` maps a trial's name to
    ``(params, total_steps)``."""

    def __init__(self, trials: dict[str, tuple[dict, int]], metric: str):
        self.trials, self.metric = trials, metric
        self._last_step: dict[str, int] = {}

    def setup(self, stop: Stopper | None = None, num_samples: int | None = None,
              total_num_samples: int | None = None, **info: Any) -> None:
        # Also after a restore: start a fresh table.
        self._last_step = {}
        self._line("trial", "step", self.metric, "status", "params")

    def _line(self, name: str, step: Any, value: Any, status: str, params: str) -> None:
        if isinstance(value, float):
            value = f"{value:.4f}" if math.isfinite(value) and abs(value) < 1e6 else f"{value:.3g}"
        print(f"{name:<11} {step:>6} {value:>12}  {status:<8}  {params}", flush=True)

    def _emit(self, trial: Any, status: str, value: Any = "") -> None:
        name = trial.config["trial"]["name"]
        params = format_params(self.trials[name][0])
        step = self._last_step.get(name, "")
        self._line(name, step, value, status, params)

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._emit(trial, "started")

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict,
                        **info: Any) -> None:
        self._last_step[trial.config["trial"]["name"]] = result.get("step", "")
        self._emit(trial, "running", result.get(self.metric, ""))

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        name = trial.config["trial"]["name"]
        last = trial.last_result or {}
        self._last_step[name] = last.get("step", "")
        self._emit(trial, trial_status(last.get("step"), self.trials[name][1]),
                   last.get(self.metric, ""))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._emit(trial, "failed", "")
        print(f"{'':<11} {recorded_reason(trial_error(trial))}", flush=True)


class ReleaseStopped(Callback):
    """Tune stops a trial (ASHA) by killing its actor, and with it the Train controller
    that would have released its workers' placement group, and the trial's driver that
    would have ended its MLflow run: release the one and end the other (KILLED; FAILED
    for a trial whose driver died on an error) here."""

    def _release(self, trial: Any, status: str) -> None:
        spec = trial.config["trial"]
        run_dir = Path(spec["config"]["run"]["storage_path"], spec["name"])
        release_trial(run_dir)
        end_if_running(run_dir / TRACKING_FILE, status)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._release(trial, "KILLED")  # a trial that ran to the end ended its run FINISHED

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._release(trial, "FAILED")


class NoTuneReport(ProgressReporter):
    """Tune's own progress reporter, silenced: `TrialTable` reports instead. Without it
    Tune picks its notebook reporter in Jupyter, which clears the cell's output."""

    def should_report(self, trials: list, done: bool = False) -> bool:
        return False

    def report(self, trials: list, done: bool, *sys_info: Any) -> None:
        return None
