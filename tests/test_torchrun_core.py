"""The training core under plain torchrun, Ray not involved."""

import json
import subprocess
import sys

import yaml

from conftest import ROOT, mlp_config


def _run(tmp_path, name, nproc, **patch):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(mlp_config(tmp_path, name, **patch)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(29500 + nproc), "-m",
           "raytrain_platform.core", "--config", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def test_torchrun_ddp_matches_single_process(tmp_path):
    one = _run(tmp_path, "tr1", 1, data={"batch_size": 16})
    two = _run(tmp_path, "tr2", 2, data={"batch_size": 8}, parallel={"strategy": "ddp"})
    assert len(one) == 10 and one[-1] < one[0]
    assert all(abs(a - b) <= 1e-5 * abs(a) + 1e-6 for a, b in zip(one, two)), (one, two)
    assert (tmp_path / "tr2" / "checkpoint_000010" / "model.safetensors").exists()
