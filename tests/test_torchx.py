"""The TorchX component (raytrain_platform/launch/torchx.py): the AppDef it builds, a
real run through the `torchx` CLI on its local_cwd scheduler (2 torchrun processes,
10 steps), and bad input as one line."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torchx")

from torchx.specs import macros  # noqa: E402

from conftest import ROOT, mlp_config  # noqa: E402
from raytrain_platform.errors import ConfigError  # noqa: E402
from raytrain_platform.launch.torchx import trainer  # noqa: E402

COMPONENT = "raytrain_platform/launch/torchx.py:trainer"


def _write(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def _bash_argv(app) -> list[str]:
    """The command line a replica's bash runs, macros substituted as a scheduler would."""
    role = macros.Values(img_root="", app_id="app-1", replica_id="0",
                         rank0_env="TORCHX_RANK0_HOST").apply(app.roles[0])
    assert role.entrypoint == "bash" and role.args[0] == "-c"
    return shlex.split(role.args[1])


def _torchx(*args: str, cwd: Path = ROOT, timeout: int = 120) -> subprocess.CompletedProcess:
    # As with an activated venv: `python` on PATH is the one that has this package.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torchx.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_appdef_structure(tmp_path):
    cfg = mlp_config(tmp_path, "tx", parallel={"strategy": "ddp"},
                     scaling={"num_workers": 4, "cpus_per_worker": 2, "memory_budget": "1GiB"})
    path = _write(cfg, tmp_path / "c.yaml")

    app = trainer(str(path), "--set", "train.lr=0.01", "run.name=renamed", nnodes=2)
    assert app.name == "rtp-renamed"
    (role,) = app.roles
    assert role.num_replicas == 2
    # 4 workers over 2 nodes: 2 processes per node, 2 x 2 CPUs, 2 x 1 GiB, no GPU.
    assert (role.resource.cpu, role.resource.gpu, role.resource.memMB) == (4, 0, 2048)
    assert role.port_map == {"c10d": 29500}
    argv = _bash_argv(app)
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    opt = {argv[i]: argv[i + 1] for i in range(3, argv.index("-m", 3), 2)}
    assert opt["--nnodes"] == "2" and opt["--nproc-per-node"] == "2"
    assert opt["--rdzv-id"] == "app-1"
    # Multi-node: the first node's host comes from the scheduler's env var, expanded by bash.
    assert opt["--rdzv-endpoint"] == "${TORCHX_RANK0_HOST:=localhost}:29500"
    core = argv[argv.index("-m", 3):]
    assert core == ["-m", "raytrain_platform.core", "--config", str(path),
                    "--set", "train.lr=0.01", "--set", "run.name=renamed"]

    # One node: torchrun's free port; GPUs follow scaling.use_gpu, one per process.
    gpu_app = trainer(str(path), "scaling.use_gpu=true", nproc_per_node=4,
                      python="/opt/py/bin/python", image="example/rtp:1",
                      mounts=["type=volume", "src=rtp-shared", "dst=/mnt/shared"])
    (role,) = gpu_app.roles
    assert (role.num_replicas, role.resource.gpu, role.image) == (1, 4, "example/rtp:1")
    assert [(m.src, m.dst_path) for m in role.mounts] == [("rtp-shared", "/mnt/shared")]
    argv = _bash_argv(gpu_app)
    assert argv[0] == "/opt/py/bin/python" and "localhost:0" in argv

    named = trainer(str(path), h="gpu.small")  # a TorchX named resource wins over cpu/gpu/memMB
    assert named.roles[0].resource.gpu == 1


def test_bad_input_is_one_line(tmp_path):
    cfg = mlp_config(tmp_path, "bad", train={"lr": -1.0})
    path = _write(cfg, tmp_path / "bad.yaml")
    cases = [
        ((str(path),), {}, "train.lr = -1.0: expected"),
        ((str(tmp_path / "missing.yaml"),), {}, "config = "),
        ((str(path), "train.lr=0.1"), {"nproc_per_node": 2}, "parallel.strategy"),  # none needs 1
        ((str(path), "train.lr=0.1", "parallel.strategy=ddp", "scaling.num_workers=3"),
         {"nnodes": 2}, "nnodes = 2: expected a divisor of scaling.num_workers (3)"),
        ((str(path), "train.lr=0.1"), {"nnodes": 0}, "nnodes = 0: expected an integer >= 1"),
    ]
    for args, kwargs, expected in cases:
        with pytest.raises(ConfigError) as info:
            trainer(*args, **kwargs)
        assert expected in str(info.value) and "\n" not in str(info.value)

    # Through the torchx CLI: that line on stderr, exit code 2, no traceback.
    proc = _torchx("run", "-s", "local_cwd", "--dryrun", COMPONENT, "--config", str(path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: train.lr = -1.0: expected")
    assert "Traceback" not in proc.stderr


def test_local_cwd_run_trains(tmp_path):
    """`torchx run -s local_cwd` really trains: 2 DDP processes, 10 steps, metrics in
    the run directory; the override after `--` reaches the core."""
    cfg = mlp_config(tmp_path / "runs", "from-config", parallel={"strategy": "ddp"},
                     scaling={"num_workers": 2})
    path = _write(cfg, tmp_path / "mlp.yaml")
    proc = _torchx("run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx'}",
                   COMPONENT, "--config", str(path), "--", "run.name=torchx-mlp", timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    run_dir = tmp_path / "runs" / "torchx-mlp"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["loss"] > 0 for r in rows)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["scaling"]["num_workers"] == 2
    assert (run_dir / "checkpoint_000010").is_dir()
