"""The Ray session a job runs in: the environment the driver and the job's processes
get, connecting to a cluster or starting a fresh embedded Ray, and what a submitted
job's own runtime_env says (``ray job submit``).

>>> temporary_env("RTP_EXAMPLE", "1").__class__.__name__
'_GeneratorContextManager'
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Iterator

from raytrain_platform.compat.ray_private import JOB_CONFIG_ENV

__all__ = ["DRIVER_ENV", "JOB_ENV", "RAY_ENV", "TRAIN_WORKER_ENV", "driver_runtime_env", "init_ray",
           "temporary_env", "warn_if_inside_the_jobs_copy"]

RAY_ENV = {
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    # The Train controller polls its workers every 2 s by default, and each start-up and
    # the end of a run wait for a poll: 0.5 s takes ~4 s off a short run (measured on a
    # 2-worker run here, 37 -> 32 s median); a poll is one small RPC per worker.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}


# Ray lowers every worker process to nice 15 so that its own daemons stay responsive.
# The training workers are the job: run them at normal priority, ahead of Ray Data's
# read tasks (still at 15), so ingest uses CPU the step leaves idle rather than taking
# turns with it (benchmarks/train_vs_loop.py measures the effect).
TRAIN_WORKER_ENV = {"RAY_worker_niceness": "0"}
DRIVER_ENV = dict(RAY_ENV)  # the driver's own
# Every process of the job. A task of the tokenizing pass works on its one CPU: a fast
# tokenizer would spread each batch of documents over every core, beside the workers.
JOB_ENV = {**RAY_ENV, "TOKENIZERS_PARALLELISM": "false"}


def init_ray(address: str | None, verbose: bool, *, env_vars: dict[str, str] | None = None) -> None:
    """Connect to `address` (or ``RAY_ADDRESS``), else start a fresh embedded Ray; no-op
    when connected. The job's processes get `env_vars` (default `JOB_ENV`: quiet logs;
    `rtp serve` passes its replicas' priority)."""
    import ray

    for k, v in DRIVER_ENV.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict = {"log_to_driver": verbose, "logging_level": "INFO" if verbose else "WARNING",
                    "runtime_env": driver_runtime_env(env_vars)}
    if address:
        ray.init(address=address, **kwargs)
    else:
        _start_embedded_ray(kwargs)


def driver_runtime_env(env_vars: dict[str, str] | None = None) -> dict:
    """The runtime_env `init_ray` gives the job's processes: `env_vars` (default
    `JOB_ENV`), less any a submitted job's own runtime_env sets
    (Ray refuses a driver's runtime_env that sets one of them again; the user's value
    stands)."""
    ours = dict(JOB_ENV if env_vars is None else env_vars)
    theirs = _submitted_env_vars()
    return {"env_vars": {k: v for k, v in ours.items() if k not in theirs}}


def _submitted_env_vars() -> set[str]:
    """The environment variables a submitted job's own runtime_env sets (``ray job submit
    --runtime-env-json '{"env_vars": {...}}'``; none outside a job): they already reach
    every process of the job, with the values the user chose."""
    env = _submitted_runtime_env().get("env_vars")
    return set(env) if isinstance(env, dict) else set()


def _submitted_runtime_env() -> dict:
    """A submitted job's runtime_env, as Ray hands it to the job's driver (empty outside
    a job, or where it is not a mapping: `ray.init` judges that)."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    try:
        env = (json.loads(raw) or {}).get("runtime_env") if raw else None
    except (ValueError, AttributeError):
        return {}
    return env if isinstance(env, dict) else {}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_embedded_ray(kwargs: dict) -> None:
    """A fresh embedded Ray ("local"), never a cluster left behind by `ray start` (Ray's
    own default would attach to the last one started on this machine), whose processes
    know its address. Ray Train's PlacementGroupCleaner actor asks the State API with no
    address: it guesses from the GCS processes running on the machine, and with another
    Ray instance beside this one (a test's, another user's) it fails with "Found multiple
    active Ray instances", its monitor thread dies, and the actor then neither cleans up a
    killed run's placement group nor exits (one idle worker process per run, until Ray
    stops). Choosing the GCS port up front lets every process of the job get
    ``RAY_ADDRESS`` for this instance; the driver's own environment is left as it was."""
    import ray

    for attempt in range(2):  # the port is free when chosen; another process may take it first
        port = _free_port()
        env_vars = {**kwargs["runtime_env"]["env_vars"], "RAY_ADDRESS": f"127.0.0.1:{port}"}
        try:
            with temporary_env("RAY_GCS_SERVER_PORT", str(port)):  # read by Ray when it starts the GCS
                ray.init(address="local", include_dashboard=False,
                         **{**kwargs, "runtime_env": {**kwargs["runtime_env"], "env_vars": env_vars}})
            return
        except Exception:
            if attempt or ray.is_initialized():
                raise


@contextlib.contextmanager
def temporary_env(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block, what it was (or nothing) after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


_WARNED: set[str] = set()


def warn_if_inside_the_jobs_copy(storage_path: str) -> None:
    """A submitted job runs in Ray's copy of its ``--working-dir``, deleted with the job's
    files and renamed whenever the code changes: run directories there are lost, and a
    rerun does not resume. Said once, on stderr; the run goes on (a test may want it)."""
    if "://" in storage_path or storage_path in _WARNED or not _submitted_runtime_env().get("working_dir"):
        return
    if Path(storage_path).resolve().is_relative_to(Path.cwd().resolve()):
        _WARNED.add(storage_path)  # a sweep prepares each trial's config: once is enough
        print(f"warning: run.storage_path = {storage_path!r} is inside this job's copy of its working_dir, "
              "which Ray deletes: set run.storage_path to shared storage", file=sys.stderr, flush=True)
