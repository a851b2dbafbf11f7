"""Serve's own CLI against a real Ray cluster from `ray start --head` on 127.0.0.1
(cluster/local_cluster.py: a head alone, its own temp dir and free ports, stopped by
its pids): ``serve run pipelines.serve:app checkpoint=PATH``, ``serve deploy`` of the
config `rtp serve --write-config` writes, and autoscaling from 1 to 2 replicas under
sustained load and back to 1 after it. Real HTTP clients on 127.0.0.1 throughout.

Outside the default run (2 minutes on 2 quiet cores, 5 on loaded ones):
``pytest -m extended tests/test_serve_deploy.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
import yaml
from conftest import ROOT, free_port, stop_group, wait_for
from test_serve import GPT_KWARGS, _rows, _train

from raytrain_platform.cli import main as rtp
from raytrain_platform.inference import load_model_for_inference

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(600)]
BIN = Path(sys.executable).parent
SCRIPT = ROOT / "cluster" / "local_cluster.py"
APP = "rtp"  # raytrain_platform.serve.command.APP_NAME, the app `--write-config` names


def _env() -> dict:
    # Ray 2.60 clusters from `ray start` take clients with the token (~/.ray/auth_token);
    # the head's workers import raytrain_platform and pipelines/ from here.
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": "", "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def head():
    """A Ray head alone (3 CPUs: two 1-CPU replicas fit), stopped by its own pids."""
    root = Path("/tmp") / f"rtps-{uuid.uuid4().hex[:6]}"  # short: Ray's socket paths live under it
    cmd = [sys.executable, str(SCRIPT)]
    try:
        up = subprocess.run([*cmd, "up", "--dir", str(root), "--workers", "0", "--head-cpus", "3"],
                            capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=240)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
        yield json.loads(up.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run([*cmd, "down", "--dir", str(root)], env=_env(), cwd=ROOT, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("deploy") / "runs"
    _train(root, "clf")
    _train(root, "lm", model={"name": "gpt", "kwargs": GPT_KWARGS},
           data={"source": "synthetic", "batch_size": 4, "num_samples": 256})
    return root


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Serve's CLI (`serve ...`) as a user runs it."""
    return subprocess.run([str(BIN / "serve"), *args], capture_output=True, text=True, env=_env(),
                          cwd=ROOT, timeout=timeout)


def _status(head: dict) -> dict:
    """`serve status`: the app's status and the deployment's replica states."""
    out = _serve("status", "--address", head["dashboard"])
    assert out.returncode == 0, out.stderr[-2000:]
    app = (yaml.safe_load(out.stdout).get("applications") or {}).get(APP) or {}
    deployment = next(iter((app.get("deployments") or {}).values()), {})
    return {"status": app.get("status"), "message": app.get("message"),
            "replicas": deployment.get("replica_states") or {}}


def _wait_running(head: dict, timeout_s: float = 180) -> dict:
    def running():
        status = _status(head)
        assert status["status"] != "DEPLOY_FAILED", status["message"]
        return status if status["status"] == "RUNNING" else None

    return wait_for(running, timeout_s, f"app {APP!r} RUNNING")


def _shutdown(head: dict) -> None:
    out = _serve("shutdown", "-y", "--address", head["dashboard"])
    assert out.returncode == 0, out.stderr[-2000:]


def _answers(url: str) -> bool:
    try:
        return requests.get(url + "/healthz", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


def _check_predict(url: str, run_dir: Path) -> None:
    """A valid request answered with what the checkpoint computes locally."""
    rows = _rows(3)
    r = requests.post(url + "/v1/predict", json={"rows": rows}, timeout=60)
    assert r.status_code == 200, r.text
    model, _, _ = load_model_for_inference(run_dir)
    with torch.no_grad():
        local = model(torch.tensor(rows))
    torch.testing.assert_close(torch.tensor(r.json()["probabilities"]), torch.softmax(local, -1))
    assert r.json()["predictions"] == local.argmax(-1).tolist()


def _write_config(tmp_path: Path, checkpoint: str, port: int, *flags: str) -> Path:
    path = tmp_path / "serve.yaml"
    assert rtp(["serve", checkpoint, "--write-config", str(path), "--host", "127.0.0.1",
                "--port", str(port), *flags]) == 0
    return path


def test_serve_run_of_the_builder_serves_and_stops_on_ctrl_c(head, runs, tmp_path):
    """`serve start` on 127.0.0.1 and a free port, then `serve run pipelines.serve:app
    checkpoint=...` (a process group of its own) attached to the cluster; Ctrl-C
    (SIGINT to its group) makes it shut Serve down and exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = _serve("start", "--address", head["address"], "--http-host", "127.0.0.1", "--http-port", str(port))
    assert started.returncode == 0, started.stderr[-2000:]
    log = tmp_path / "serve_run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "serve"), "run", "--address", head["address"], "pipelines.serve:app",
                                 f"checkpoint=tab={runs / 'clf'}", "max_batch_size=4"],
                                cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for(lambda: _answers(url), 180, "`serve run`'s app to answer", proc)
        assert requests.get(url + "/healthz", timeout=30).json()["models"] == ["tab"]
        _check_predict(url, runs / "clf")
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        wait_for(lambda: not _answers(url), 60, "Serve's proxy to stop")
    finally:
        stop_group(proc)
        if _answers(url):
            _shutdown(head)


def test_serve_deploy_of_the_written_config(head, runs, tmp_path):
    """`rtp serve --write-config` -> `serve deploy` -> `serve status` RUNNING -> a valid
    request -> `serve shutdown -y`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = _write_config(tmp_path, f"tab={runs / 'clf'}", port)
    deployed = _serve("deploy", str(config), "--address", head["dashboard"])
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
    try:
        status = _wait_running(head)
        assert status["replicas"] == {"RUNNING": 1}
        wait_for(lambda: _answers(url), 60, "the deployed app to answer")
        assert requests.get(url + "/healthz", timeout=30).json()["models"] == ["tab"]
        _check_predict(url, runs / "clf")
    finally:
        _shutdown(head)
    wait_for(lambda: not _answers(url), 60, "Serve's proxy to stop")


def _load(url: str, stop: threading.Event, clients: int, failures: list[str]) -> int:
    """`clients` threads posting generate requests until `stop`; returns requests answered."""
    body = {"prompt": "def f(x):", "max_new_tokens": 96, "temperature": 0.8, "seed": 1}

    def client(_: int) -> int:
        session, done = requests.Session(), 0
        while not stop.is_set():
            r = session.post(url + "/v1/generate", json=body, timeout=120)
            if r.status_code != 200:
                failures.append(f"{r.status_code} {r.text[:200]}")
            done += 1
        return done

    with ThreadPoolExecutor(clients) as pool:
        return sum(pool.map(client, range(clients)))


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(head, runs, tmp_path):
    """min 1, max 2, target 1 request in flight per replica, no upscale delay, 2 s
    downscale delay, 12 s look-back; 8 clients keep ~8 requests in flight (no batching,
    so they queue on the replica): the controller adds a replica, and removes it once
    the load has stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = _write_config(tmp_path, f"lm={runs / 'lm'}", port, "--min-replicas", "1", "--max-replicas", "2",
                           "--target-ongoing-requests", "1", "--upscale-delay-s", "0", "--downscale-delay-s", "2",
                           "--look-back-period-s", "12", "--max-batch-size", "1")
    autoscaling = yaml.safe_load(config.read_text())["applications"][0]["args"]
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (1, 2)
    deployed = _serve("deploy", str(config), "--address", head["dashboard"])
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
    stop, failures, timeline = threading.Event(), [], []
    try:
        assert _wait_running(head)["replicas"] == {"RUNNING": 1}
        wait_for(lambda: _answers(url), 60, "the deployed app to answer")
        start = time.monotonic()

        def replicas_running(want: int):
            replicas = _status(head)["replicas"]
            timeline.append((round(time.monotonic() - start, 1), replicas))
            return replicas == {"RUNNING": want}

        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(_load, url, stop, 8, failures)
            try:
                wait_for(lambda: replicas_running(2), 150, "a second replica under load")
                scaled_up = time.monotonic() - start
                time.sleep(5)  # both replicas take load for a while
            finally:
                stop.set()
            answered = load.result(timeout=180)
        stopped = time.monotonic() - start
        wait_for(lambda: replicas_running(1), 150, "back to one replica after the load")
        scaled_down = time.monotonic() - start
        print(f"autoscaling: 2 replicas {scaled_up:.0f} s into the load, load stopped at {stopped:.0f} s "
              f"({answered} requests), 1 replica again at {scaled_down:.0f} s; timeline {timeline}")
        assert answered > 0 and not failures, failures[:3]
        body = {"prompt": "a", "max_new_tokens": 4}
        assert requests.post(url + "/v1/generate", json=body, timeout=60).status_code == 200
    finally:
        stop.set()
        _shutdown(head)
