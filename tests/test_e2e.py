"""End to end through processes: `rtp train` (driver, embedded Ray and workers) killed
with SIGKILL and rerun. `ray job submit` to a real multi-node cluster is
tests/test_cluster.py. Every process a test starts is stopped by its own process group
when the test ends."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, mlp_config, stop_group as _stop_group, torchrun_metrics, \
    wait_for as _wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parent


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


@pytest.mark.extended  # a failure test (SIGKILL mid-run, ~2-3 min): run with -m extended
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
