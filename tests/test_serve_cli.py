"""`rtp serve` end to end: it binds 127.0.0.1, prints its URL, serves until SIGINT
(Ctrl-C), then shuts Serve and its embedded Ray down and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from conftest import ROOT, free_port
from test_serve import _rows, _train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} within {timeout} s; output: {''.join(seen)[-2000:]}")


def test_rtp_serve_prints_its_url_serves_and_stops_cleanly_on_ctrl_c(tmp_path):
    run_dir = _train(tmp_path / "runs", "clf")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_platform", "serve", f"tab={run_dir}",
                             "--port", str(port), "--max-batch-size", "4"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = _wait_for_line(proc, "serving", 180)
        url = f"http://127.0.0.1:{port}"
        assert f"serving tab at {url}" in line
        assert requests.get(url + "/healthz", timeout=30).json()["models"] == ["tab"]
        r = requests.post(url + "/v1/predict", json={"rows": _rows(3)}, timeout=30)
        assert r.status_code == 200 and len(r.json()["predictions"]) == 3
        proc.send_signal(signal.SIGINT)
        _wait_for_line(proc, "stopped", 90)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/healthz", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.extended  # ~40 s; the OpenAI API with the openai client is in test_serve_openai's default run
def test_rtp_serve_answers_the_openai_client_for_a_hugging_face_directory(tmp_path, tiny):
    """`rtp serve DIR` on a Hugging Face folder (what `rtp export --format hf` writes, or
    a downloaded checkpoint): the official `openai` client chats with it, then Ctrl-C."""
    import openai

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_platform", "serve", f"tiny={tiny['model']}",
                             "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    try:
        _wait_for_line(proc, "serving", 180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chat = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "What is a list?"}])
        assert chat.usage.completion_tokens >= 1 and chat.choices[0].message.role == "assistant"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=2)
        proc.send_signal(signal.SIGINT)
        _wait_for_line(proc, "stopped", 90)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
