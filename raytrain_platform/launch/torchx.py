"""TorchX component: a platform config as a TorchX ``AppDef`` that runs the Ray-free
training core under torchrun, on any TorchX scheduler (local_cwd, kubernetes, slurm,
aws_batch, ...)::

    torchx run -s local_cwd raytrain_platform/launch/torchx.py:trainer \\
        --config pipelines/configs/quickstart.yaml -- run.storage_path=/tmp/runs

Options of the component come before ``--``; after it, ``KEY=VALUE`` overrides, the
same as ``--set`` elsewhere but without the flag (TorchX's CLI refuses a repeated option;
from Python, ``"--set"`` items among the overrides are skipped).
The config is loaded and validated here, before anything is submitted: a bad one is
the package's one-line ``ConfigError`` (under the ``torchx`` CLI: that line on stderr
and exit code 2).

Each replica (node) runs ``python -m torch.distributed.run ... -m raytrain_platform.core
--config CONFIG --set ...``; ``nnodes x nproc_per_node`` is the world size, which the
core uses as ``scaling.num_workers``. Under TorchX the config path is read twice: here
(on the machine that runs ``torchx``) and by the job (relative to the working directory,
the image's on remote schedulers), so both must see the same file.

TorchX loads a component file with ``exec`` into its own module namespace, and reads
argument types from the annotations: no ``from __future__ import annotations``, and
``Optional[...]`` rather than ``X | None`` (its linter reads only the former).
"""

import math
import os
import shlex
import sys

# The component's signature spells Optional/Dict/List: TorchX's linter reads only those.
from typing import Dict, List, Optional  # noqa: UP035

from torchx import specs
from torchx.specs import macros

from raytrain_platform.config import load_config
from raytrain_platform.errors import ConfigError

__all__ = ["DEFAULT_IMAGE", "trainer"]

# An image with this package installed (see cluster/README.md); local_cwd ignores it.
DEFAULT_IMAGE = "raytrain-platform:latest"
_MEM_MB_PER_PROCESS = 8192


def trainer(
    config: str,
    *overrides: str,
    nnodes: int = 1,
    nproc_per_node: Optional[int] = None,
    image: str = DEFAULT_IMAGE,
    python: str = "python",
    cpu: Optional[int] = None,
    gpu: Optional[int] = None,
    memMB: Optional[int] = None,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
    max_retries: int = 0,
    rdzv_port: int = 29500,
    name: Optional[str] = None,
) -> specs.AppDef:
    """Train a raytrain_platform config with the Ray-free core under torchrun.

    >>> app = trainer("pipelines/configs/quickstart.yaml", "run.storage_path=/mnt/shared/runs")
    >>> app.roles[0].num_replicas, app.roles[0].resource.gpu
    (1, 0)

    Args:
        config: path of the platform's YAML config (relative to the job's working directory)
        overrides: KEY=VALUE overrides of the config, like ``--set`` (e.g. train.lr=3e-4)
        nnodes: nodes (replicas of the role); one torchrun agent each
        nproc_per_node: processes per node (default: scaling.num_workers / nnodes)
        image: image with this package installed (ignored by local_cwd)
        python: the interpreter on the node that has this package installed
        cpu: CPUs per node (default: nproc_per_node x scaling.cpus_per_worker, rounded up)
        gpu: GPUs per node (default: nproc_per_node with scaling.use_gpu, else 0)
        memMB: memory per node in MiB (default: scaling.memory_budget or 8192 per process)
        h: a TorchX named resource; takes precedence over cpu, gpu and memMB
        env: extra environment variables (KEY=VALUE,KEY2=VALUE2)
        mounts: mounts for shared storage, e.g. type=volume,src=PVC_NAME,dst=/mnt/shared
        max_retries: scheduler retries; a retry resumes from the run's latest checkpoint
        rdzv_port: port of the c10d rendezvous on the first node (multi-node only)
        name: the app's name (default: rtp-RUN_NAME)
    """
    try:
        return _build_app(config, list(overrides), nnodes=nnodes, nproc_per_node=nproc_per_node,
                          image=image, python=python, cpu=cpu, gpu=gpu, memMB=memMB, h=h,
                          env=env, mounts=mounts, max_retries=max_retries,
                          rdzv_port=rdzv_port, name=name)
    except ConfigError as exc:
        if os.environ.get("TORCHX_CONTEXT_NAME", "").startswith("cli"):
            # Under the torchx CLI: one line and the platform's exit code for bad input,
            # not a traceback through TorchX's argument machinery.
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        raise


def _build_app(config: str, overrides: list[str], *, nnodes: int, nproc_per_node: int | None,
               image: str, python: str, cpu: int | None, gpu: int | None, memMB: int | None,
               h: str | None, env: dict[str, str] | None, mounts: list[str] | None,
               max_retries: int, rdzv_port: int, name: str | None) -> specs.AppDef:
    overrides = [o for o in overrides if o != "--set"]
    nnodes = _rtp_int("nnodes", nnodes, minimum=1)
    cfg = load_config(config, overrides)
    if nproc_per_node is None:
        workers = cfg.scaling.num_workers
        if workers % nnodes:
            raise ConfigError("nnodes", nnodes, f"a divisor of scaling.num_workers ({workers}), "
                              "or set nproc_per_node")
        nproc = workers // nnodes
    else:
        nproc = _rtp_int("nproc_per_node", nproc_per_node, minimum=1)
    # Validate as the core will run it: the world size is its scaling.num_workers
    # (strategy none needs 1, tp_size x pp_size must divide it).
    cfg = load_config(config, [*overrides, f"scaling.num_workers={nnodes * nproc}"])

    if gpu is None:
        gpu = nproc if cfg.scaling.use_gpu else 0
    if cpu is None:
        cpu = max(1, math.ceil(nproc * cfg.scaling.cpus_per_worker))
    if memMB is None:
        budget = cfg.scaling.memory_budget_bytes
        memMB = nproc * (budget // 2**20 if budget else _MEM_MB_PER_PROCESS)
    resource = specs.resource(cpu=_rtp_int("cpu", cpu, minimum=1),
                              gpu=_rtp_int("gpu", gpu, minimum=0),
                              memMB=_rtp_int("memMB", memMB, minimum=1), h=h)
    role = specs.Role(
        name="trainer",
        image=image,
        entrypoint="bash",
        args=["-c", _torchrun_command(python, config, overrides, nnodes=nnodes, nproc=nproc,
                                      rdzv_port=_rtp_int("rdzv_port", rdzv_port, minimum=0))],
        num_replicas=nnodes,
        resource=resource,
        env={"LOGLEVEL": "WARNING", "PYTHONUNBUFFERED": "1", **(env or {})},
        port_map={"c10d": rdzv_port},
        max_retries=_rtp_int("max_retries", max_retries, minimum=0),
        mounts=specs.parse_mounts(mounts) if mounts else [],
    )
    return specs.AppDef(name=name or f"rtp-{cfg.run.name}", roles=[role])


def _torchrun_command(python: str, config: str, overrides: list[str], *, nnodes: int,
                      nproc: int, rdzv_port: int) -> str:
    """The bash command each node runs; TorchX substitutes the ``${...}`` macros first."""
    if nnodes == 1:
        endpoint = "localhost:0"  # one agent: torchrun picks a free port
    else:
        # The scheduler names the first node's host in an env var (macros.rank0_env);
        # bash expands it. `$$` is TorchX's escape for a literal `$`.
        endpoint = f'"$${{{macros.rank0_env}:=localhost}}:{rdzv_port}"'
    head = [python, "-m", "torch.distributed.run", "--rdzv-backend", "c10d",
            "--rdzv-endpoint"]
    tail = ["--rdzv-id", macros.app_id, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--tee", "3", "-m", "raytrain_platform.core", "--config", config]
    for override in overrides:
        tail += ["--set", override]
    return " ".join([*map(shlex.quote, head), endpoint, *map(_quote_keep_macros, tail)])


def _quote_keep_macros(arg: str) -> str:
    # macros.app_id is substituted by TorchX before bash runs: leave it bare.
    return arg if arg == macros.app_id else shlex.quote(arg)


def _rtp_int(field: str, value: object, *, minimum: int) -> int:
    """TorchX passes ``Optional[int]`` options from its CLI as strings: parse them here."""
    try:
        number = int(str(value))
    except ValueError:
        raise ConfigError(field, value, f"an integer >= {minimum}") from None
    if number < minimum:
        raise ConfigError(field, value, f"an integer >= {minimum}")
    return number
