"""The run directory layout, read and written the same way by the CLI, Tune and Serve.

    <run.storage_path>/<run.name>/
        config.yaml         the resolved config
        metrics.jsonl       one JSON object per reported step
        summary.json        final metrics, wall time, best checkpoint
        plot.png            loss and throughput
        tracking.json       the MLflow run id and store (run.tracking: mlflow)
        notes.log           what rank 0 says during a run besides metrics (the driver echoes it)
        events.out.tfevents.*  TensorBoard scalars (run.tracking: tensorboard)
        checkpoint_000050/  model.safetensors, optimizer.pt, trainer_state.json, config.yaml

No torch or Ray here.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = [
    "CONFIG_FILE", "METRICS_FILE", "SUMMARY_FILE", "PLOT_FILE", "TRACKING_FILE", "NOTES_FILE", "append_note",
    "MetricsLog", "read_metrics", "list_checkpoints", "prune_checkpoints", "latest_checkpoint", "best_checkpoint",
    "newest_finite_checkpoint", "check_storage",
    "write_json", "checkpoint_name",
]

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "plot.png"
TRACKING_FILE = "tracking.json"
NOTES_FILE = "notes.log"
STATE_FILE = "trainer_state.json"
_CKPT = re.compile(r"^checkpoint_(\d+)$")


def check_storage(path: str) -> None:
    """``run.storage_path``, before any Ray resource is asked for: a local folder that
    exists (or can be created: its nearest existing parent is a folder) and is writable,
    or a URI whose filesystem pyarrow resolves. Nothing is created here.

    >>> check_storage("/proc/version")
    Traceback (most recent call last):
    ...
    raytrain_platform.errors.ConfigError: run.storage_path = '/proc/version': expected a folder for run directories; /proc/version is a file
    """
    from raytrain_platform.errors import ConfigError, folder_problem

    field = "run.storage_path"
    if "://" in path:
        try:
            import pyarrow.fs

            pyarrow.fs.FileSystem.from_uri(path)
        except Exception as exc:  # pyarrow raises several types for unknown schemes and bad URIs
            reason = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            raise ConfigError(field, path, f"a URI whose filesystem resolves ({reason})") from None
        return
    problem = folder_problem(Path(path))
    if problem is not None:
        raise ConfigError(field, path, f"a folder for run directories; {problem}")


def checkpoint_name(step: int) -> str:
    return f"checkpoint_{step:06d}"


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


class MetricsLog:
    """Appends one JSON line per report. On resume, lines past the resumed step are
    dropped first, so the file reads as one uninterrupted run. `on_append` gets each
    report once it is in the file (rank 0's experiment trackers)."""

    def __init__(self, run_dir: str | os.PathLike, *, resume_step: int = 0,
                 on_append: Callable[[dict], None] | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.on_append = on_append
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [m for m in read_metrics(self.path.parent) if m.get("step", 0) <= resume_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
        os.replace(tmp, self.path)

    def append(self, metrics: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
            f.flush()
        if self.on_append is not None:
            self.on_append(metrics)


def append_note(run_dir: str | os.PathLike, text: str) -> None:
    """Append one line to the run directory's notes.log: what a worker says about long work
    outside the steps (the driver echoes new lines: launch/progress.py)."""
    path = Path(run_dir) / NOTES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(" ".join(text.split("\n")) + "\n")


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a crash ends the readable log
    return rows


def _is_complete(ckpt: Path) -> bool:
    """trainer_state.json is written last, but a copy to storage (Ray uploads each
    rank's files) may land it before the others: check the files it vouches for, at
    their recorded sizes, and a sharded checkpoint's shards against its index."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        sizes = dict(state.get("files") or {})
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    needed = ["sharded/.metadata"] if state.get("sharded") else ["model.safetensors", "optimizer.pt"]
    for name in needed:
        sizes.setdefault(name, None)  # checkpoints from before sizes were recorded: present
    for name, size in sizes.items():
        f = ckpt / name
        if ".." in Path(name).parts or not f.is_file() or (size is not None and f.stat().st_size != size):
            return False
    if state.get("sharded"):
        from raytrain_platform.core.sharded import shards_complete  # torch: only for sharded ones

        return shards_complete(ckpt)
    return True


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (every file whole; see `_is_complete`), oldest first."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _CKPT.match(child.name)
        if m and child.is_dir() and _is_complete(child):
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def _recorded_loss_finite(ckpt: Path) -> bool:
    """Whether the checkpoint's trainer state records a finite training loss."""
    try:
        loss = json.loads((ckpt / STATE_FILE).read_text()).get("metrics", {}).get("loss")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(loss, (int, float)) and math.isfinite(loss)


def newest_finite_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint whose recorded loss is finite (a diverged run's
    last good state), or None."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        if _recorded_loss_finite(ckpt):
            return ckpt
    return None


def prune_checkpoints(run_dir: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and never the newest one
    whose recorded loss was finite: checkpoints of a run gone NaN do not push out its
    last good state."""
    ckpts = list_checkpoints(run_dir)
    protected = newest_finite_checkpoint(run_dir)
    for old in ckpts[:-keep]:
        if old != protected:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def best_checkpoint(run_dir: str | os.PathLike, metric: str = "val_loss") -> Path | None:
    """The kept checkpoint with the lowest `metric`, else the latest."""
    scored = []
    for ckpt in list_checkpoints(run_dir):
        state = json.loads((ckpt / STATE_FILE).read_text())
        value = state.get("metrics", {}).get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value):  # NaN never compares lowest
            scored.append((value, ckpt))
    if scored:
        return min(scored, key=lambda t: t[0])[1]
    return latest_checkpoint(run_dir)


def plot_run(run_dir: str | os.PathLike, metrics: Iterable[dict] | None = None) -> Path | None:
    """plot.png: training and validation loss (left), samples/s (right)."""
    rows = list(metrics if metrics is not None else read_metrics(run_dir))
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in rows]
    ax_loss.plot(steps, [r["loss"] for r in rows], label="train loss")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        ax_loss.plot(*zip(*val), "o-", label="val loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_tput.plot(steps, [r.get("samples_per_s", 0.0) for r in rows], color="tab:green")
    ax_tput.set_xlabel("optimizer step")
    ax_tput.set_ylabel("samples/s (all workers)")
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(run_dir) / PLOT_FILE
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
