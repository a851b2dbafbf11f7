"""Ray Tune sweeps over any config field: each trial is one full TorchTrainer run.

>>> import raytrain_platform as rtp                                          # doctest: +SKIP
>>> result = rtp.sweep("pipelines/configs/tabular.yaml",                     # doctest: +SKIP
...                    {"train.lr": {"loguniform": [1e-4, 1e-2]}, "data.batch_size": [32, 64]},
...                    num_samples=2, scheduler="asha", name="tabular-lr")
>>> result.trials[["trial", "status", "train.lr", "val_loss"]]               # doctest: +SKIP
>>> result.best_config, result.best_checkpoint                                # doctest: +SKIP

Layout: ``<storage>/<name>/`` holds trials.json (the planned trials), runs/trial_NNN/
(each trial's run directory, as `rtp train` writes it), tune/ (Tune's experiment state:
running the same sweep again resumes it), results.csv, best_config.yaml and sweep.png.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from raytrain_platform.config import JobConfig, RunConfig, load_config
from raytrain_platform.errors import ConfigError, UserError
from raytrain_platform.core.rundir import TRACKING_FILE, best_checkpoint
from raytrain_platform.plan.auto import Hardware
from raytrain_platform.tracking import SWEEP_PARENT_KEY, TrackedRun, open_sweep_run, pin_tracking_uri
from raytrain_platform.tune.results import (BEST_CONFIG_FILE, PLOT_FILE, REPORTED, RESULTS_FILE,
                                            SweepResult, pick_best, plot_sweep, write_best_config)
from raytrain_platform.tune.planning import (DRIVER_CPUS, OBJECTIVES, PlannedTrial, mark_unfit, max_concurrency,
                                             objective, plan_trials, trial_demand)
from raytrain_platform.tune.space import Axis, parse_space

__all__ = ["sweep", "SweepResult", "PlannedTrial", "plan_trials", "trial_demand", "max_concurrency",
           "OBJECTIVES"]

TRIALS_FILE = "trials.json"


def _scheduler(spec: Any, trials: list[PlannedTrial]):
    """None/'fifo': run every trial to the end; 'asha' or {asha: {grace_period,
    reduction_factor}}: stop trials that trail at a validation step."""
    if spec in (None, "fifo"):
        return None
    options = spec.get("asha") if isinstance(spec, dict) and list(spec) == ["asha"] else (
        {} if spec == "asha" else None)
    if not isinstance(options, dict) or set(options) - {"grace_period", "reduction_factor"}:
        raise ConfigError("scheduler", spec, "fifo, asha, or {asha: {grace_period: N, "
                          "reduction_factor: R}}")
    eval_every = min(t.launch_config["run"]["eval_every"] for t in trials)
    max_t = max(t.total_steps for t in trials)
    grace = options.get("grace_period", eval_every)
    if not isinstance(grace, int) or not 1 <= grace <= max_t:
        raise ConfigError("scheduler.asha.grace_period", grace,
                          f"an integer in [1, {max_t}] (steps; default run.eval_every, which must "
                          "then be > 0)")
    factor = options.get("reduction_factor", 2)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 1:
        raise ConfigError("scheduler.asha.reduction_factor", factor, "a number > 1")
    from ray.tune.schedulers import ASHAScheduler

    # stop_last_trials=False: a trial that reaches max_t ends on its own (final checkpoint,
    # summary), not killed at its last report.
    return ASHAScheduler(time_attr="step", max_t=max_t, grace_period=grace, reduction_factor=factor,
                         stop_last_trials=False)


def _record_plan(sweep_dir: Path, plan: dict) -> None:
    """trials.json: the first run writes it; a rerun must plan the same trials to resume."""
    path = sweep_dir / TRIALS_FILE
    text = json.dumps(plan, indent=1, sort_keys=True, default=str)
    if path.exists() and path.read_text() != text:
        raise UserError(f"sweep directory {sweep_dir} holds a sweep with other trials or settings; "
                        "choose another sweep name to start a new one (a rerun resumes only the "
                        "same sweep)")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@contextlib.contextmanager
def _ctrl_c_interrupts():
    """Ctrl-C stops the sweep as it stops `rtp train`: KeyboardInterrupt (exit 130, the
    MLflow parent run KILLED), the sweep left to resume. Tune's own handler instead ends
    its loop and returns, so the sweep would record its cut-off trials as results (ASHA's
    `stopped`) and pick a best among them."""
    from raytrain_platform.launch.session import temporary_env

    with temporary_env("TUNE_DISABLE_SIGINT_HANDLER", "1"):
        yield


@contextlib.contextmanager
def _quiet_tune(verbose: bool):
    """Our table instead of Tune's: the legacy output engine prints nothing at verbose=0
    (the new one still prints each error), and Tune's error logs go unless `verbose`."""
    if verbose:
        yield
        return
    from raytrain_platform.launch.session import temporary_env

    tune_logger = logging.getLogger("ray.tune")
    saved_level = tune_logger.level
    tune_logger.setLevel(logging.CRITICAL)
    try:
        with temporary_env("RAY_AIR_NEW_OUTPUT", "0"):
            yield
    finally:
        tune_logger.setLevel(saved_level)


def _make_tuner(trials: list[PlannedTrial], *, sweep_dir: Path, metric: str, mode: str,
                scheduler: Any, concurrency: int, progress: bool, tracking: dict):
    """A new Tuner, or the interrupted one restored from <sweep>/tune/ (Tune restore).
    `tracking`: what every trial gets besides its own config (the MLflow parent run)."""
    import ray.tune

    from raytrain_platform.tune.callbacks import NoTuneReport, ReleaseStopped, TrialTable
    from raytrain_platform.tune.trial import trial_dirname, trial_driver

    trainable = ray.tune.with_resources(trial_driver, {"cpu": DRIVER_CPUS})
    tune_dir = sweep_dir / "tune"
    if ray.tune.Tuner.can_restore(str(tune_dir)):
        # Finished and failed trials stay as they were; unfinished ones run again and
        # resume from their run directory's latest checkpoint.
        return ray.tune.Tuner.restore(str(tune_dir), trainable, resume_unfinished=True), True
    table = TrialTable({t.name: (t.params, t.total_steps) for t in trials}, metric)
    space = {"metric": metric, **tracking, "trial": ray.tune.grid_search(
        [{"name": t.name, "params": t.params, "config": t.config} for t in trials])}
    tuner = ray.tune.Tuner(
        trainable, param_space=space,
        tune_config=ray.tune.TuneConfig(
            metric=metric, mode=mode, scheduler=scheduler, max_concurrent_trials=concurrency,
            trial_name_creator=trial_dirname, trial_dirname_creator=trial_dirname),
        run_config=ray.tune.RunConfig(name=tune_dir.name, storage_path=str(sweep_dir), verbose=0,
                                      progress_reporter=NoTuneReport(),
                                      callbacks=[ReleaseStopped(), *([table] if progress else [])]))
    return tuner, False


def _rows(grid: Any, trials: list[PlannedTrial], metric: str) -> list[dict]:
    """One row per planned trial, from Tune's results (launched) or the plan (not)."""
    from raytrain_platform.tune.callbacks import trial_status
    from raytrain_platform.tune.trial import recorded_reason, recorded_user_error

    by_name = {r.config["trial"]["name"]: r for r in grid}
    rows = []
    for t in trials:
        row: dict[str, Any] = {"trial": t.name, **t.params}
        result = by_name.get(t.name)
        last = (result.metrics or {}) if result is not None else {}
        for key in dict.fromkeys([*REPORTED, metric]):
            row[key] = last.get(key, float("nan"))
        if t.error:
            row.update(status="invalid", error=t.error)
        elif result is None or (result.error is None and "step" not in last):
            row.update(status="not run", error="")
        elif result.error is not None:  # our own bad-input error inside the trial: invalid too
            row.update(status="invalid" if recorded_user_error(result.error) else "failed",
                       error=recorded_reason(result.error))
        else:
            row.update(status=trial_status(last.get("step"), t.total_steps), error="")
        row["duration_s"] = round(last.get("time_total_s", float("nan")), 1)
        run_dir = Path(t.config["run"]["storage_path"], t.name) if t.config else None
        ckpt = best_checkpoint(run_dir) if run_dir and run_dir.is_dir() else None
        row.update(run_dir=str(run_dir or ""), best_checkpoint=str(ckpt or ""))
        rows.append(row)
    return rows


def _finish(rows: list[dict], trials: list[PlannedTrial], axes: list[Axis], *, sweep_dir: Path,
            name: str, metric: str, mode: str, base_storage: str) -> SweepResult:
    import pandas as pd

    columns = ["trial", "status", *[a.path for a in axes], metric,
               *[c for c in REPORTED if c != metric], "duration_s", "error", "run_dir",
               "best_checkpoint"]
    frame = pd.DataFrame(rows, columns=list(dict.fromkeys(columns)))
    csv = sweep_dir / RESULTS_FILE
    frame.to_csv(csv, index=False)
    best = pick_best(rows, metric, mode)
    best_cfg = best_ckpt = None
    if best is not None:
        config = next(t.launch_config for t in trials if t.name == best["trial"])
        best_cfg = write_best_config(sweep_dir / BEST_CONFIG_FILE, config, sweep=name,
                                     trial=best["trial"], metric=metric, value=best[metric],
                                     storage_path=base_storage)
        best_ckpt = Path(best["best_checkpoint"]) if best["best_checkpoint"] else None
    plot = plot_sweep(sweep_dir / PLOT_FILE, rows, [a.path for a in axes], metric,
                      best["trial"] if best else None,
                      {a.path for a in axes if a.kind == "loguniform"})
    return SweepResult(sweep_dir=sweep_dir, trials=frame, metric=metric, mode=mode,
                       best_trial=best["trial"] if best else None, best_config=best_cfg,
                       best_checkpoint=best_ckpt, results_csv=csv, plot=plot)


def _track_result(parent: TrackedRun, result: SweepResult) -> None:
    """The parent MLflow run holds the results table, the plot, the best config and the
    best value of the objective."""
    parent.log_artifacts([result.results_csv, result.plot, result.best_config])
    if result.best_trial:
        parent.log_values({f"best_{result.metric}": float(result.best[result.metric])},
                          {"best_trial": result.best_trial})


def _summary_lines(result: SweepResult) -> list[str]:
    frame = result.trials
    shown = [c for c in frame.columns if c not in ("run_dir", "best_checkpoint", "error", "loss")]
    lines = ["", frame[shown].to_string(index=False, float_format=lambda v: f"{v:.4g}")]
    for _, row in frame[frame["error"].astype(bool)].iterrows():
        lines.append(f"{row['trial']} {row['status']}: {row['error']}")
    if result.best_trial:
        best = result.best
        lines.append(f"best: {result.best_trial} ({result.metric} {best[result.metric]:.4g}); "
                     f"config {result.best_config}; checkpoint {result.best_checkpoint}")
    else:
        lines.append(f"best: none (no trial finished with a {result.metric})")
    lines.append(f"results {result.results_csv}" + (f"; plot {result.plot}" if result.plot else ""))
    return lines


def _check_settings(*, max_concurrent: Any, storage_path: Any) -> None:
    """The sweep's own settings (`expand` checks num_samples and seed), before Ray starts."""
    count = isinstance(max_concurrent, int) and not isinstance(max_concurrent, bool)  # not YAML's true
    if max_concurrent is not None and (not count or max_concurrent < 1):
        raise ConfigError("max_concurrent", max_concurrent, "an integer >= 1 or null")
    if storage_path is not None and (not isinstance(storage_path, str) or not storage_path.strip()
                                     or "://" in storage_path):
        raise ConfigError("storage_path", storage_path, "a local folder path, or null (the base "
                          "config's run.storage_path)")


def sweep(base_config: Any, space: dict, *, metric: str = "val_loss", mode: str | None = None,
          num_samples: int = 1, scheduler: Any = None, max_concurrent: int | None = None,
          name: str | None = None, storage_path: str | None = None, seed: int = 0,
          overrides: list[str] | None = None, address: str | None = None, verbose: bool = False,
          progress: bool = True) -> SweepResult:
    """Run (or resume) a sweep of `base_config` (a YAML path, dict or `JobConfig`, with
    ``--set``-style `overrides`) over `space` (dotted paths: a list is a grid axis,
    ``{choice|uniform|loguniform|randint: ...}`` a random one). `metric`: a reported
    metric, or "throughput" (samples/s, max). `scheduler`: None/"fifo" or "asha".
    The sweep lives in ``<storage_path or run.storage_path>/<name or run.name-sweep>/``;
    the same call again resumes it."""
    base = load_config(base_config, overrides)
    metric, mode = objective(metric, mode)
    axes = parse_space(space)
    _check_settings(max_concurrent=max_concurrent, storage_path=storage_path)
    name = name or f"{base.run.name}-sweep"
    base.replace({"run.name": name})  # the same rule as a run name
    base_storage = os.path.abspath(os.path.expanduser(base.run.storage_path))
    sweep_dir = Path(os.path.abspath(os.path.expanduser(storage_path or base_storage))) / name
    base = pin_tracking_uri(base, str(sweep_dir.parent))  # trials log beside their parent run
    trials = plan_trials(base, axes, num_samples=num_samples, seed=seed,
                         runs_dir=str(sweep_dir / "runs"), metric=metric,
                         hardware=_cluster_hardware(address, verbose), start_ray=_starter(address, verbose))
    emit = (lambda line: print(line, flush=True)) if progress else (lambda line: None)
    return _run(trials, axes, emit=emit, sweep_dir=sweep_dir, name=name, metric=metric, mode=mode,
                scheduler=scheduler, max_concurrent=max_concurrent, base_storage=base_storage,
                address=address, verbose=verbose, progress=progress, tracking=base.run)


def _starter(address: str | None, verbose: bool) -> Callable[[], None]:
    """Starts (or connects to) the sweep's Ray: where planning must tokenize the data, it
    does so on the cluster (data/tokenize_pass.py), once for every trial."""
    from raytrain_platform.launch.session import init_ray

    return lambda: init_ray(address, verbose)


def _cluster_hardware(address: str | None, verbose: bool) -> Callable[[JobConfig], Hardware]:
    """What a trial's workers will have on the sweep's cluster (`cluster_hardware`, as
    `rtp train` decides `auto`), Ray started at the first trial that asks; one answer
    per scaling, since a GPU's memory is measured by a task on it."""
    from raytrain_platform.launch.resources import cluster_hardware
    from raytrain_platform.launch.session import init_ray

    known: dict[tuple, Hardware] = {}

    def hardware(cfg: JobConfig) -> Hardware:
        s = cfg.scaling
        key = (s.use_gpu, s.num_workers, s.cpus_per_worker, s.memory_budget)
        if key not in known:
            init_ray(address, verbose)  # a no-op once connected
            known[key] = cluster_hardware(cfg)
        return known[key]

    return hardware


def _run(trials: list[PlannedTrial], axes: list[Axis], *, emit, sweep_dir: Path, name: str,
         metric: str, mode: str, scheduler: Any, max_concurrent: int | None, base_storage: str,
         address: str | None, verbose: bool, progress: bool, tracking: RunConfig) -> SweepResult:
    from raytrain_platform.launch.session import init_ray

    runnable = [t for t in trials if t.error is None]
    if not runnable:
        raise UserError(f"no trial of sweep '{name}' can run; {trials[0].name}: {trials[0].error}")
    sched = _scheduler(scheduler, runnable)
    init_ray(address, verbose)
    import ray

    trials = mark_unfit(trials, ray.cluster_resources())
    runnable = [t for t in trials if t.error is None]
    if not runnable:
        raise UserError(f"no trial of sweep '{name}' fits the cluster; "
                        f"{trials[0].name}: {trials[0].error}")
    _record_plan(sweep_dir, {"metric": metric, "mode": mode, "scheduler": scheduler,
                             "trials": [asdict(t) for t in trials]})
    concurrency = max_concurrency([trial_demand(t.launch_config) for t in runnable],
                                  ray.available_resources(), max_concurrent)
    for t in trials:
        if t.error:
            emit(f"{t.name} not launched: {t.error}")
    parent = open_sweep_run(tracking, name=name, state_file=sweep_dir / TRACKING_FILE, settings={
        "metric": metric, "mode": mode, "scheduler": scheduler, "trials": len(runnable),
        "space": [a.path for a in axes]})
    with parent.ending():  # FINISHED, or FAILED if the sweep raises
        tuner, resumed = _make_tuner(
            runnable, sweep_dir=sweep_dir, metric=metric, mode=mode, scheduler=sched,
            concurrency=concurrency, progress=progress,
            tracking={SWEEP_PARENT_KEY: parent.run_id} if "mlflow" in tracking.tracking else {})
        emit(f"sweep '{name}'{' (resumed)' if resumed else ''}: {len(runnable)} trial(s), up to "
             f"{concurrency} at a time; {metric} ({mode}); {sweep_dir}")
        with _quiet_tune(verbose), _ctrl_c_interrupts():
            grid = tuner.fit()
        result = _finish(_rows(grid, trials, metric), trials, axes, sweep_dir=sweep_dir, name=name,
                         metric=metric, mode=mode, base_storage=base_storage)
        _track_result(parent, result)
    for line in _summary_lines(result):
        emit(line)
    return result
