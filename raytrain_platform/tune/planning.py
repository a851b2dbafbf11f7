"""Planning a sweep, without Ray: every trial's config validated as `rtp train` would,
what each trial holds while it runs, and how many fit at once. `tune/sweep.py` runs the
plan on Ray Tune.

>>> max_concurrency([{"CPU": 1.51}] * 8, {"CPU": 16.0})
8
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from raytrain_platform.config import JobConfig
from raytrain_platform.errors import ConfigError, UserError
from raytrain_platform.plan.auto import Hardware, has_auto
from raytrain_platform.tune.space import Axis, expand

__all__ = ["DATA_TASK_CPUS", "DRIVER_CPUS", "OBJECTIVES", "PlannedTrial", "mark_unfit", "max_concurrency",
           "objective", "plan_trials", "trial_demand"]

# Metrics the workers report, with the direction that is better; "throughput" is the
# autotune objective: the highest samples/s among the trials that did not fail.
OBJECTIVES = {"val_loss": "min", "loss": "min", "samples_per_s": "max", "throughput": "max"}
DRIVER_CPUS = 0.01  # a Tune trial only drives its Train run (Ray Train V2's pattern)
# A Ray Data map task takes a whole CPU (Ray Data's default): a trial left less than that
# waits for its first batch for as long as the others run.
DATA_TASK_CPUS = 1.0


@dataclass(frozen=True)
class PlannedTrial:
    name: str  # trial_000, ...: also its run.name under <sweep>/runs/
    params: dict[str, Any]  # dotted path -> value
    config: dict | None  # the full validated job config; None when it cannot run
    total_steps: int
    error: str | None = None  # why it is not launched

    @property
    def launch_config(self) -> dict:
        """`config`, of a trial that is launched (one without `error`)."""
        assert self.config is not None, f"{self.name} is not launched: {self.error}"
        return self.config


def objective(metric: str, mode: str | None) -> tuple[str, str]:
    if not isinstance(metric, str) or not metric:
        raise ConfigError("metric", metric, f"a reported metric name, e.g. one of {list(OBJECTIVES)}")
    if mode is None:
        if metric not in OBJECTIVES:
            raise ConfigError("mode", mode, f"'min' or 'max' (required for metric '{metric}')")
        mode = OBJECTIVES[metric]
    if mode not in ("min", "max"):
        raise ConfigError("mode", mode, "'min' or 'max'")
    return ("samples_per_s" if metric == "throughput" else metric), mode


def plan_trials(base: JobConfig, axes: list[Axis], *, num_samples: int, seed: int,
                runs_dir: str, metric: str,
                hardware: Callable[[JobConfig], Hardware] | None = None,
                start_ray: Callable[[], None] | None = None) -> list[PlannedTrial]:
    """Every trial's config, validated (data included) as `rtp train` would; a trial
    that cannot run carries its one-line reason instead. A trial's `auto` fields are
    decided on `hardware(config)` (the sweep's: the cluster's), else on this machine.
    Data to tokenize is tokenized on the Ray `start_ray` starts (trainer.prepare)."""
    from raytrain_platform.launch.trainer import prepare

    trials = []
    for i, params in enumerate(expand(axes, num_samples=num_samples, seed=seed)):
        name = f"trial_{i:03d}"
        try:
            cfg = base.replace({**params, "run.name": name, "run.storage_path": runs_dir})
            job = prepare(cfg, hardware=hardware(cfg) if hardware is not None and has_auto(cfg) else None,
                          start_ray=start_ray)
        except UserError as exc:
            trials.append(PlannedTrial(name, params, None, 0, str(exc)))
            continue
        if metric.startswith("val_") and not job.data.num_val:
            trials.append(PlannedTrial(name, params, None, 0, (
                f"data.val_fraction = {job.config.data.val_fraction!r}: expected > 0 (or "
                f"data.val_path): the sweep's metric {metric} needs validation data")))
            continue
        trials.append(PlannedTrial(name, params, job.config.to_dict(), job.total_steps))
    return trials


def trial_demand(config: dict) -> dict[str, float]:
    """Resources one trial holds while it runs: its driver, its workers, and one Ray
    Data map task to feed them."""
    s = config["scaling"]
    demand = {"CPU": DRIVER_CPUS + s["num_workers"] * s["cpus_per_worker"] + DATA_TASK_CPUS}
    if s["use_gpu"]:
        demand["GPU"] = float(s["num_workers"])
    return demand


def max_concurrency(demands: list[dict[str, float]], free: dict[str, float],
                    cap: int | None = None) -> int:
    """How many trials can run at once without one waiting for another's workers:
    the free resources over the largest demand, at least 1 (trials then queue).

    >>> trials = [{"CPU": 1.51}] * 8  # 1 worker x 0.5 CPU each
    >>> max_concurrency(trials, {"CPU": 2.0}), max_concurrency(trials, {"CPU": 16.0}, cap=4)
    (1, 4)
    """
    worst = {r: max(d.get(r, 0.0) for d in demands) for d in demands for r in d}
    fits = min(math.floor(free.get(r, 0.0) / need + 1e-9) for r, need in worst.items() if need > 0)
    n = max(1, min(fits, len(demands)))
    return min(n, cap) if cap else n


def mark_unfit(trials: list[PlannedTrial], total: dict[str, float]) -> list[PlannedTrial]:
    """Trials that need more than the whole cluster are reported, not launched."""
    out = []
    for t in trials:
        if t.config:  # a trial already not launched has no config to fit
            short = {r: n for r, n in trial_demand(t.config).items() if n > total.get(r, 0.0)}
            if short:
                r, n = next(iter(short.items()))
                t = PlannedTrial(t.name, t.params, None, 0, (
                    f"scaling = {t.config['scaling']['num_workers']} worker(s) x "
                    f"{t.config['scaling']['cpus_per_worker']} CPU: expected a trial that fits the "
                    f"cluster: it needs {n:g} {r} (driver, workers and Ray Data), the cluster has "
                    f"{total.get(r, 0.0):g}"))
        out.append(t)
    return out
