"""Failures say what went wrong, and a diverged run never destroys good checkpoints.

A fault-injection matrix, with real Ray (one local cluster for the module, 1 worker,
a few steps), over each place our code runs under Ray: a Ray Data map task (a NaN in a
Parquet file), the training loop (a user model that raises), checkpoint save (a model
whose state cannot be read once it trained), a Tune trial and a Serve replica's model load.
Each reaches the user as its root cause in one line; our own errors keep exit code 2.

Then non-finite steps (`train.on_nonfinite`): stop (the issue's lr=1e30 divergence, with
its good checkpoints kept) and skip_step (counted, bounded); and `run.storage_path`,
checked before Ray starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import mlp_config

from raytrain_platform.cli import main as rtp


def _write(tmp: Path, cfg: dict, name: str = "job.yaml") -> str:
    path = tmp / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _stderr_line(capsys) -> str:
    """The one line the CLI printed on stderr (and that it is one)."""
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("checkpoint_*") if p.is_dir())  # not Ray's snapshot file


def _train_without_ray(tmp: Path, cfg: dict, name: str) -> int:
    """The same training core in this process, no Ray (as under torchrun with one rank):
    a cheap way to leave a run directory for a test to continue under Ray."""
    from raytrain_platform.core.__main__ import main as core_main

    return core_main(["--config", _write(tmp, cfg, name)])


def _nan_parquet(folder: Path) -> Path:
    """A tabular Parquet file, 4 features, whose row 3 has a NaN feature."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4)).astype(np.float32)
    x[3, 1] = np.nan
    table = pa.table({**{f"f{i}": x[:, i] for i in range(4)},
                      "label": rng.integers(0, 3, size=512)})
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "part.parquet", row_group_size=256)
    return folder / "part.parquet"


def _parquet_config(tmp: Path, name: str) -> dict:
    cfg = mlp_config(tmp, name, data={"source": "parquet", "path": str(tmp / "data"),
                                      "label_column": "label"})
    for key in ("num_samples",):
        cfg["data"].pop(key, None)
    return cfg


# ------------------------------------------------------------------ before Ray

@pytest.mark.parametrize("where, expected", [
    ("a_file", "expected a folder for run directories; {tmp}/a_file is a file"),
    ("a_file/runs", "a_file is a file, so it cannot be created"),
    ("/proc/rtp_runs", "expected a folder for run directories; /proc is not writable"),
    ("nosuchscheme://bucket/runs", "expected a URI whose filesystem resolves (Unrecognized filesystem type"),
])
def test_a_storage_path_that_cannot_hold_runs_is_exit_2_before_ray(tmp_path, capsys, where, expected):
    """The issue's case (a file as run.storage_path passed `rtp validate` and failed
    after Ray started): validate and train refuse it, naming the field and the reason."""
    import ray

    (tmp_path / "a_file").write_text("not a folder")
    storage = where if where.startswith("/") or "://" in where else str(tmp_path / where)
    config = _write(tmp_path, mlp_config(tmp_path, "storage", run={"storage_path": storage}))
    ray_was_up = ray.is_initialized()
    for command in ("validate", "train"):
        assert rtp([command, config]) == 2
        line = _stderr_line(capsys)
        assert line.startswith(f"error: run.storage_path = {storage!r}: ") and \
            expected.format(tmp=tmp_path) in line, line
    assert ray.is_initialized() == ray_was_up  # refused before Ray was started


def test_retention_keeps_the_newest_checkpoint_whose_loss_was_finite(tmp_path):
    """Checkpoints recorded with a NaN loss (as a diverged run used to write them) never
    push out the last good one, whatever run.keep_checkpoints says."""
    from raytrain_platform.core.rundir import (
        newest_finite_checkpoint,
        prune_checkpoints,
    )

    for step, loss in ((5, 1.3), (10, 1.1), (15, float("nan")), (20, float("inf"))):
        ckpt = tmp_path / f"checkpoint_{step:06d}"
        ckpt.mkdir()
        for f in ("model.safetensors", "optimizer.pt"):
            (ckpt / f).write_bytes(b"x" * step)
        (ckpt / "trainer_state.json").write_text(json.dumps({
            "state": {"step": step}, "metrics": {"loss": loss},
            "files": {"model.safetensors": step, "optimizer.pt": step}}))
    assert newest_finite_checkpoint(tmp_path).name == "checkpoint_000010"
    prune_checkpoints(tmp_path, keep=1)
    assert _checkpoints(tmp_path) == ["checkpoint_000010", "checkpoint_000020"]


def test_our_error_is_found_under_each_of_rays_wrappers_and_read_as_one_line():
    """Ray's own exception classes, built as Ray builds them (no cluster): a task error
    (as its dual "instance of the cause"), Train's worker-group and controller errors,
    Ray Data's retry note appended to the message, and a remote traceback whose
    exception object was lost (only its text arrived)."""
    from ray.exceptions import RayTaskError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    from raytrain_platform.errors import (
        DataError,
        describe_error,
        first_line,
        user_cause,
    )

    ours = DataError("part.parquet: row group 0 has NaN or infinite features")
    ours.args = (ours.args[0] + "\nTo change retry attempts, backoff, ... configure `ray.data."
                 "DataContext.get_current()` ...",)  # as Ray Data annotates it
    task = RayTaskError("map_batches", "Traceback ...\nDataError: ...", ours).as_instanceof_cause()
    wrapped = [
        task,
        WorkerGroupError("rank 0 failed", {1: RuntimeError("peer closed"), 0: task}),
        ControllerError(UserExceptionWithTraceback(task, "Traceback ...")),
    ]
    for exc in wrapped:
        assert user_cause(exc) is ours, type(exc).__name__
        assert first_line(user_cause(exc)) == "part.parquet: row group 0 has NaN or infinite features"
    lost = RuntimeError("Training failed:\nTraceback (most recent call last):\n  File ...\n"
                        "raytrain_platform.errors.DataError: a.parquet: row group 3 has NaN or infinite features")
    assert str(user_cause(lost)) == "a.parquet: row group 3 has NaN or infinite features"
    assert isinstance(user_cause(lost), DataError)
    bug = WorkerGroupError("...", {0: ValueError("boom\nsecond line"), 1: RuntimeError("peer closed")})
    assert user_cause(bug) is None and describe_error(bug) == "ValueError: boom"


# ------------------------------------------------------------------ faults under Ray

@pytest.mark.ray
def test_a_data_error_in_a_ray_data_task_is_its_own_line_and_exit_2(ray_cluster, tmp_path, capsys):
    """The issue's first case: a NaN feature found by the Parquet read task. Before:
    exit 1 and "WorkerGroupError: To change retry attempts, backoff, ..." (Ray Data's
    retry note)."""
    part = _nan_parquet(tmp_path / "data")
    assert rtp(["train", _write(tmp_path, _parquet_config(tmp_path, "nan_data"))]) == 2
    assert _stderr_line(capsys) == f"error: {part}: row group 0 has NaN or infinite features"


@pytest.mark.ray
@pytest.mark.parametrize("model, expected", [
    # the training loop: a user model's forward raises on its third call
    ({"name": "user_models:failing_mlp", "kwargs": {"fail_at": 2}},
     "error: train failed: ValueError: user model failed on forward 2"),
    # checkpoint save: reading the model's state fails once it has trained
    ({"name": "user_models:failing_save_mlp", "kwargs": {}},
     "error: train failed: OSError: checkpoint write failed: no space left on device (injected)"),
])
def test_a_failure_in_the_loop_or_the_checkpoint_save_is_its_root_cause_exit_1(
        ray_cluster, tmp_path, capsys, model, expected):
    cfg = mlp_config(tmp_path, "fault", model={**model, "task": "classification"},
                     train={"max_steps": 6}, run={"checkpoint_every": 3})
    assert rtp(["train", _write(tmp_path, cfg)]) == 1
    line = _stderr_line(capsys)
    assert line.startswith(expected) and line.endswith("(rerun with --verbose for Ray's logs)"), line


@pytest.mark.ray
def test_a_data_error_in_a_tune_trial_is_recorded_in_one_line_and_the_sweep_exits_2(
        ray_cluster, tmp_path, capsys):
    part = _nan_parquet(tmp_path / "data")
    base = _parquet_config(tmp_path, "unused")
    base["train"]["max_steps"] = 4
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump({"name": "nan_sweep", "base": base, "metric": "val_loss",
                                          "mode": "min", "space": {"train.lr": [0.05]}}))
    assert rtp(["sweep", str(sweep_file)]) == 2
    out = capsys.readouterr().out
    reason = f"{part}: row group 0 has NaN or infinite features"
    assert f"trial_000 invalid: {reason}" in out.splitlines(), out[-2000:]
    import pandas as pd

    rows = pd.read_csv(tmp_path / "nan_sweep" / "results.csv")
    assert list(rows.status) == ["invalid"] and list(rows.error) == [reason]


@pytest.mark.ray
def test_a_replica_that_cannot_load_its_model_answers_one_line_503(ray_cluster, tmp_path):
    """The checkpoint was good at start-up (the catalog loads it) and is cut short before
    the replica loads it: the request gets the CheckpointError's one line, not a trace."""
    import requests
    from conftest import free_port
    from ray import serve

    from raytrain_platform.core.rundir import latest_checkpoint
    from raytrain_platform.serve.builder import build_application
    from raytrain_platform.serve.catalog import load_catalog
    from raytrain_platform.serve.options import parse_serve_args

    assert _train_without_ray(tmp_path, mlp_config(tmp_path, "served", train={"max_steps": 2}), "s.yaml") == 0
    options = parse_serve_args({"checkpoint": f"faulty={tmp_path / 'served'}", "max_batch_size": 1})
    catalog = load_catalog(options)
    weights = latest_checkpoint(tmp_path / "served") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_application(catalog, options), name="faulty", route_prefix="/")
        reply = requests.post(f"http://127.0.0.1:{port}/v1/predict", timeout=60,
                              json={"model": "faulty", "rows": [[0.0] * 16]})
    finally:
        serve.shutdown()
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert "\n" not in message
    assert message.startswith(f"model unavailable: model 'faulty': {weights}: not a valid safetensors "
                              "file"), message


# ------------------------------------------------------------------ non-finite steps

@pytest.mark.ray
def test_a_diverged_run_stops_at_the_first_nan_and_keeps_its_good_checkpoints(
        ray_cluster, tmp_path, capsys):
    """The issue's case: lr=1e30, SGD, no clipping. Before: it trained on to the end,
    wrote checkpoints of NaN weights, exited 0, and with keep_checkpoints 2 those pushed
    out the good ones. Now: a healthy first run leaves checkpoints 5 and 10; the rerun
    (which resumes from 10) diverges, stops at its first NaN step with exit 1, writes
    nothing, and says which checkpoint is the newest finite one."""
    good = mlp_config(tmp_path, "diverge", run={"keep_checkpoints": 2})
    assert _train_without_ray(tmp_path, good, "good.yaml") == 0  # the same run directory, cheaper
    run_dir = tmp_path / "diverge"
    assert _checkpoints(run_dir) == ["checkpoint_000005", "checkpoint_000010"]
    capsys.readouterr()
    assert rtp(["train", _write(tmp_path, good), "--set", "train.lr=1e30", "--set", "train.max_steps=20"]) == 1
    line = _stderr_line(capsys)
    assert line == (f"error: train failed: NonFiniteError: step 12: loss nan (train.on_nonfinite: stop); "
                    f"newest finite checkpoint: {run_dir / 'checkpoint_000010'} "
                    "(rerun with --verbose for Ray's logs)"), line
    assert _checkpoints(run_dir) == ["checkpoint_000005", "checkpoint_000010"]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 11  # nothing logged past the last finite step


@pytest.mark.extended  # ~40 s; on_nonfinite: stop stays in the default run
@pytest.mark.ray
def test_skip_step_skips_and_counts_nonfinite_steps_and_stops_after_too_many(ray_cluster, tmp_path, capsys):
    """skip_step: three NaN steps (4-6) are skipped and counted, no checkpoint is written at
    skipped step 5, and the run finishes; NaN from step 4 on stops it after 3 skips."""
    model = {"name": "user_models:nan_mlp", "task": "classification"}
    cfg = mlp_config(tmp_path, "skips", model={**model, "kwargs": {"nan_from": 3, "nan_until": 6}},
                     train={"on_nonfinite": "skip_step"}, run={"keep_checkpoints": 5})
    assert rtp(["train", _write(tmp_path, cfg)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "skips" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [math.isnan(r["loss"]) for r in rows] == [False] * 3 + [True] * 3 + [False] * 4
    assert [r["nonfinite_skips"] for r in rows] == [0, 0, 0, 1, 2, 3, 3, 3, 3, 3]
    assert _checkpoints(tmp_path / "skips") == ["checkpoint_000010"]  # 5 was a skipped step
    capsys.readouterr()

    cfg = mlp_config(tmp_path, "too_many", model={**model, "kwargs": {"nan_from": 3}},
                     train={"on_nonfinite": "skip_step", "max_nonfinite_skips": 3})
    assert _train_without_ray(tmp_path, cfg, "too_many.yaml") == 1  # the engine's rule, no Ray needed
    assert _stderr_line(capsys).startswith(
        "error: train failed: NonFiniteError: step 7: loss nan: 4 non-finite steps in a row, more "
        "than train.max_nonfinite_skips (3); no finite checkpoint was written")


def test_a_bad_config_under_torchrun_is_one_line_not_one_per_rank(tmp_path):
    """Every rank finds the same config error before the process group starts; the
    node's first rank says it once and exits 2 (torchrun then stops the other rank)."""
    import os
    import subprocess

    from conftest import ROOT, torchrun_launch

    cfg = mlp_config(tmp_path, "bad", train={"lr": -1.0})
    cmd = [*torchrun_launch(2), "-m", "raytrain_platform.core", "--config", _write(tmp_path, cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(ours) == 1 and ours[0].startswith("error: train.lr = -1.0: expected "), proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]  # torchrun's report: rank 0 exited 2


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """2 DDP ranks under torchrun (no Ray), NaN on rank 1 only, clipping off: the
    all-reduced verdict stops both at step 4 (no rank waits in a collective forever),
    exit 1 with one line, and the checkpoint of step 3 is the newest finite one."""
    import os
    import subprocess

    from conftest import ROOT, torchrun_launch

    cfg = mlp_config(tmp_path, "rank1", model={"name": "user_models:nan_mlp", "task": "classification",
                                               "kwargs": {"nan_from": 3, "nan_rank": 1}},
                     parallel={"strategy": "ddp"}, scaling={"num_workers": 2},
                     run={"checkpoint_every": 3})
    cmd = [*torchrun_launch(2), "-m", "raytrain_platform.core", "--config", _write(tmp_path, cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240, env=env, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    expected = (f"error: train failed: NonFiniteError: step 4: loss nan (train.on_nonfinite: stop); "
                f"newest finite checkpoint: {tmp_path / 'rank1' / 'checkpoint_000003'}")
    assert ours == [expected], proc.stderr[-3000:]
    assert _checkpoints(tmp_path / "rank1") == ["checkpoint_000003"]
