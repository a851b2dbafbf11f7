"""Rank 0's trackers: every report that reaches metrics.jsonl also goes to TensorBoard
(event files in the run directory) and to the MLflow run the driver opened.

Called from the training core (core/engine.py `run_training`), under Ray Train and
under plain torchrun alike: no Ray or torch here.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from raytrain_platform.tracking.mlflow_runs import (
    now_ms,
    mlflow_client,
    read_state,
    warn_unavailable,
)

__all__ = ["StepTrackers", "TensorBoardSink", "open_step_trackers", "scalar_metrics"]

TENSORBOARD_FLUSH_S = 10  # how stale a live `tensorboard --logdir` view may be
MLFLOW_FLUSH_TIMEOUT_S = 60.0  # at the end of the run, for the reports still queued
_METRICS_PER_BATCH = 1000  # MLflow's limit per log_batch
# Tag of a resumed MLflow run: the step ranges logged twice, by an attempt before a
# resume and by the resumed one (the newest point of such a step is the current one).
RELOGGED_TAG = "steps_relogged_on_resume"


class StepSink(Protocol):
    def log(self, metrics: dict) -> None: ...

    def close(self) -> None: ...


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """The report's numbers, but the step (it is the x axis).

    >>> scalar_metrics({"step": 3, "loss": 0.5, "epoch": 0, "note": "x", "ok": True})
    {'loss': 0.5, 'epoch': 0.0}
    """
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    """Scalars into the run directory, so ``tensorboard --logdir <storage_path>`` lists
    every run under its name. One event per report holding all its scalars: without
    TensorFlow each event's CRC is computed in pure Python, and 1000 12-metric reports
    back to back cost the training thread 4.9 ms each as an event per scalar (torch's
    ``SummaryWriter.add_scalar``), 0.2 ms as one event (measured here, 2 busy cores)."""

    def __init__(self, log_dir: str, resume_step: int | None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self.writer = EventFileWriter(log_dir, max_queue_size=100, flush_secs=TENSORBOARD_FLUSH_S)
        # A resumed run hides what it logged past its checkpoint, as metrics.jsonl drops
        # those lines: TensorBoard purges the events from a START step on (what torch's
        # SummaryWriter(purge_step=...) writes). None: adds to what is there (rtp eval's
        # scores of a checkpoint purge nothing).
        if resume_step is not None:
            self.writer.add_event(Event(wall_time=time.time(), step=resume_step + 1,
                                        session_log=SessionLog(status=SessionLog.START)))

    def log(self, metrics: dict) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalar_metrics(metrics).items()]
        self.writer.add_event(self._event(wall_time=time.time(), step=int(metrics["step"]),
                                          summary=self._summary(value=values)))

    def close(self) -> None:
        self.writer.close()


class MlflowSink:
    """Reports go to the MLflow run from a background thread: rank 0 never waits on the
    store (a server's round trip, SQLite's file lock), so neither do the other ranks.
    The first failure is one warning; later reports are dropped.

    MLflow cannot delete metric points, so the steps an earlier attempt logged past the
    checkpoint a run resumes from (`resume_step`) stay in the history beside the
    resumed attempt's: the run is tagged with that range (`RELOGGED_TAG`), and within
    it the newest point of a step is the current one."""

    def __init__(self, uri: str, run_id: str, tags: dict[str, str], resume_step: int = 0):
        self.uri, self.run_id, self.tags, self.resume_step = uri, run_id, tags, resume_step
        self.queue: queue.Queue = queue.Queue()
        self.failed = False
        self.thread = threading.Thread(target=self._drain, name="rtp-mlflow", daemon=True)
        self.thread.start()

    def log(self, metrics: dict) -> None:
        if not self.failed:
            self.queue.put((int(metrics["step"]), scalar_metrics(metrics), now_ms()))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(MLFLOW_FLUSH_TIMEOUT_S)
        if self.thread.is_alive():
            warn_unavailable("MLflow", self.uri, TimeoutError(
                f"reports still unsent after {MLFLOW_FLUSH_TIMEOUT_S:g} s"))

    def _next_batch(self) -> tuple[list, bool]:
        """Every report queued now (at least one, waiting for it); True at the end."""
        items = [self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return [i for i in items if i is not None], None in items

    def _drain(self) -> None:
        try:
            from mlflow.entities import Metric, RunTag

            client = mlflow_client(self.uri)
            tags = {**self.tags, **_relogged_tag(client, self.run_id, self.resume_step)}
            client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            done = False
            while not done:
                items, done = self._next_batch()
                rows = [Metric(k, v, ts, step) for step, values, ts in items for k, v in values.items()]
                for i in range(0, len(rows), _METRICS_PER_BATCH):
                    client.log_batch(self.run_id, metrics=rows[i:i + _METRICS_PER_BATCH])
        except Exception as exc:  # noqa: BLE001 - tracking never fails the run it tracks
            self.failed = True
            warn_unavailable("MLflow", self.uri, exc)


def _relogged_tag(client: Any, run_id: str, resume_step: int) -> dict[str, str]:
    """``{RELOGGED_TAG: "3-5"}`` when the run already holds steps past `resume_step`
    (the highest step any metric reached), added to the ranges of earlier resumes."""
    if resume_step <= 0:
        return {}
    run = client.get_run(run_id)
    last = max((m.step for m in run.data.to_proto().metrics), default=0)
    if last <= resume_step:
        return {}
    span = f"{resume_step + 1}-{last}"
    earlier = run.data.tags.get(RELOGGED_TAG)
    return {RELOGGED_TAG: f"{earlier}, {span}"[:5000] if earlier else span}


class StepTrackers:
    """The sinks rank 0 feeds; one that fails is warned about once and dropped."""

    def __init__(self, sinks: list[StepSink]):
        self.sinks = sinks

    def log(self, metrics: dict) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(metrics)
            except Exception as exc:  # noqa: BLE001 - a failing tracker is dropped, the run goes on
                self.sinks.remove(sink)
                warn_unavailable(type(sink).__name__, "rank 0", exc)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - a failing tracker is dropped, the run goes on
                warn_unavailable(type(sink).__name__, "rank 0", exc)
        self.sinks = []


def open_step_trackers(tracking: list[str], *, run_dir: str, state_file: Path, resume_step: int,
                       world_size: int) -> StepTrackers:
    """Rank 0's sinks for `tracking` (``run.tracking``). MLflow needs the run the driver
    recorded in `state_file`; without one (the store was unreachable, already warned
    about) there is no MLflow sink."""
    sinks: list[Any] = []
    if "tensorboard" in tracking:
        try:
            sinks.append(TensorBoardSink(run_dir, resume_step))
        except Exception as exc:  # noqa: BLE001 - no TensorBoard is a warning, not a failed run
            warn_unavailable("TensorBoard", run_dir, exc)
    recorded = read_state(state_file).get("mlflow") or {}
    if "mlflow" in tracking and recorded.get("run_id"):
        sinks.append(MlflowSink(recorded["tracking_uri"], recorded["run_id"],
                                {"world_size": str(world_size)}, resume_step))
    return StepTrackers(sinks)
