"""Ray Tune sweeps. Without Ray: the space, the trial plan (impossible combinations
reported, not launched), the sweep file and its CLI errors. On a real 2-CPU local Ray:
a 4-trial grid under ASHA with failing trials, and `rtp sweep` killed mid-sweep and
run again (Tune restore)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import ROOT, mlp_config
from raytrain_platform.cli import main
from raytrain_platform.config import load_config
from raytrain_platform.errors import ConfigError
from raytrain_platform.tune.command import load_sweep_file
from raytrain_platform.tune.space import expand, parse_space
from raytrain_platform.tune.planning import mark_unfit, max_concurrency, plan_trials, trial_demand
from raytrain_platform.tune.sweep import sweep

TESTS = Path(__file__).resolve().parent


def _base(tmp_path: Path, **run) -> dict:
    """Trials that evaluate every 3 steps, so ASHA has rungs to compare at."""
    return mlp_config(tmp_path, "base", train={"max_steps": 12},
                      run={"eval_every": 3, "checkpoint_every": 6, **run})


# ------------------------------------------------------------------ no Ray


def test_space_grid_and_random_axes():
    axes = parse_space({"data.batch_size": [8, 16], "train.lr": {"loguniform": [1e-4, 1e-2]},
                        "parallel.strategy": {"choice": ["ddp", "fsdp"]},
                        "train.grad_accum_steps": {"randint": [1, 4]}})
    trials = expand(axes, num_samples=3, seed=0)
    assert [t["data.batch_size"] for t in trials] == [8, 16] * 3  # grid x num_samples
    assert all(1e-4 <= t["train.lr"] <= 1e-2 for t in trials)
    assert len({t["train.lr"] for t in trials}) == 6  # a fresh draw per trial
    assert {t["parallel.strategy"] for t in trials} <= {"ddp", "fsdp"}
    assert {t["train.grad_accum_steps"] for t in trials} <= {1, 2, 3}
    assert expand(axes, num_samples=3, seed=0) == trials  # seeded: a rerun plans the same trials
    assert expand(axes, num_samples=3, seed=1) != trials


@pytest.mark.parametrize("space, match", [
    ({}, r"^space = \{\}: expected a non-empty mapping"),
    ({"lr": [1]}, r"^space = 'lr': expected dotted config paths"),
    ({"train.lr": []}, r"^space.train.lr = \[\]: expected a non-empty list"),
    ({"train.lr": {"loguniform": [0, 1]}},
     r"^space.train.lr.loguniform = \[0, 1\]: expected a range of numbers > 0"),
    ({"train.lr": {"uniform": [2, 1]}}, r"low < high"),
    ({"train.lr": {"normal": [0, 1]}},
     r"^space.train.lr = .*: expected a list of values \(grid\) or one of"),
    ({"run.name": ["a", "b"]}, r"^space.run.name = .*: expected a field other than run.name"),
])
def test_bad_space_is_one_line(space, match):
    with pytest.raises(ConfigError, match=match):
        parse_space(space)


def test_impossible_combinations_are_reported_before_launch(tmp_path):
    base = load_config(_base(tmp_path))
    axes = parse_space({"parallel.strategy": ["none", "ddp"], "scaling.num_workers": [1, 2],
                        "data.batch_size": [8, 4096]})
    trials = {(t.params["parallel.strategy"], t.params["scaling.num_workers"],
               t.params["data.batch_size"]): t
              for t in plan_trials(base, axes, num_samples=1, seed=0,
                                   runs_dir=str(tmp_path / "runs"), metric="val_loss")}
    error = trials[("none", 2, 8)].error
    assert error.startswith("scaling.num_workers = 2: expected exactly 1 worker(s)")
    assert error.endswith("for parallel.strategy 'none'")
    assert "fewer than one optimizer step needs" in trials[("ddp", 1, 4096)].error
    assert trials[("ddp", 2, 8)].error is None and trials[("ddp", 2, 8)].total_steps == 12
    assert trials[("ddp", 2, 8)].config["run"]["storage_path"] == str(tmp_path / "runs")
    # On a 2-CPU cluster a trial needs its driver, its workers and a CPU for Ray Data.
    fit = mark_unfit([trials[("ddp", 2, 8)], trials[("ddp", 1, 8)]], {"CPU": 2.0})
    assert fit[0].error.endswith("it needs 2.01 CPU (driver, workers and Ray Data), the cluster has 2")
    assert fit[1].error is None
    demands = [trial_demand(trials[("ddp", 1, 8)].config)]
    assert demands == [{"CPU": 1.51}] and max_concurrency(demands * 4, {"CPU": 2.0}) == 1
    # The objective val_loss needs validation data.
    no_val = plan_trials(load_config(_base(tmp_path, name="nv"), ["data.val_fraction=0"]),
                         parse_space({"train.lr": [0.1]}), num_samples=1, seed=0,
                         runs_dir=str(tmp_path / "runs"), metric="val_loss")
    assert no_val[0].error.startswith("data.val_fraction = 0.0: expected > 0")


def test_sweep_file_and_cli_errors(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(_base(tmp_path)))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": "base.yaml", "space": {"train.lr": [0.1]},
                                    "scheduler": "asha"}))
    kwargs = load_sweep_file(path, ["num_samples=3", "train.max_steps=20"])
    assert kwargs["num_samples"] == 3 and kwargs["overrides"] == ["train.max_steps=20"]
    assert kwargs["base_config"]["run"]["name"] == "base" and kwargs["scheduler"] == "asha"

    def error(doc: dict, *args: str) -> str:
        path.write_text(yaml.safe_dump(doc))
        assert main(["sweep", str(path), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    ok = {"name": "s", "base": "base.yaml", "space": {"train.lr": [0.1]}}
    assert error({**ok, "spaces": {}}).startswith("error: spaces = {}: expected a sweep key")
    assert error({"name": "s", "base": "base.yaml"}) == (
        "error: space = None: expected a value (required in a sweep file)")
    assert error({**ok, "base": "missing.yaml"}).startswith("error: base = ")
    assert "scheduler = 'hyperband': expected fifo, asha" in error({**ok, "scheduler": "hyperband"})
    assert "mode = None: expected 'min' or 'max'" in error({**ok, "metric": "val_accuracy"})
    assert error({**ok, "space": {"train.lr": [-1]}}) == (
        "error: no trial of sweep 's' can run; trial_000: train.lr = -1.0: expected a number > 0")
    assert "run.name = 'bad name'" in error(ok, "--set", "name=bad name")


@pytest.mark.parametrize("setting, expected", [
    ({"storage_path": 123}, "storage_path = 123: expected a local folder path, or null"),
    ({"storage_path": "s3://bucket/sweeps"}, "storage_path = 's3://bucket/sweeps': expected a local"),
    ({"seed": [1]}, "seed = [1]: expected an integer (a rerun must draw the same trials to resume)"),
    ({"seed": None}, "seed = None: expected an integer"),  # each run would draw other trials
    ({"seed": True}, "seed = True: expected an integer"),
    ({"max_concurrent": True}, "max_concurrent = True: expected an integer >= 1 or null"),
    ({"max_concurrent": 0}, "max_concurrent = 0: expected an integer >= 1 or null"),
])
def test_bad_sweep_settings_are_one_line_before_ray(tmp_path, capsys, monkeypatch, setting, expected):
    import raytrain_platform.launch.trainer as trainer

    def ray_starts(*args, **kwargs):
        raise AssertionError("Ray started before the sweep file was checked")

    monkeypatch.setattr(trainer, "init_ray", ray_starts)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": _base(tmp_path), "space": {"train.lr": [0.1]},
                                    **setting}))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {expected}") and len(err.splitlines()) == 1, err


def test_a_stopped_trials_mlflow_run_is_ended_killed(tmp_path):
    """ASHA stops a trial by killing its driver, which would have ended its MLflow run:
    `ReleaseStopped` ends a run left RUNNING (KILLED; FAILED after an error) and leaves
    a run its driver ended as it is."""
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from raytrain_platform.tracking.mlflow_runs import open_mlflow_run
    from raytrain_platform.tune.callbacks import ReleaseStopped

    uri, runs = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "runs"

    def trial(name: str, *, end: str | None = None) -> tuple[SimpleNamespace, str]:
        tracked = open_mlflow_run(tracking_uri=uri, storage_path=str(tmp_path), experiment=None,
                                  name=name, state_file=runs / name / "tracking.json", params={},
                                  tags={})
        if end:
            tracked.finish(end)
        spec = {"name": name, "config": {"run": {"storage_path": str(runs)}}}
        return SimpleNamespace(config={"trial": spec}), tracked.run_id

    stopped, finished, crashed = trial("trial_000"), trial("trial_001", end="FINISHED"), trial("trial_002")
    callback = ReleaseStopped()
    callback.on_trial_complete(0, [], stopped[0])
    callback.on_trial_complete(0, [], finished[0])
    callback.on_trial_error(0, [], crashed[0])
    client = MlflowClient(uri)
    assert [client.get_run(run_id).info.status for _, run_id in (stopped, finished, crashed)] == [
        "KILLED", "FINISHED", "FAILED"]


# ------------------------------------------------------------------ real Ray


@pytest.mark.ray
def test_auto_trials_are_decided_on_the_cluster_not_the_driver(ray_cluster, tmp_path):
    """`parallel.strategy: auto` is planned against what the trial's workers will have,
    as `rtp train` plans it: the cluster's GPUs (none here), not the driver machine's
    (a CPU laptop driving a GPU cluster marked every GPU trial invalid)."""
    from raytrain_platform.errors import UserError

    with pytest.raises(UserError, match=r"trial_000: scaling.use_gpu = True: expected false on this cluster: "
                                        r"it has no GPUs$"):
        sweep(_base(tmp_path), {"train.lr": [0.05]}, overrides=["scaling.use_gpu=true", "parallel.strategy=auto"],
              name="gpu-auto")


@pytest.mark.ray
def test_grid_asha_and_failing_trials(ray_cluster, tmp_path, capsys):
    """A 4-trial grid: the trials that cannot run (a model that cannot be imported:
    found before launch, as every user builder is) are recorded with their reason while
    the sweep goes on; ASHA stops the trial whose learning rate is too small at its
    first validation; the rest finish."""
    import ray

    result = sweep(_base(tmp_path), {"train.lr": [0.05, 0.0001],
                                     "model.name": ["no_such_module:build", "mlp"]},
                   scheduler="asha", name="grid")
    rows = result.trials.set_index("trial")
    assert list(rows.status) == ["invalid", "done", "invalid", "stopped"], rows
    for name in ("trial_000", "trial_002"):
        assert rows.loc[name, "error"] == ("model.name = 'no_such_module:build': expected an "
                                           "importable module (No module named 'no_such_module')")
    assert rows.loc["trial_001", "step"] == 12 and rows.loc["trial_003", "step"] == 3
    metrics = (tmp_path / "grid/runs/trial_001/metrics.jsonl").read_text()
    good = [json.loads(x) for x in metrics.splitlines()]
    good_at_3 = next(m["val_loss"] for m in good if m["step"] == 3)
    assert rows.loc["trial_003", "val_loss"] > good_at_3  # why ASHA stopped it there
    assert result.best_trial == "trial_001" and result.best["val_loss"] == good[-1]["val_loss"]

    csv = pd.read_csv(result.results_csv)
    assert list(csv.trial) == list(rows.index) and list(csv.status) == list(rows.status)
    best = yaml.safe_load(result.best_config.read_text())
    assert best["train"]["lr"] == 0.05 and best["run"]["name"] == "grid-best"
    assert best["run"]["storage_path"] == str(tmp_path)
    load_config(best)  # ready to run
    assert result.best_checkpoint == tmp_path / "grid/runs/trial_001/checkpoint_000012"
    assert (result.best_checkpoint / "model.safetensors").is_file()
    assert result.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    out = capsys.readouterr().out
    assert "2 trial(s), up to 1 at a time" in out  # the 2 runnable ones; 1.51 CPUs a trial on 2 CPUs
    assert any(ln.split()[:3] == ["trial_003", "3", f"{rows.loc['trial_003', 'val_loss']:.4f}"]
               and "stopped" in ln for ln in out.splitlines()), out
    assert "errored after" not in out and "Traceback" not in out  # Ray's own output stays out
    # Nothing left reserved: the stopped trial's workers were released too.
    assert ray.available_resources().get("CPU") == 2.0


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _sweep_cut_at_the_second_trial(tmp_path: Path, name: str, signum: int) -> tuple[list[str], dict, Path, int]:
    """`rtp sweep` of 2 trials on an embedded Ray, sent `signum` (to its process group, as
    a terminal sends Ctrl-C) once the second trial starts: the command, its environment,
    the trials' folder and the exit code."""
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": name, "base": _base(tmp_path), "space": {"train.lr": [0.05, 0.02]}}))
    runs = tmp_path / name / "runs"
    env = {**os.environ, "RAY_ADDRESS": ""}
    cmd = [sys.executable, "-m", "raytrain_platform", "sweep", str(path)]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(tmp_path / "first.log", "w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 400
        while not (runs / "trial_001" / "config.yaml").exists():
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.time() < deadline, "trial_001 never started"
            time.sleep(0.2)
        os.killpg(first.pid, signum)
        code = first.wait(timeout=120)
    finally:
        _stop_group(first)
    return cmd, env, runs, code


@pytest.mark.extended  # a failure test (Ctrl-C mid-sweep, ~1.5 min): run with -m extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_stops_rtp_sweep_with_130_and_no_result(tmp_path):
    """Ctrl-C once the first trial is done: exit 130 soon, no results or best config
    written from the cut-off trial (Tune's own handler returned as if the sweep had
    finished: exit 0, the interrupted trial `stopped` and eligible as the best), and the
    same command resumes."""
    cmd, env, runs, code = _sweep_cut_at_the_second_trial(tmp_path, "int", signal.SIGINT)
    assert code == 130, (tmp_path / "first.log").read_text()[-3000:]
    assert not (tmp_path / "int" / "results.csv").exists() and not (tmp_path / "int" / "best_config.yaml").exists()
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "sweep 'int' (resumed)" in second.stdout
    results = pd.read_csv(tmp_path / "int" / "results.csv")
    assert list(results.status) == ["done", "done"] and list(results.step) == [12, 12]


@pytest.mark.extended  # a failure test (SIGKILL mid-sweep, ~1.5 min): run with -m extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rtp_sweep_killed_and_rerun_resumes(tmp_path):
    """SIGKILL `rtp sweep` (driver, embedded Ray, trials) once its first trial is done;
    the same command again continues the sweep: the finished trial is not trained again."""
    cmd, env, runs, _ = _sweep_cut_at_the_second_trial(tmp_path, "cut", signal.SIGKILL)
    done_before = (runs / "trial_000" / "metrics.jsonl").read_text()
    assert not (runs / "trial_001" / "summary.json").exists(), "the sweep ended before it was killed"

    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "sweep 'cut' (resumed)" in second.stdout
    assert (runs / "trial_000" / "metrics.jsonl").read_text() == done_before  # not retrained
    results = pd.read_csv(tmp_path / "cut" / "results.csv")
    assert list(results.status) == ["done", "done"] and list(results.step) == [12, 12]
    assert "best: trial_0" in second.stdout
