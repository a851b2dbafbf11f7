"""The only place that builds TorchTrainer, ScalingConfig, RunConfig and datasets.

>>> import raytrain_platform as rtp                                   # doctest: +SKIP
>>> result = rtp.train("pipelines/configs/quickstart.yaml")           # doctest: +SKIP
>>> result.run_dir, result.metrics[-1]["val_perplexity"]              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from raytrain_platform.compat.ray_private import JOB_CONFIG_ENV
from raytrain_platform.config import JobConfig, load_config
from raytrain_platform.plan.auto import Hardware, cpu_hardware, has_auto
from raytrain_platform.parallel.dims import ParallelDims
from raytrain_platform.resolve import ResolvedJob, resolve_job
from raytrain_platform.core.rundir import (CONFIG_FILE, SUMMARY_FILE, best_checkpoint, check_storage,
                                      latest_checkpoint, plot_run, prune_checkpoints, read_metrics,
                                      write_json)
from raytrain_platform.core.rundir import METRICS_FILE, PLOT_FILE, TRACKING_FILE
from raytrain_platform.tracking.runs import open_training_run

__all__ = ["TrainResult", "train", "run_job", "prepare", "init_ray", "cluster_hardware", "format_progress",
           "temporary_env"]

_RAY_ENV = {
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    # The Train controller polls its workers every 2 s by default, and each start-up and
    # the end of a run wait for a poll: 0.5 s takes ~4 s off a short run (measured on a
    # 2-worker run here, 37 -> 32 s median); a poll is one small RPC per worker.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}


@dataclass
class TrainResult:
    run_dir: Path
    metrics: list[dict]  # every reported step, as in metrics.jsonl
    checkpoint: Path | None  # the latest checkpoint
    best_checkpoint: Path | None  # lowest val_loss among those kept
    summary: dict = field(default_factory=dict)

    @property
    def final(self) -> dict:
        return self.metrics[-1] if self.metrics else {}


def prepare(config: Any, overrides: list[str] | None = None,
            hardware: "Hardware | None" = None) -> ResolvedJob:
    """Load, validate and resolve: everything that can fail before Ray starts. ``auto``
    fields are decided on `hardware` (default: this machine; see `cluster_hardware`)."""
    cfg = load_config(config, overrides)
    # Ray workers and Ray Data tasks do not share the driver's working directory:
    # local paths are made absolute here, URIs are left as they are.
    local_paths = {"run.storage_path": cfg.run.storage_path, "data.path": cfg.data.path,
                   "data.val_path": cfg.data.val_path}
    cfg = cfg.replace({key: os.path.abspath(os.path.expanduser(value))
                       for key, value in local_paths.items() if value and "://" not in value})
    check_storage(cfg.run.storage_path)
    _warn_if_inside_the_jobs_copy(cfg.run.storage_path)
    return resolve_job(cfg, hardware)


_WARNED: set[str] = set()


def _warn_if_inside_the_jobs_copy(storage_path: str) -> None:
    """A submitted job runs in Ray's copy of its ``--working-dir``, deleted with the job's
    files and renamed whenever the code changes: run directories there are lost, and a
    rerun does not resume. Said once, on stderr; the run goes on (a test may want it)."""
    if "://" in storage_path or storage_path in _WARNED or not _submitted_runtime_env().get("working_dir"):
        return
    if Path(storage_path).resolve().is_relative_to(Path.cwd().resolve()):
        _WARNED.add(storage_path)  # a sweep prepares each trial's config: once is enough
        print(f"warning: run.storage_path = {storage_path!r} is inside this job's copy of its working_dir, "
              "which Ray deletes: set run.storage_path to shared storage", file=sys.stderr, flush=True)


def format_progress(m: dict, total: int) -> str:
    parts = [f"step {m['step']:>5}/{total}", f"epoch {m['epoch']}", f"loss {m['loss']:.4f}"]
    if "aux_loss" in m:  # a mixture of experts' router load-balancing loss (unweighted)
        parts.append(f"aux_loss {m['aux_loss']:.4f}")
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f}")
        if "val_perplexity" in m:
            parts.append(f"val_ppl {m['val_perplexity']:.2f}")
        elif "val_accuracy" in m:
            parts.append(f"val_acc {m['val_accuracy']:.3f}")
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
    parts += [f"{m['samples_per_s']:,.1f} samples/s", f"data wait {100 * m['data_wait_frac']:.1f}%",
              f"lr {m['lr']:.2e}"]
    return " | ".join(parts)


# Ray lowers every worker process to nice 15 so that its own daemons stay responsive.
# The training workers are the job: run them at normal priority, ahead of Ray Data's
# read tasks (still at 15), so ingest uses CPU the step leaves idle rather than taking
# turns with it (benchmarks/train_vs_loop.py measures the effect).
_TRAIN_WORKER_ENV = {"RAY_worker_niceness": "0"}
DRIVER_ENV = dict(_RAY_ENV)  # the driver's own (its count pass tokenizes on every core)
# Every process of the job. A read task that tokenizes does it on its one CPU: a fast
# tokenizer would spread each batch of documents over every core, beside the workers.
JOB_ENV = {**_RAY_ENV, "TOKENIZERS_PARALLELISM": "false"}


def _cache_env() -> dict[str, str]:
    """The driver's token cache folder (`data/token_cache.py`, ``RTP_CACHE_DIR``; absolute, as
    Ray's processes start elsewhere; empty: none) and its limit (``RTP_CACHE_MAX_SIZE``)
    for the job's processes, where it set them: read tasks find the windows its count
    pass kept, and keep the cache within the same limit."""
    from raytrain_platform.data.token_cache import CACHE_ENV, MAX_SIZE_ENV

    value, limit = os.environ.get(CACHE_ENV), os.environ.get(MAX_SIZE_ENV)
    return {**({} if value is None else {CACHE_ENV: os.path.abspath(value) if value else ""}),
            **({} if limit is None else {MAX_SIZE_ENV: limit})}


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
    `JOB_ENV`) and the token cache's, less any a submitted job's own runtime_env sets
    (Ray refuses a driver's runtime_env that sets one of them again; the user's value
    stands)."""
    ours = {**(JOB_ENV if env_vars is None else env_vars), **_cache_env()}
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


def _check_cpu_headroom(cfg: JobConfig) -> None:
    """Training workers that take every CPU leave none for Ray Data's read tasks, and
    the run hangs waiting for its first batch: refuse that up front."""
    import ray

    from raytrain_platform.errors import ConfigError

    total = ray.cluster_resources().get("CPU", 0.0)
    # An elastic run starts with what there is, from min_workers up.
    lo = cfg.scaling.min_workers
    workers = lo if cfg.scaling.elastic and lo is not None else cfg.scaling.num_workers
    need = workers * cfg.scaling.cpus_per_worker
    if total and need > total - 0.5:
        raise ConfigError("scaling.cpus_per_worker", cfg.scaling.cpus_per_worker,
                          f"a value with {'min_workers' if cfg.scaling.elastic else 'num_workers'} "
                          f"({workers}) x cpus_per_worker "
                          f"<= {total - 0.5:g}: the cluster has {total:g} CPUs and Ray Data "
                          "needs at least 0.5 of them to feed the workers")


def _tp_label_selector(cfg: JobConfig, per_worker: dict[str, float],
                       emit: Callable[[str], None]) -> list[dict[str, str]] | None:
    """Pin whole tensor-parallel groups to nodes (launch/placement.py) from the free
    resources of the cluster's alive nodes now, counting only the workers' own demand:
    what stays free on a node is Ray Data's and the Train controller's (0 CPUs).
    Elastic runs never get here with TP: config validation refuses elastic TP, and a
    pinned node that is lost would keep an elastic run from shrinking."""
    tp_size = cfg.parallel.tp_size
    if tp_size == 1:
        return None
    import ray
    from raytrain_platform.compat.ray_private import available_resources_per_node

    from raytrain_platform.launch.placement import describe_tp_placement, place_tp_groups

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    free = {node: res for node, res in available_resources_per_node().items() if node in alive}
    selectors = place_tp_groups(free, per_worker, num_workers=cfg.scaling.num_workers, tp_size=tp_size,
                                strategy=cfg.scaling.placement_strategy)
    if selectors:
        emit(describe_tp_placement(selectors, tp_size=tp_size))
    return selectors


def _build_trainer(job: ResolvedJob, resume_from: Path | None, callbacks: Sequence[Any] = (),
                   profile: dict | None = None, *, emit: Callable[[str], None]):
    """`callbacks`: Ray Train ``UserCallback``s for the RunConfig (a sweep trial passes
    its Tune reporting callback). `profile`: see `run_job`. `emit`: where the TP
    placement line goes."""
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_platform.core.dist import process_group_backend
    from raytrain_platform.data.ray_data import build_datasets, ingest_options
    from raytrain_platform.launch.worker import train_loop_per_worker

    cfg = job.config
    _check_cpu_headroom(cfg)
    datasets = build_datasets(cfg, job.data)
    for ds in datasets.values():
        ds.context.enable_progress_bars = False
    s = cfg.scaling
    per_worker = {"CPU": s.cpus_per_worker, **({"GPU": 1.0} if s.use_gpu else {})}
    lo = s.min_workers  # elastic: Ray starts with what there is, from min_workers up
    workers = (lo, s.num_workers) if s.elastic and lo is not None else s.num_workers
    # mypy sees Ray Train v1's configs (ray.train exports v2, the default, at run time):
    # v1 has no worker range, label_selector or worker_runtime_env.
    scaling = ScalingConfig(num_workers=workers,  # type: ignore[call-arg, arg-type]
                            use_gpu=s.use_gpu, placement_strategy=s.placement_strategy,
                            resources_per_worker=per_worker,
                            label_selector=_tp_label_selector(cfg, per_worker, emit))
    run_config = RunConfig(  # type: ignore[call-arg]
        name=cfg.run.name, storage_path=cfg.run.storage_path,
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
        failure_config=FailureConfig(max_failures=cfg.run.max_failures),
        callbacks=list(callbacks),
        worker_runtime_env={"env_vars": {**_RAY_ENV, **_TRAIN_WORKER_ENV, **_cache_env()}})
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"job": job.to_dict(),
                           "resume_from": str(resume_from) if resume_from else None,
                           "profile": profile},
        scaling_config=scaling,
        run_config=run_config,
        torch_config=TorchConfig(backend=process_group_backend(use_gpu=cfg.scaling.use_gpu,
                                                               cpu_offload=cfg.parallel.cpu_offload)),
        datasets=datasets,  # type: ignore[arg-type]  # Ray annotates an invariant Dict[str, GenDataset]
        dataset_config=DataConfig(
            # TP/PP: unsplit, each rank strides over data-parallel ranks (launch/worker.py).
            datasets_to_split=["train"] if cfg.data.split_across_workers
            and not ParallelDims.from_config(cfg).model_parallel else [],
            execution_options=ingest_options()),
    )


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _progress_poller(run_dir: Path, total: int, emit: Callable[[str], None],
                     resume_step: int = 0) -> Callable[[], None]:
    """Each call echoes metrics.jsonl's new reports. A (re)started worker rewrites the
    file without the lines past its checkpoint (core/rundir.py `MetricsLog`, a new file)
    and logs those steps again: what follows the lines the file still shares with the
    last read is printed. The lines an earlier attempt left past `resume_step` are never
    printed: they are skipped until the file is rewritten, so the poller is made before
    any worker starts."""
    path = run_dir / METRICS_FILE
    stale_file = _inode(path)  # a first attempt killed before its first checkpoint left lines too
    shown = [m for m in read_metrics(run_dir) if m.get("step", 0) <= resume_step]

    def poll() -> None:
        nonlocal stale_file, shown
        inode = _inode(path)  # before the read: a read after the rewrite sees the new file
        rows = read_metrics(run_dir)
        if inode == stale_file:  # not rewritten yet
            rows = [m for m in rows if m.get("step", 0) <= resume_step]
        else:
            stale_file = None  # a later file may get the old inode number
        kept = len(shown)  # appended to since the last read, the usual case
        if len(rows) < kept or (shown and rows[kept - 1] != shown[-1]):  # rewritten
            kept = next((i for i, (a, b) in enumerate(zip(rows, shown)) if a != b),
                        min(len(rows), len(shown)))
        for m in rows[kept:]:
            emit(format_progress(m, total))
        shown = rows

    return poll


def _tail_progress(poll: Callable[[], None], stop: threading.Event) -> None:
    while True:
        poll()
        if stop.is_set():
            return
        stop.wait(0.5)


def train(config: Any, overrides: list[str] | None = None, *, address: str | None = None,
          verbose: bool = False, progress: bool = True) -> TrainResult:
    """Train from a YAML path, a dict or a `JobConfig` on an embedded local Ray (default)
    or the cluster at `address` / ``RAY_ADDRESS``. Rerunning the same ``run.name`` in the
    same storage resumes from its latest checkpoint."""
    emit = (lambda line: print(line, flush=True)) if progress else (lambda line: None)
    cfg = load_config(config, overrides)
    check_storage(os.path.expanduser(cfg.run.storage_path))  # before Ray starts, `auto` or not
    if has_auto(cfg):  # decided against the cluster it will run on
        init_ray(address, verbose)
        job = prepare(cfg, hardware=cluster_hardware(cfg))
    else:
        job = prepare(cfg)
        init_ray(address, verbose)
    emit(job.config.summary())
    for note in (*job.notes, *job.warnings):
        emit(note)
    return run_job(job, emit=emit)


def _gpu_memory() -> tuple[int, str]:
    import torch

    return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)


def cluster_hardware(cfg: JobConfig) -> Hardware:
    """What the job's workers will have on the connected Ray cluster: one GPU each
    (its memory measured by a task on a GPU node), or CPU memory per worker."""
    import ray

    from raytrain_platform.errors import ConfigError

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    n = cfg.scaling.num_workers
    if cfg.scaling.use_gpu:
        per_node = max(int(r.get("GPU", 0)) for r in nodes)
        if per_node == 0:
            raise ConfigError("scaling.use_gpu", True, "false on this cluster: it has no GPUs")
        mem, name = ray.get(ray.remote(num_gpus=1, num_cpus=0)(_gpu_memory).remote())
        return Hardware.for_workers(n, per_node, device_memory=mem, headroom=0.1,
                                    source=f"{name}, {mem / 2**30:.1f} GiB")
    per_node = max(int(r.get("CPU", 0) // cfg.scaling.cpus_per_worker) for r in nodes)
    node_memory = max(int(r.get("memory", 0)) for r in nodes)
    return cpu_hardware(cfg, node_memory=node_memory, workers_per_node=per_node)


def run_job(job: ResolvedJob, *, emit: Callable[[str], None], callbacks: Sequence[Any] = (),
            tail: bool = True, profile: dict | None = None,
            sweep_trial: dict[str, Any] | None = None) -> TrainResult:
    """Run one prepared job on the Ray this process is connected to, resuming from its
    run directory's latest checkpoint; `train`, each sweep trial and `rtp doctor` call it.
    `tail`: echo metrics.jsonl through `emit` while it trains. `profile`
    (``{"measure_from": step, "breakdown_from": step}``, from the doctor) records per-step
    timings and sample ids into the run directory's ``profile.json`` (core/profile.py).
    `sweep_trial`: a sweep trial's MLflow parent run and swept values (tracking/runs.py)."""
    cfg = job.config
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(cfg.to_yaml())
    resumed, resume_step = latest_checkpoint(run_dir), 0
    if resumed:
        # A LoRA checkpoint over another base (or LoRA on/off) is one line before any worker starts.
        from raytrain_platform.core.adapters import check_base, run_base
        from raytrain_platform.core.checkpoint import read_state, split_changed_warning

        state = read_state(resumed)
        check_base(str(resumed), state.get("base"), run_base(cfg))
        resume_step = state["state"]["step"]
        emit(f"resuming from {resumed}")
        warning = split_changed_warning(resumed, state, cfg)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    tracked = open_training_run(cfg, state_file=run_dir / TRACKING_FILE, sweep_trial=sweep_trial)
    if tracked.active:
        emit(f"mlflow: run {tracked.run_id} in {tracked.uri}")
    with tracked.ending():  # the MLflow run ends FINISHED, or FAILED if this raises
        t0 = time.time()
        trainer = _build_trainer(job, resumed, callbacks, profile, emit=emit)
        stop = threading.Event()
        poll = _progress_poller(run_dir, job.total_steps, emit, resume_step)
        tailer = threading.Thread(target=_tail_progress, args=(poll, stop), daemon=True)
        if tail:
            tailer.start()
        try:
            trainer.fit()
        finally:
            stop.set()
            if tail:
                tailer.join()
        result = finish_run(run_dir, wall_time_s=time.time() - t0, emit=emit,
                            keep=cfg.run.keep_checkpoints)
        tracked.log_artifacts([run_dir / CONFIG_FILE, run_dir / PLOT_FILE, run_dir / SUMMARY_FILE])
        if cfg.run.log_checkpoints:
            tracked.log_artifacts([result.best_checkpoint or result.checkpoint], "checkpoints")
    return result


def finish_run(run_dir: Path, *, wall_time_s: float, emit: Callable[[str], None],
               keep: int) -> TrainResult:
    """Keep the newest `keep` checkpoints, write summary.json and plot.png."""
    # Ray prunes the checkpoints it tracks; one written just before a killed driver
    # recorded it is pruned here.
    prune_checkpoints(run_dir, keep)
    metrics = read_metrics(run_dir)
    latest, best = latest_checkpoint(run_dir), best_checkpoint(run_dir)
    final = metrics[-1] if metrics else {}
    from raytrain_platform.core.adapters import trainable_share  # imports torch: not at the driver's start

    summary = {"run_dir": str(run_dir), "steps": final.get("step", 0), "final": final,
               "wall_time_s": round(wall_time_s, 3), "latest_checkpoint": str(latest) if latest else None,
               "best_checkpoint": str(best) if best else None,
               **{k: final[k] for k in ("num_params", "trainable_params") if k in final}}
    write_json(run_dir / SUMMARY_FILE, summary)
    plot = plot_run(run_dir, metrics)
    emit(f"done: {final.get('step', 0)} steps in {wall_time_s:.1f}s{trainable_share(final)}; run dir {run_dir}"
         + (f"; plot {plot}" if plot else ""))
    return TrainResult(run_dir=run_dir, metrics=metrics, checkpoint=latest, best_checkpoint=best,
                       summary=summary)
