"""The only place that builds TorchTrainer, ScalingConfig, RunConfig and datasets: a job
prepared (validated and resolved before Ray starts), run on the Ray this process is
connected to (launch/session.py), its progress echoed (launch/progress.py), its run
directory finished. launch/resources.py reads what the cluster has.

>>> import raytrain_platform as rtp                                   # doctest: +SKIP
>>> result = rtp.train("pipelines/configs/quickstart.yaml")           # doctest: +SKIP
>>> result.run_dir, result.metrics[-1]["val_perplexity"]              # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from raytrain_platform.config import load_config
from raytrain_platform.launch.progress import progress_poller, tail_progress
from raytrain_platform.launch.resources import check_cpu_headroom, cluster_hardware, tp_label_selector
from raytrain_platform.launch.session import (RAY_ENV, TRAIN_WORKER_ENV, init_ray,
                                              warn_if_inside_the_jobs_copy)
from raytrain_platform.plan.auto import Hardware, has_auto
from raytrain_platform.parallel.dims import ParallelDims
from raytrain_platform.resolve import ResolvedJob, resolve_job
from raytrain_platform.core.rundir import (CONFIG_FILE, SUMMARY_FILE, best_checkpoint, check_storage,
                                      latest_checkpoint, plot_run, prune_checkpoints, read_metrics,
                                      write_json)
from raytrain_platform.core.rundir import PLOT_FILE, TRACKING_FILE
from raytrain_platform.evaluation.after_training import (absolute_eval_paths, check_run_eval,
                                                         evaluate_after_training)
from raytrain_platform.tracking.runs import open_training_run

__all__ = ["TrainResult", "finish_run", "prepare", "run_job", "train"]

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
            hardware: "Hardware | None" = None, *, start_ray: Callable[[], None] | None = None) -> ResolvedJob:
    """Load, validate and resolve: everything that can fail before Ray starts. ``auto``
    fields are decided on `hardware` (default: this machine; see `cluster_hardware`).
    A tokenized source not tokenized before is tokenized on Ray, which `start_ray`
    starts (or connects to) once every other check has passed; without it, on the Ray
    this process is connected to, else here (data/tokenize_pass.py)."""
    cfg = load_config(config, overrides)
    # Ray workers and Ray Data tasks do not share the driver's working directory:
    # local paths are made absolute here, URIs are left as they are.
    local_paths = {"run.storage_path": cfg.run.storage_path, "data.path": cfg.data.path,
                   "data.val_path": cfg.data.val_path}
    cfg = cfg.replace({key: os.path.abspath(os.path.expanduser(value))
                       for key, value in local_paths.items() if value and "://" not in value})
    check_storage(cfg.run.storage_path)
    warn_if_inside_the_jobs_copy(cfg.run.storage_path)
    cfg = absolute_eval_paths(cfg)
    job = resolve_job(cfg, hardware, start_ray=start_ray)
    check_run_eval(job.config)  # run.eval_tasks: known tasks, their data read, an hf model
    return job


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
    check_cpu_headroom(cfg)
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
                            label_selector=tp_label_selector(cfg, per_worker, emit))
    run_config = RunConfig(  # type: ignore[call-arg]
        name=cfg.run.name, storage_path=cfg.run.storage_path,
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
        failure_config=FailureConfig(max_failures=cfg.run.max_failures),
        callbacks=list(callbacks),
        worker_runtime_env={"env_vars": {**RAY_ENV, **TRAIN_WORKER_ENV}})
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
    else:  # Ray starts once every check has passed (to tokenize, where the data needs it)
        job = prepare(cfg, start_ray=lambda: init_ray(address, verbose))
        init_ray(address, verbose)
    emit(job.config.summary())
    for note in (*job.notes, *job.warnings):
        emit(note)
    return run_job(job, emit=emit)


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
        poll = progress_poller(run_dir, job.total_steps, emit, resume_step)
        tailer = threading.Thread(target=tail_progress, args=(poll, stop), daemon=True)
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
        if cfg.run.eval_tasks and result.checkpoint is not None:
            evaluate_after_training(run_dir, cfg, tracked=tracked, emit=emit)
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
