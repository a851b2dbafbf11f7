"""Experiment tracking (`run.tracking`), read back with the real clients: MLflow's
`MlflowClient` (search_runs, metric history, artifacts) and TensorBoard's
`EventAccumulator`. Without Ray: config errors, an unreachable store, a store lost
mid-run, TensorBoard, MLflow and the console progress on resume, refused params,
relative stores, the core under torchrun (rank 0 alone logs). On a real
2-CPU local Ray: a DDP run and its resumption (one MLflow run), an unreachable tracking
server (one warning; the run succeeds), a sweep (a parent run, one child per trial)."""

import json
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, free_port, mlp_config, torchrun_metrics
from raytrain_platform.config import load_config
from raytrain_platform.errors import ConfigError
from raytrain_platform.tracking import StepTrackers, TrackingUnavailable, open_step_trackers, open_training_run
from raytrain_platform.tracking.steps import MlflowSink, TensorBoardSink


def _client(storage: Path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")


def _runs(storage: Path, experiment: str = "raytrain_platform") -> list:
    client = _client(storage)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r} in {storage / 'mlflow.db'}"
    return client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])


def _history(storage: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in _client(storage).get_metric_history(run_id, key)]


def _tensorboard(run_dir: Path, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


def _assert_curve(logged: list[tuple[int, float]], rows: list[dict], key: str, *, rel: float) -> None:
    """`logged` (step, value) pairs are metrics.jsonl's `key`, step for step."""
    expected = [(r["step"], r[key]) for r in rows if key in r]
    assert len(logged) == len(expected), (key, logged, expected)
    assert [s for s, _ in logged] == [s for s, _ in expected], key
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=rel), key


def _leaves(tree: dict) -> int:
    return sum(_leaves(v) if isinstance(v, dict) and v else 1 for v in tree.values())


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ no Ray


@pytest.mark.parametrize("run, match", [
    ({"tracking": ["wandb"]}, r"^run.tracking\[0\] = 'wandb': expected one of \['mlflow', 'tensorboard'\]$"),
    ({"tracking": 3}, r"^run.tracking = 3: expected a list of trackers, any of \['mlflow', 'tensorboard'\]"),
    ({"tracking_uri": ""}, r"^run.tracking_uri = '': expected a non-empty string, or null"),
    ({"experiment": " "}, r"^run.experiment = ' ': expected a non-empty string, or null"),
    ({"log_checkpoints": True}, r"^run.log_checkpoints = True: expected false unless run.tracking includes mlflow$"),
    ({"tracking": "mlflow", "storage_path": "s3://bucket/runs"},
     r"^run.tracking_uri = None: expected an MLflow tracking URI when run.storage_path is a URI"),
])
def test_bad_tracking_config_is_one_line(tmp_path, monkeypatch, run, match):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=match):
        load_config(mlp_config(tmp_path, "bad", run=run))


def test_tracking_defaults_and_shorthand(tmp_path):
    assert load_config(mlp_config(tmp_path, "r")).run.tracking == []
    cfg = load_config(mlp_config(tmp_path, "r"), ["run.tracking=mlflow"])
    assert cfg.run.tracking == ["mlflow"]
    cfg = load_config(mlp_config(tmp_path, "r", run={"tracking": ["tensorboard", "mlflow", "tensorboard"]}))
    assert cfg.run.tracking == ["tensorboard", "mlflow"]


def test_unreachable_store_is_one_warning_at_once(tmp_path):
    """A closed port: the TCP probe fails at once (MLflow's own client would retry for
    minutes), and a run id an earlier attempt recorded is forgotten, so rank 0 does not
    log to it."""
    port = free_port()  # bound and released: nothing listens there now
    cfg = load_config(mlp_config(tmp_path, "r", run={"tracking": ["mlflow"],
                                                     "tracking_uri": f"http://127.0.0.1:{port}"}))
    state = tmp_path / "tracking.json"
    state.write_text(json.dumps({"mlflow": {"tracking_uri": "sqlite:///old.db", "run_id": "abc"}}))
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracked = open_training_run(cfg, state_file=state)
    assert time.perf_counter() - t0 < 5.0
    assert not tracked.active
    messages = [str(w.message) for w in caught if issubclass(w.category, TrackingUnavailable)]
    assert len(messages) == 1 and f"http://127.0.0.1:{port}" in messages[0], messages
    assert "mlflow" not in json.loads(state.read_text())
    tracked.log_artifacts([state])  # inactive: nothing happens, nothing raises
    tracked.finish()


def test_tensorboard_resume_hides_steps_past_the_checkpoint(tmp_path):
    """As metrics.jsonl drops its lines past the resumed step, TensorBoard hides the
    events a crashed attempt logged past it."""
    first = TensorBoardSink(str(tmp_path), resume_step=0)
    for step in range(1, 6):
        first.log({"step": step, "loss": float(step), "note": "not a number"})
    first.close()
    time.sleep(1.1)  # event files are ordered by their creation second
    again = TensorBoardSink(str(tmp_path), resume_step=2)
    for step in (3, 4):
        again.log({"step": step, "loss": 10.0 * step})
    again.close()
    assert _tensorboard(tmp_path, "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_console_progress_through_a_resume_prints_each_rerun_step(tmp_path):
    """`rtp train`'s progress lines follow metrics.jsonl as TensorBoard does: the lines
    an earlier attempt left past the checkpoint are never printed (the resumed worker
    drops them), the re-run steps are, once; likewise after a worker restarted mid-run
    rewrites the file and logs past its old length before the next read."""
    from raytrain_platform.core.rundir import MetricsLog
    from raytrain_platform.launch.progress import progress_poller

    def report(step: int, loss: float) -> dict:
        return {"step": step, "epoch": 0, "loss": loss, "samples_per_s": 1.0, "data_wait_frac": 0.0,
                "lr": 0.1}

    def shown() -> list[tuple[int, str]]:
        out = [(int(x.split("/")[0].split()[-1]), x.split(" | ")[2]) for x in lines]
        lines.clear()
        return out

    first = MetricsLog(tmp_path)
    for step in range(1, 11):
        first.append(report(step, 9.0))
    lines: list[str] = []
    poll = progress_poller(tmp_path, 14, lines.append, resume_step=5)  # the driver, before any worker
    poll()
    assert shown() == []
    again = MetricsLog(tmp_path, resume_step=5)
    poll()
    for step in range(6, 13):
        again.append(report(step, 1.0))
        if step in (7, 12):
            poll()
    assert shown() == [(s, "loss 1.0000") for s in range(6, 13)]
    restarted = MetricsLog(tmp_path, resume_step=10)  # Ray Train restarts a failed worker group
    for step in range(11, 15):
        restarted.append(report(step, 0.5))
    poll()
    assert shown() == [(s, "loss 0.5000") for s in range(11, 15)]


def test_the_driver_echoes_new_notes_whole_lines_only(tmp_path):
    """notes.log (rank 0's lines about work outside the steps): what an earlier attempt
    wrote is not echoed again, a new line is, once, and a line still being written waits."""
    from raytrain_platform.core.rundir import NOTES_FILE, append_note
    from raytrain_platform.launch.progress import progress_poller

    append_note(tmp_path, "an earlier attempt's line")
    lines: list[str] = []
    poll = progress_poller(tmp_path, 4, lines.append)
    poll()
    append_note(tmp_path, "reference log-probs: scoring\n96 pairs")  # one line, whatever it holds
    with open(tmp_path / NOTES_FILE, "a") as f:
        f.write("half a li")
    poll()
    assert lines == ["reference log-probs: scoring 96 pairs"]
    with open(tmp_path / NOTES_FILE, "a") as f:
        f.write("ne\n")
    poll()
    poll()
    assert lines == ["reference log-probs: scoring 96 pairs", "half a line"]


def test_relative_store_paths_are_the_drivers(tmp_path, monkeypatch):
    """Rank 0 runs in another working directory: a relative store, plain path or file:
    URI, is resolved against the driver's."""
    from raytrain_platform.tracking import resolve_tracking_uri

    monkeypatch.chdir(tmp_path)
    mlruns = (tmp_path / "mlruns").as_uri()
    assert resolve_tracking_uri("file:./mlruns", "runs") == mlruns
    assert resolve_tracking_uri("file:mlruns", "runs") == mlruns
    assert resolve_tracking_uri("mlruns", "runs") == str(tmp_path / "mlruns")
    assert resolve_tracking_uri("sqlite:///m.db", "runs") == f"sqlite:///{tmp_path / 'm.db'}"
    assert resolve_tracking_uri("file:///srv/mlruns", "runs") == "file:///srv/mlruns"
    assert resolve_tracking_uri("http://127.0.0.1:5000", "runs") == "http://127.0.0.1:5000"


@pytest.mark.parametrize("bad_param", ["k" * 300, "model.kwargs.a@b"])
def test_params_the_store_refuses_leave_no_run_running(tmp_path, bad_param):
    """A param the store refuses (a key over 250 characters, an '@') is one warning, and
    no MLflow run stays RUNNING: a new run is deleted, a resumed one keeps the status its
    last attempt ended with."""
    from mlflow.entities import ViewType

    from raytrain_platform.tracking.mlflow_runs import open_mlflow_run

    state = tmp_path / "tracking.json"

    def open_run(params: dict):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tracked = open_mlflow_run(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                      storage_path=str(tmp_path), experiment=None,
                                      name="r", state_file=state, params=params, tags={})
        return tracked, [str(w.message) for w in caught if issubclass(w.category, TrackingUnavailable)]

    tracked, messages = open_run({"train.lr": 0.1, bad_param: 1})
    assert not tracked.active and len(messages) == 1, messages
    client = _client(tmp_path)
    runs = client.search_runs([client.get_experiment_by_name("raytrain_platform").experiment_id],
                              run_view_type=ViewType.ALL)
    assert [r.info.lifecycle_stage for r in runs] == ["deleted"]
    tracked, messages = open_run({"train.lr": 0.1})
    assert tracked.active and not messages
    tracked.finish("KILLED")
    tracked, messages = open_run({"train.lr": 0.1, bad_param: 1})  # resumed, then refused
    assert not tracked.active and len(messages) == 1, messages
    assert [r.info.status for r in _runs(tmp_path)] == ["KILLED"]


def test_mlflow_resume_tags_the_steps_logged_twice(tmp_path):
    """MLflow cannot delete the points an attempt logged past the checkpoint a run
    resumes from: the run is tagged with the range, each resume adding its own, and the
    newest point of a step is the resumed attempt's."""
    client = _client(tmp_path)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    state = tmp_path / "tracking.json"
    state.write_text(json.dumps({"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                            "run_id": run_id}}))

    def attempt(resume_step: int, steps: range, loss: float) -> None:
        trackers = open_step_trackers(["mlflow"], run_dir=str(tmp_path), state_file=state,
                                      resume_step=resume_step, world_size=1)
        for step in steps:
            trackers.log({"step": step, "loss": loss})
        trackers.close()
        time.sleep(0.01)  # the next attempt's points are newer

    attempt(0, range(1, 6), 9.0)
    assert "steps_relogged_on_resume" not in client.get_run(run_id).data.tags
    attempt(5, range(6, 7), 9.0)  # resumed at the last step logged: nothing twice
    assert "steps_relogged_on_resume" not in client.get_run(run_id).data.tags
    attempt(2, range(3, 5), 1.0)
    attempt(3, range(4, 7), 0.5)
    assert client.get_run(run_id).data.tags["steps_relogged_on_resume"] == "3-6, 4-6"
    newest: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, "loss"):
        newest[m.step] = max(newest.get(m.step, (0, 0.0)), (m.timestamp, m.value))
    assert {s: v for s, (_, v) in sorted(newest.items())} == {
        1: 9.0, 2: 9.0, 3: 1.0, 4: 0.5, 5: 0.5, 6: 0.5}


def test_store_lost_mid_run_is_one_warning_on_rank0(monkeypatch):
    """Rank 0's MLflow sink against a server that is gone (no probe on this side): one
    warning from its thread, later reports dropped, close() returns."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    trackers = StepTrackers([MlflowSink(f"http://127.0.0.1:{free_port()}", "0" * 32, {"world_size": "1"})])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trackers.log({"step": 1, "loss": 1.0})
        t0 = time.perf_counter()
        while not trackers.sinks[0].failed and time.perf_counter() - t0 < 60:
            time.sleep(0.05)
        trackers.log({"step": 2, "loss": 0.5})
        trackers.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, TrackingUnavailable)]
    assert len(messages) == 1 and "127.0.0.1" in messages[0], messages


@pytest.mark.slow
def test_torchrun_without_ray_tracks_from_rank0_only(tmp_path):
    """The training core under plain torchrun (2 ranks, DDP): rank 0 opens the MLflow
    run and is the only one to log; one value per step, one event file."""
    cfg = mlp_config(tmp_path, "tr", parallel={"strategy": "ddp"},
                     run={"tracking": ["mlflow", "tensorboard"], "checkpoint_every": 5, "eval_every": 5})
    rows = torchrun_metrics(cfg, tmp_path / "tr.yaml", 2, env={"MLFLOW_TRACKING_URI": ""})
    assert [r["step"] for r in rows] == list(range(1, 11))
    [run] = _runs(tmp_path)
    assert run.info.run_name == "tr" and run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2" and run.data.tags["strategy"] == "ddp"
    _assert_curve(_history(tmp_path, run.info.run_id, "loss"), rows, "loss", rel=1e-12)
    assert len(list((tmp_path / "tr").glob("events.out.tfevents.*"))) == 1
    _assert_curve(_tensorboard(tmp_path / "tr", "loss"), rows, "loss", rel=1e-6)
    assert {a.path for a in _client(tmp_path).list_artifacts(run.info.run_id)} == {"config.yaml"}


# ------------------------------------------------------------------ real Ray


def _git_head() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                         check=False)
    return out.stdout.strip() if out.returncode == 0 else None


@pytest.mark.ray
@pytest.mark.extended  # two 2-worker Ray runs, ~40 s
def test_ddp_run_and_its_resumption_are_one_mlflow_run(ray_cluster, tmp_path, monkeypatch):
    """2 DDP workers, 6 steps; then the same run name with 9 steps resumes from the
    step-6 checkpoint into the same MLflow run and the same TensorBoard curves."""
    from raytrain_platform.launch.trainer import train

    monkeypatch.chdir(ROOT)  # the git commit tag is the checkout's HEAD
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = {"tracking": ["mlflow", "tensorboard"], "checkpoint_every": 3, "eval_every": 3}
    cfg = mlp_config(tmp_path, "ddp", train={"max_steps": 6}, run=run,
                     parallel={"strategy": "ddp"}, scaling={"num_workers": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(cfg, progress=False)
    assert not [str(w.message) for w in caught if issubclass(w.category, TrackingUnavailable)]
    run_dir = result.run_dir
    [first] = _runs(tmp_path)
    assert first.info.run_name == "ddp" and first.info.status == "FINISHED"
    tags, params = first.data.tags, first.data.params
    assert tags["strategy"] == "ddp" and tags["world_size"] == "2"
    head = _git_head()
    assert tags.get("git_commit") == head and tags.get("mlflow.source.git.commit") == head
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert len(params) == _leaves(resolved)  # the resolved config, flattened
    assert params["train.lr"] == "0.05" and params["parallel.strategy"] == "ddp"
    assert params["model.kwargs.hidden_sizes"] == "[32]" and params["run.tracking"] == '["mlflow", "tensorboard"]'

    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "samples_per_s", "param_bytes", "optim_bytes", "val_loss"):
        _assert_curve(_history(tmp_path, first.info.run_id, key), rows, key, rel=1e-12)  # float64
        _assert_curve(_tensorboard(run_dir, key), rows, key, rel=1e-6)  # TensorBoard keeps float32
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    artifacts = {a.path for a in _client(tmp_path).list_artifacts(first.info.run_id)}
    assert artifacts == {"config.yaml", "plot.png", "summary.json"}  # no checkpoints unless asked
    assert (tmp_path / "mlartifacts").is_dir()  # beside the store, not in the cwd

    resumed = train(mlp_config(tmp_path, "ddp", train={"max_steps": 9}, run=run,
                               parallel={"strategy": "ddp"}, scaling={"num_workers": 2}), progress=False)
    [again] = _runs(tmp_path)
    assert again.info.run_id == first.info.run_id and again.info.status == "FINISHED"
    assert again.data.tags["params_changed_on_resume"] == "train.max_steps"
    rows = _rows(resumed.run_dir)
    assert [r["step"] for r in rows] == list(range(1, 10))
    _assert_curve(_history(tmp_path, first.info.run_id, "loss"), rows, "loss", rel=1e-12)
    _assert_curve(_tensorboard(run_dir, "loss"), rows, "loss", rel=1e-6)


@pytest.mark.extended  # a Ray run; the one-warning rule is tested without Ray above
@pytest.mark.ray
def test_unreachable_tracking_server_warns_and_training_succeeds(ray_cluster, tmp_path, monkeypatch):
    """The tracking server is down (a closed port on 127.0.0.1): one warning, the run
    trains to the end and metrics.jsonl has every step. MLflow's own retries are cut
    short too, so a regression that skips the probe shows as a slow test, not a hang."""
    from raytrain_platform.launch.trainer import train

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    cfg = mlp_config(tmp_path, "down", train={"max_steps": 4},
                     run={"tracking": ["mlflow"], "tracking_uri": f"http://127.0.0.1:{free_port()}"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(cfg, progress=False)
    unavailable = [w for w in caught if issubclass(w.category, TrackingUnavailable)]
    assert len(unavailable) == 1, [str(w.message) for w in unavailable]
    assert [r["step"] for r in _rows(result.run_dir)] == [1, 2, 3, 4]
    assert result.summary["steps"] == 4 and result.checkpoint is not None
    assert not list(result.run_dir.glob("events.out.tfevents.*"))  # tensorboard was not asked for
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.extended  # a 2-trial sweep (~80 s); the training run's MLflow record stays in the default run
@pytest.mark.ray
def test_sweep_is_a_parent_run_with_a_child_per_trial(ray_cluster, tmp_path, monkeypatch):
    """Two trials over train.lr in experiment 'lr-search': a parent run holding the
    results table, the plot and the best value; two children (params: the swept lr),
    each with its step metrics, its TensorBoard curves and, as asked, its checkpoint."""
    from raytrain_platform.tune.sweep import sweep

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    base = mlp_config(tmp_path, "base", train={"max_steps": 4},
                      run={"tracking": ["mlflow", "tensorboard"], "eval_every": 2, "checkpoint_every": 4,
                           "experiment": "lr-search", "log_checkpoints": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = sweep(base, {"train.lr": [0.05, 0.2]}, name="lrs", progress=False)
    assert not [str(w.message) for w in caught if issubclass(w.category, TrackingUnavailable)]
    assert list(result.trials.status) == ["done", "done"]
    runs = _runs(tmp_path, "lr-search")
    [parent] = [r for r in runs if r.info.run_name == "lrs"]
    children = sorted((r for r in runs if r is not parent), key=lambda r: r.info.run_name)
    assert [c.info.run_name for c in children] == ["trial_000", "trial_001"]
    assert parent.data.tags["kind"] == "sweep" and parent.info.status == "FINISHED"
    assert parent.data.params["metric"] == "val_loss" and parent.data.params["trials"] == "2"
    client = _client(tmp_path)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert artifacts == {"results.csv", "sweep.png", "best_config.yaml"}
    best = result.best
    assert parent.data.metrics["best_val_loss"] == pytest.approx(best["val_loss"])
    assert parent.data.tags["best_trial"] == result.best_trial
    for child, lr in zip(children, ["0.05", "0.2"]):
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.params == {"train.lr": lr}  # the trial's swept values
        assert child.info.status == "FINISHED"
        run_dir = result.sweep_dir / "runs" / child.info.run_name
        rows = _rows(run_dir)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        _assert_curve(_history(tmp_path, child.info.run_id, "loss"), rows, "loss", rel=1e-12)
        _assert_curve(_tensorboard(run_dir, "loss"), rows, "loss", rel=1e-6)
        assert {a.path for a in client.list_artifacts(child.info.run_id)} == {
            "config.yaml", "plot.png", "summary.json", "checkpoints"}  # run.log_checkpoints
        logged = {a.path for a in client.list_artifacts(child.info.run_id, "checkpoints/checkpoint_000004")}
        assert "checkpoints/checkpoint_000004/model.safetensors" in logged, logged
