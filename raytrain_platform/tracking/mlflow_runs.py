"""MLflow runs, opened and closed where a run is driven: the `rtp train` driver, a
sweep trial's driver, a sweep's driver (the parent run), torchrun's rank 0.

The run id is kept in a small JSON state file the caller names (the run directory's
``tracking.json``), so a resumed run continues the same MLflow run and rank 0 of the
workers finds it (`raytrain_platform.tracking.steps`). An unreachable or failing
store is one `TrackingUnavailable` warning and tracking is off: never a failed run.

>>> flatten_config({"train": {"lr": 0.05, "betas": [0.9, 0.95]}, "model": {"kwargs": {}}})
{'train.lr': '0.05', 'train.betas': '[0.9, 0.95]', 'model.kwargs': '{}'}

No torch or Ray here; mlflow is imported on first use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

__all__ = [
    "DEFAULT_EXPERIMENT",
    "TrackedRun",
    "TrackingUnavailable",
    "end_if_running",
    "flatten_config",
    "now_ms",
    "git_commit",
    "mlflow_client",
    "open_mlflow_run",
    "read_state",
    "resolve_tracking_uri",
]

DEFAULT_EXPERIMENT = "raytrain_platform"
DB_FILE = "mlflow.db"  # the default store, in the storage root beside the run directories
ARTIFACTS_DIR = "mlartifacts"  # the default store's artifacts, beside its database
# A TCP connect to an http(s) store before any MLflow call: MLflow's own client retries
# a refused connection 7 times with backoff (about 4 minutes) before it gives up.
PROBE_TIMEOUT_S = 5.0
_MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
_PARAMS_PER_BATCH = 100  # MLflow's limit on params per log_batch


class TrackingUnavailable(UserWarning):
    """A tracker could not be reached or failed: the run goes on without it."""


def warn_unavailable(what: str, where: str, exc: BaseException) -> None:
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    warnings.warn(f"run.tracking: {what} at {where} is unavailable ({type(exc).__name__}: {reason}); "
                  "the run goes on without it (metrics.jsonl is still written)",
                  TrackingUnavailable, stacklevel=3)


def resolve_tracking_uri(tracking_uri: str | None, storage_path: str) -> str:
    """`run.tracking_uri`, else ``MLFLOW_TRACKING_URI``, else a SQLite file in the storage
    root. Local paths are made absolute: Ray workers do not share the driver's cwd."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return "sqlite:///" + str(Path(storage_path).expanduser().resolve() / DB_FILE)
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path = uri[len("sqlite:///"):]
        return "sqlite:///" + os.path.abspath(os.path.expanduser(path)) if path else uri
    if uri.startswith("file:") and not uri.startswith("file:/"):  # file:./mlruns, file:mlruns
        return Path(os.path.abspath(os.path.expanduser(uri[len("file:"):]))).as_uri()
    if "://" not in uri and not uri.startswith(("databricks", "file:")):
        return os.path.abspath(os.path.expanduser(uri))  # a plain path: MLflow's file store
    return uri


def _artifact_location(uri: str) -> str | None:
    """A SQLite store keeps new experiments' artifacts beside its file (MLflow's default
    is ./mlruns under whatever directory the process runs in); servers decide their own."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / ARTIFACTS_DIR).as_uri()
    return None


def _probe(uri: str) -> None:
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https") and parsed.hostname:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        with socket.create_connection((parsed.hostname, port), timeout=PROBE_TIMEOUT_S):
            pass


def mlflow_client(uri: str) -> Any:
    """An `MlflowClient` for `uri`, without MLflow's usage telemetry (offline-first;
    set MLFLOW_DISABLE_TELEMETRY=false to allow it) or its store-creation log lines."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for name in ("alembic.runtime.migration", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_MAX_PARAM_CHARS]


def flatten_config(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested sections -> dotted keys with string values (MLflow params)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, f"{path}."))
        else:
            flat[path] = _param_value(value)
    return flat


def git_commit(cwd: str | None = None) -> str | None:
    """HEAD of the git checkout the run is launched from, if any."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True,
                             timeout=5, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def read_state(state_file: Path) -> dict:
    try:
        state = json.loads(Path(state_file).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(state_file: Path, state: dict) -> None:
    tmp = Path(f"{state_file}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, state_file)


@dataclass
class TrackedRun:
    """One MLflow run on the driver's side; every call is a no-op once inactive (MLflow
    off, or the store failed: warned once)."""

    client: Any = None
    run_id: str | None = None
    uri: str | None = None

    @property
    def active(self) -> bool:
        return self.client is not None and self.run_id is not None

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """A failure is one warning and the end of this run's tracking: a store that went
        away would otherwise cost MLflow's retries (minutes) at every later call."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - tracking never fails the run it tracks
            warn_unavailable("MLflow", str(self.uri), exc)
            self.client = None

    def log_artifacts(self, paths: Iterable[Path | None], artifact_path: str | None = None) -> None:
        """Each existing file, or folder (as ``artifact_path/<its name>``)."""
        existing = [Path(p) for p in paths if p and Path(p).exists()]
        if not self.active or not existing:
            return
        with self._guard():
            for path in existing:
                if path.is_dir():
                    sub = f"{artifact_path}/{path.name}" if artifact_path else path.name
                    self.client.log_artifacts(self.run_id, str(path), sub)
                else:
                    self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_values(self, metrics: dict[str, float] | None = None, tags: dict[str, str] | None = None,
                   step: int = 0) -> None:
        if not self.active:
            return
        from mlflow.entities import Metric, RunTag

        now = now_ms()
        with self._guard():
            self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in
                                                        (metrics or {}).items()],
                                  tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()])

    def finish(self, status: str = "FINISHED") -> None:
        if self.active:
            with self._guard():
                self.client.set_terminated(self.run_id, status=status)

    @contextlib.contextmanager
    def ending(self) -> Iterator[TrackedRun]:
        """FINISHED when the block ends, FAILED (KILLED on Ctrl-C) when it raises."""
        try:
            yield self
        except KeyboardInterrupt:
            self.finish("KILLED")
            raise
        except BaseException:
            self.finish("FAILED")
            raise
        self.finish("FINISHED")


def now_ms() -> int:
    """Wall-clock milliseconds, MLflow's timestamps."""
    return int(time.time() * 1000)


def _experiment_id(client: Any, name: str, uri: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name, artifact_location=_artifact_location(uri))
        except Exception:  # created meanwhile by another driver (concurrent sweep trials)
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage == "deleted":
        client.restore_experiment(found.experiment_id)
    return found.experiment_id


def _resume(client: Any, state: dict, uri: str) -> Any | None:
    """The run recorded in the state file, when it lives in this store and is not deleted."""
    mine = state.get("mlflow") or {}
    if mine.get("tracking_uri") != uri or not mine.get("run_id"):
        return None
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_run(mine["run_id"])
    except MlflowException:
        return None
    return found if found.info.lifecycle_stage == "active" else None


def _log_params(client: Any, run_id: str, params: dict[str, str], existing: dict[str, str]) -> None:
    """Params are immutable in MLflow: a resumed run adds the new keys only and tags the
    keys whose values changed (config.yaml, logged at the end, has the new values)."""
    from mlflow.entities import Param, RunTag

    new = [Param(k, v) for k, v in params.items() if k not in existing]
    for i in range(0, len(new), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=new[i:i + _PARAMS_PER_BATCH])
    changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
    if changed:
        client.log_batch(run_id, tags=[RunTag("params_changed_on_resume", ", ".join(changed)[:5000])])


def open_mlflow_run(*, tracking_uri: str | None, storage_path: str, experiment: str | None,
                    name: str, state_file: Path, params: dict[str, Any], tags: dict[str, str],
                    parent_run_id: str | None = None) -> TrackedRun:
    """Continue the run recorded in `state_file`, else create one named `name` in
    `experiment` (child of `parent_run_id` when given); log `params` and `tags`."""
    uri = resolve_tracking_uri(tracking_uri, storage_path)
    run_id = found = None
    try:
        _probe(uri)
        client = mlflow_client(uri)
        state = read_state(state_file)
        found = _resume(client, state, uri)
        if found is not None:
            run_id, existing = found.info.run_id, dict(found.data.params)
            client.update_run(run_id, status="RUNNING")
        else:
            tags = {**tags, **({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})}
            exp_id = _experiment_id(client, experiment or DEFAULT_EXPERIMENT, uri)
            run_id, existing = client.create_run(exp_id, run_name=name, tags=tags).info.run_id, {}
        _log_params(client, run_id, {k: _param_value(v) for k, v in params.items()}, existing)
        _write_state(state_file, {**state, "mlflow": {"tracking_uri": uri, "run_id": run_id}})
    except Exception as exc:  # noqa: BLE001 - an unreachable store is a warning
        if run_id is not None:  # the store refused the params (a key too long, a bad character)
            _abandon(client, run_id, found)
        warn_unavailable("MLflow", uri, exc)
        _forget(state_file)
        return TrackedRun(uri=uri)
    return TrackedRun(client=client, run_id=run_id, uri=uri)


def _abandon(client: Any, run_id: str, resumed: Any | None) -> None:
    """A run that tracking gave up on is not left RUNNING: a new one (nothing logged) is
    deleted, a resumed one gets back the status its last attempt ended with."""
    with contextlib.suppress(Exception):  # the warning that follows says why
        if resumed is None:
            client.delete_run(run_id)
        else:
            client.update_run(run_id, status=resumed.info.status)


def end_if_running(state_file: Path, status: str) -> bool:
    """End the MLflow run recorded in `state_file` with `status` if it is still RUNNING:
    a sweep trial that Tune stopped (ASHA) was killed with its driver, which would have
    ended it. True if it was ended; a store that fails is one warning."""
    mine = read_state(state_file).get("mlflow") or {}
    if not mine.get("run_id") or not mine.get("tracking_uri"):
        return False
    try:
        _probe(mine["tracking_uri"])
        client = mlflow_client(mine["tracking_uri"])
        if client.get_run(mine["run_id"]).info.status != "RUNNING":
            return False
        client.set_terminated(mine["run_id"], status=status)
    except Exception as exc:  # noqa: BLE001 - tracking never fails the sweep it tracks
        warn_unavailable("MLflow", mine["tracking_uri"], exc)
        return False
    return True


def _forget(state_file: Path) -> None:
    """No MLflow run this time: rank 0 must not log to the one an earlier attempt recorded."""
    state = read_state(state_file)
    if state.pop("mlflow", None) is not None:
        with contextlib.suppress(OSError):
            _write_state(state_file, state)
