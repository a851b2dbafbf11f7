"""A sweep's results: one DataFrame row per trial (launched or not), the best trial,
and the files written to the sweep directory (results.csv, best_config.yaml, sweep.png).

No Ray here: the rows are built from plain dicts (see `sweep.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["SweepResult", "pick_best", "write_best_config", "plot_sweep", "RESULTS_FILE",
           "BEST_CONFIG_FILE", "PLOT_FILE"]

RESULTS_FILE = "results.csv"
BEST_CONFIG_FILE = "best_config.yaml"
PLOT_FILE = "sweep.png"
REPORTED = ("step", "loss", "val_loss", "samples_per_s")  # columns taken from each trial's last report


@dataclass
class SweepResult:
    """What `sweep` returns. ``trials`` has one row per trial: ``trial``, ``status``
    (done | stopped | failed | invalid | not run), one column per swept path, the last reported
    ``step``/``loss``/``val_loss``/``samples_per_s``, the objective, ``duration_s``,
    ``error``, ``run_dir`` and ``best_checkpoint``."""

    sweep_dir: Path
    trials: "pd.DataFrame"
    metric: str
    mode: str
    best_trial: str | None  # None when no trial finished
    best_config: Path | None  # ready to run: rtp train <best_config>
    best_checkpoint: Path | None  # the best trial's best checkpoint (servable)
    results_csv: Path
    plot: Path | None

    @property
    def best(self) -> dict:
        """The best trial's row."""
        if self.best_trial is None:
            return {}
        return self.trials.set_index("trial").loc[self.best_trial].to_dict()


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def pick_best(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The best finished trial: done or stopped early, with a finite objective; failed
    and invalid trials never win (the "fastest config that fits" rule)."""
    candidates = [r for r in rows if r["status"] in ("done", "stopped") and _finite(r.get(metric))]
    if not candidates:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(candidates, key=lambda r: sign * r[metric])


def write_best_config(path: Path, config: dict, *, sweep: str, trial: str, metric: str,
                      value: float, storage_path: str) -> Path:
    """The best trial's config as a new run (``run.name: <sweep>-best``) in the base
    config's storage."""
    config = {**config, "run": {**config["run"], "name": f"{sweep}-best", "storage_path": storage_path}}
    header = (f"# Best trial of sweep '{sweep}': {trial} ({metric} {value:.6g}).\n"
              f"#   rtp train {path}\n")
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    return path


def _positions(values: list) -> tuple[list, list | None]:
    """x positions of a parameter's values; labels when they are not all numbers."""
    if all(_finite(v) and not isinstance(v, bool) for v in values):
        return values, None
    labels = sorted({str(v) for v in values})
    return [labels.index(str(v)) for v in values], labels


def plot_sweep(path: Path, rows: list[dict], params: list[str], metric: str,
               best: str | None, log_params: set[str]) -> Path | None:
    """sweep.png: the objective against each swept parameter, one panel each; the best
    trial starred. Failed and invalid trials have no objective and are left out."""
    ok = [r for r in rows if _finite(r.get(metric))]
    if not ok or not params:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(params), figsize=(4 * len(params), 3.5), squeeze=False)
    for ax, param in zip(axes[0], params):
        xs, labels = _positions([r[param] for r in ok])
        colors = ["tab:orange" if r["status"] == "stopped" else "tab:blue" for r in ok]
        ax.scatter(xs, [r[metric] for r in ok], c=colors)
        for x, r in zip(xs, ok):
            if r["trial"] == best:
                ax.scatter([x], [r[metric]], marker="*", s=250, c="gold", edgecolors="black", zorder=3)
        if labels:
            ax.set_xticks(range(len(labels)), labels)
        elif param in log_params:
            ax.set_xscale("log")
        ax.set_xlabel(param)
        ax.set_ylabel(metric)
    failed = sum(r["status"] in ("failed", "invalid") for r in rows)
    fig.suptitle(f"{metric} per trial (blue: done, orange: stopped early, star: best; "
                 f"{failed} failed/invalid not shown)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
