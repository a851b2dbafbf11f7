"""End to end through processes: `rtp train` killed and rerun, and `ray job submit`
against a real `ray start --head` on 127.0.0.1. Every process a test starts is
stopped by its own process group when the test ends."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, free_port, mlp_config, torchrun_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parent


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left."""
    if proc.poll() is not None and not _group_alive(proc.pid):
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline and _group_alive(proc.pid):
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        if not _group_alive(proc.pid):
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"process exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


def _slow_run_config(tmp_path: Path, name: str) -> Path:
    cfg = mlp_config(tmp_path, name, train={"max_steps": 40},
                     run={"checkpoint_every": 10, "keep_checkpoints": 2, "eval_every": 20})
    cfg["model"] = {"name": "user_models:slow_mlp", "task": "classification",
                    "kwargs": {"input_dim": 16, "num_outputs": 4, "delay_s": 0.1}}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rtp_train(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
           "RAY_ADDRESS": ""}
    return subprocess.Popen([sys.executable, "-m", "raytrain_platform", "train", str(config)],
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_killed_run_resumes_when_rerun(tmp_path):
    """SIGKILL `rtp train` (driver, embedded Ray and workers) after its step-10
    checkpoint; the same command again resumes there and ends where an
    uninterrupted run ends, with the same losses."""
    config = _slow_run_config(tmp_path / "cut", "job")
    run_dir = tmp_path / "cut" / "job"
    first = _rtp_train(config, tmp_path / "first.log")
    try:
        _wait_for(lambda: (run_dir / "checkpoint_000010" / "trainer_state.json").exists(), 240,
                  "the step-10 checkpoint", first)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        _stop_group(first)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] < 40, "the run finished before it was killed: nothing was tested"
    # Steps up to the checkpoint, timings included: a resume keeps these lines as they
    # are, a restart from step 0 would rewrite them with other timings.
    before_ckpt = [r for r in rows if r["step"] <= 10]

    second = _rtp_train(config, tmp_path / "second.log")
    try:
        assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        _stop_group(second)
    out = (tmp_path / "second.log").read_text()
    assert "resuming from" in out and "checkpoint_0000" in out

    # The uninterrupted reference: the same config under the Ray-free torchrun core,
    # whose losses equal a Ray run's (tests/test_ray_train.py checks that).
    whole = yaml.safe_load(_slow_run_config(tmp_path / "whole", "job").read_text())
    torchrun_metrics(whole, tmp_path / "whole" / "job.yaml", 1, env={"PYTHONPATH": str(TESTS)})

    def losses(d):
        return [(m["step"], m["loss"]) for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]

    after = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in after if r["step"] <= 10] == before_ckpt
    resumed, uninterrupted = losses(run_dir), losses(tmp_path / "whole" / "job")
    assert [s for s, _ in resumed] == [s for s, _ in uninterrupted] == list(range(1, 41))
    for (step, got), (_, want) in zip(resumed, uninterrupted):
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (step, got, want)
    # retention: run.keep_checkpoints = 2 of the 4 written
    kept = sorted(p.name for p in run_dir.glob("checkpoint_[0-9]*"))
    assert kept == ["checkpoint_000030", "checkpoint_000040"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head --block` on 127.0.0.1 with its own temp dir; stopped by its pgid."""
    temp_dir = Path("/tmp") / f"rtp-head-{uuid.uuid4().hex[:8]}"  # short: Ray's socket paths
    port, dash = free_port(), free_port()
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={port}", "--num-cpus=2", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={temp_dir}",
           "--disable-usage-stats"]
    log = tmp_path / "head.log"
    # The job's `python` is looked up on the head's PATH: this environment's.
    head_env = {**os.environ, "RAY_ADDRESS": "", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    head = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=head_env)
    address = f"http://127.0.0.1:{dash}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": address}
    try:
        _wait_for(lambda: subprocess.run([str(BIN / "ray"), "job", "list", "--address", address],
                                         env=env, capture_output=True, timeout=60).returncode == 0,
                  180, "the head's job server", head)
        yield address, env
    finally:
        _stop_group(head, grace_s=5.0)  # gcs_server outlives SIGTERM by ~30 s: not worth waiting
        subprocess.run(["rm", "-rf", str(temp_dir)], check=False)


def test_ray_job_submit_runs_the_pipeline(ray_head, tmp_path):
    address, env = ray_head
    storage = tmp_path / "runs"
    job_id = f"rtp-e2e-{uuid.uuid4().hex[:8]}"
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", job_id,
         "--working-dir", str(ROOT), "--",
         "python", "pipelines/train.py", "--config", "pipelines/configs/quickstart.yaml",
         "--set", f"run.storage_path={storage}", "--set", "train.max_steps=6",
         "--set", "run.eval_every=3", "--set", "run.checkpoint_every=3",
         "--set", "data.max_files=40"],
        env=env, capture_output=True, text=True, timeout=360)
    status = subprocess.run([str(BIN / "ray"), "job", "status", "--address", address, job_id],
                            env=env, capture_output=True, text=True, timeout=60)
    assert re.search(r"Job '[^']+' succeeded", status.stdout), (submit.stdout[-3000:], status.stdout)
    assert "done: 6 steps" in submit.stdout
    run_dir = storage / "quickstart"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and "val_perplexity" in rows[-1]
    assert (run_dir / "checkpoint_000006" / "model.safetensors").exists()
