"""Short measured runs of a config at 1, 2 (and more, when the cluster has room) workers,
each a real TorchTrainer run with step profiling on (core/profile.py), summarised as
`RunStats` for the checks.

A run is ``warmup + 2 x steps`` optimizer steps: warm-up (not recorded), ``steps`` normal
steps (throughput, data wait) and ``steps`` breakdown steps (the gradient all-reduce
timed on its own). Per-worker micro-batch and accumulation stay as configured (weak
scaling: the global batch grows with the workers, as it does when you add GPUs); with
``data.batch_size: auto`` the global batch stays and each run fits its own micro-batch.
Counts are multiples of one model replica's ranks (``tp_size x pp_size``).
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from typing import Callable

from raytrain_platform.config import JobConfig
from raytrain_platform.doctor.checks import RunStats
from raytrain_platform.errors import ConfigError

__all__ = ["check_requested_counts", "worker_counts", "measure_run", "summarise_profile"]


def check_requested_counts(cfg: JobConfig, requested: list[int] | None) -> None:
    """The part of `worker_counts`' check that needs only the config (no cluster): each
    requested count is a multiple of one model replica's ranks (tp x pp). Run before
    Ray starts."""
    unit = cfg.parallel.tp_size * cfg.parallel.pp_size
    for n in requested or ():
        if n % unit:
            raise ConfigError("--workers", n, f"a multiple of parallel.tp_size x pp_size ({unit})")


def worker_counts(cfg: JobConfig, cluster: dict[str, float], requested: list[int] | None) -> list[int]:
    """1, 2, then doubling while the cluster has room, up to max(2, scaling.num_workers),
    in units of one model replica's ranks (tp x pp); or the `requested` counts, checked
    against the cluster and the replica size."""
    unit = cfg.parallel.tp_size * cfg.parallel.pp_size
    per_worker = {"GPU": 1.0} if cfg.scaling.use_gpu else {"CPU": cfg.scaling.cpus_per_worker}
    reserve = {"CPU": 0.5}  # Ray Data's read tasks (see launch.resources.check_cpu_headroom)

    def fits(n: int) -> bool:
        return all(n * need + reserve.get(res, 0.0) <= cluster.get(res, 0.0)
                   for res, need in per_worker.items())

    if requested:
        check_requested_counts(cfg, requested)
        for n in requested:
            if not fits(n):
                raise ConfigError("--workers", n, f"a count the cluster has room for ({cluster.get('CPU', 0):g} "
                                  f"CPUs, {cluster.get('GPU', 0):g} GPUs; each worker needs "
                                  f"{per_worker}, plus 0.5 CPU for Ray Data)")
        return sorted(set(requested))
    counts, n = [], unit
    while n <= max(2 * unit, cfg.scaling.num_workers) and fits(n):
        counts.append(n)
        n *= 2
    if len(counts) < 2:
        raise ConfigError("scaling.cpus_per_worker" if not cfg.scaling.use_gpu else "scaling.use_gpu",
                          cfg.scaling.cpus_per_worker if not cfg.scaling.use_gpu else True,
                          f"room for {2 * unit} workers on this cluster ({cluster.get('CPU', 0):g} CPUs, "
                          f"{cluster.get('GPU', 0):g} GPUs): the doctor compares {unit} and {2 * unit}")
    return counts


def run_config(cfg: JobConfig, *, workers: int, total_steps: int, out_dir: Path) -> JobConfig:
    """The config of one measured run: `workers` workers, `total_steps` steps, no
    intermediate checkpoints or evaluations, its own run directory."""
    strategy = cfg.parallel.strategy
    if strategy == "none" and workers > 1:
        strategy = "ddp"
    # A global batch written beside an explicit micro-batch grows with the workers here.
    grows = {} if cfg.data.batch_size == "auto" else {"train.global_batch_size": None}
    return cfg.replace({**grows,
        "scaling.num_workers": workers, "parallel.strategy": strategy,
        "train.max_steps": total_steps, "train.epochs": None,
        "run.name": f"w{workers}", "run.storage_path": str(out_dir),
        "run.checkpoint_every": 0, "run.eval_every": 0, "run.log_every": total_steps,
        "run.keep_checkpoints": 1, "run.max_failures": 0,
        # Measurements, not experiments: no tracker's run, and no tracker's work in the steps.
        "run.tracking": [], "run.log_checkpoints": False})


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarise_profile(profile: dict, *, strategy: str) -> RunStats:
    """`profile.json` -> `RunStats`: medians per rank, then the slowest rank (a step
    ends when every rank has finished it)."""
    world = profile["world_size"]
    ranks = profile["ranks"]
    normal = [[s for s in r["steps"] if s["mode"] == "measure"] for r in ranks]
    apart = [[s for s in r["steps"] if s["mode"] == "breakdown"] for r in ranks]
    if not all(normal) or not all(apart):
        raise RuntimeError("the measured run recorded no steps: raise --steps")
    samples = normal[0][0]["samples"]  # per data-parallel replica per step
    step_normal = max(_median(rows, "step_s") for rows in normal)
    wait_frac = max(sum(s["data_wait_s"] for s in rows) / sum(s["step_s"] for s in rows) for rows in normal)
    slowest = max(apart, key=lambda rows: _median(rows, "step_s"))
    comm = None if slowest[0]["comm_s"] is None else _median(slowest, "comm_s")
    dup = profile["duplicates"]
    return RunStats(
        workers=world, strategy=strategy,
        samples_per_s=profile["data_parallel"] * samples / step_normal,
        data_wait_frac=wait_frac, step_s=_median(slowest, "step_s"),
        compute_s=_median(slowest, "compute_s"), comm_s=comm,
        optimizer_s=_median(slowest, "optimizer_s"), data_wait_s=_median(slowest, "data_wait_s"),
        batch_per_worker=samples, duplicate_samples=dup["on_several_ranks"],
        samples_checked=dup["samples"], duplicate_examples=dup["examples"])


def measure_run(cfg: JobConfig, *, workers: int, warmup: int, steps: int, out_dir: Path,
                emit: Callable[[str], None]) -> RunStats:
    """Train `cfg` at `workers` workers with profiling; its run directory is
    ``out_dir/w<workers>`` (replaced: a doctor run never resumes)."""
    from raytrain_platform.core.profile import PROFILE_FILE  # torch: imported once the checks have passed
    from raytrain_platform.launch.resources import cluster_hardware
    from raytrain_platform.launch.trainer import prepare, run_job
    from raytrain_platform.plan.auto import has_auto

    run_cfg = run_config(cfg, workers=workers, total_steps=warmup + 2 * steps, out_dir=out_dir)
    run_dir = Path(run_cfg.run.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    emit(f"doctor: {workers} worker(s), {run_cfg.parallel.strategy}: {warmup} warm-up + {steps} "
         f"measured + {steps} breakdown steps")
    hardware = cluster_hardware(run_cfg) if has_auto(run_cfg) else None  # `auto` fields: per count
    run_job(prepare(run_cfg, hardware=hardware), emit=lambda line: None, tail=False,
            profile={"measure_from": warmup, "breakdown_from": warmup + steps})
    path = run_dir / PROFILE_FILE
    if not path.is_file():
        raise RuntimeError(f"{path}: the measured run wrote no profile")
    return summarise_profile(json.loads(path.read_text()), strategy=run_cfg.parallel.strategy)
