"""The per-worker function Ray Train calls: the only place on the worker side that
touches ``ray.train``. It converts the dict to typed config once, wraps the
dataset shard as a `BatchSource`, and hands over to the Ray-free engine."""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

from raytrain_platform.core.dist import DistEnv
from raytrain_platform.core.engine import run_training
from raytrain_platform.data.dealing import deal, deal_eval, eval_micro_batches
from raytrain_platform.parallel.dims import ParallelDims
from raytrain_platform.core.profile import StepProfiler
from raytrain_platform.resolve import ResolvedJob
from raytrain_platform.core.rundir import checkpoint_name, write_json

__all__ = ["as_tensors", "train_loop_per_worker"]



def as_tensors(batch: dict) -> dict[str, torch.Tensor]:
    """A Ray Data numpy batch as the engine receives it: each column a tensor, zero-copy."""
    with warnings.catch_warnings():
        # Arrow-backed arrays are read-only; the engine never writes into a batch.
        warnings.simplefilter("ignore", UserWarning)
        return {k: torch.from_numpy(v) for k, v in batch.items()}


class RayBatches:
    """`BatchSource` over Ray Data: the train shard (split by Ray Train) and the
    unsplit validation set (each rank takes every world-th micro-batch)."""

    def __init__(self, job: ResolvedJob, env: DistEnv):
        import ray.train

        self.job, self.cfg, self.env = job, job.config, env
        # Data-parallel coordinates: with TP/PP the train set is not split by Ray Train;
        # every rank of a model replica reads it and keeps micro-batch j when
        # j % dp == its dp rank (the same rule as Ray's split, over dp ranks only).
        dims = ParallelDims.from_config(self.cfg)
        self.data_rank, self.data_world, self.model_parallel = (
            dims.data_rank(env.rank), dims.dp, dims.model_parallel)
        self.train_it = ray.train.get_dataset_shard("train")
        self.val_it = ray.train.get_dataset_shard("val") if job.data.num_val else None

    def _iter(self, it, *, shuffle_seed: int | None, drop_last: bool = True):
        """Micro-batches of `it`; shuffled locally with `data.shuffle_buffer` and
        `shuffle_seed`, in source order when that is None; the last, shorter one kept
        unless `drop_last`."""
        # numpy batches wrapped zero-copy here, not iter_torch_batches: its per-batch
        # Arrow -> tensor collate runs in Python threads that hold the GIL against the
        # training step (benchmarks/train_vs_loop.py measures the difference).
        d = self.cfg.data
        shuffle = d.shuffle_buffer if shuffle_seed is not None else 0
        batches = it.iter_batches(
            batch_size=d.micro_batch, batch_format="numpy", drop_last=drop_last,
            prefetch_batches=d.prefetch_batches, local_shuffle_buffer_size=shuffle or None,
            local_shuffle_seed=shuffle_seed if shuffle else None)
        return map(as_tensors, batches)

    def train_epoch(self, epoch: int):
        d = self.cfg.data
        seed = (d.shuffle_seed if d.shuffle_seed is not None else self.cfg.train.seed) + epoch
        if self.model_parallel:  # unsplit (split_across_workers false): every rank reads all
            world = self.data_world if d.split_across_workers else 1
            return deal(self._iter(self.train_it, shuffle_seed=seed), rank=self.data_rank % world,
                        world=world, rounds=self.job.data.num_train // (world * d.micro_batch))
        return self._iter(self.train_it, shuffle_seed=seed)

    def val_batches(self, n: int):
        # The same count on every rank (deal_eval pads a rank short of a round): under FSDP
        # every forward is a collective, and a rank with one batch more would wait for the
        # others forever. Ranks of one TP/PP group evaluate the same batches (their forwards
        # are collective). Never shuffled: each rank deals from the same order, so the
        # ranks' batches are disjoint and every evaluation sees the same samples. The last
        # micro-batch may be partial, except under a pipeline (its stages have fixed shapes).
        whole = self.cfg.parallel.pp_size > 1
        micro = eval_micro_batches(self.job.data.num_val, batch_size=self.cfg.data.micro_batch,
                                   world=self.data_world, most=n, whole=whole)
        return deal_eval(self._iter(self.val_it, shuffle_seed=None, drop_last=whole), rank=self.data_rank,
                         world=self.data_world, micro=micro)


class RayReporter:
    def report(self, metrics: dict, save: Callable[[str], None] | None) -> None:
        import ray.train

        if save is None:
            # Each ray.train.report() waits for the controller to take the previous one
            # (a queue of one, polled) and syncs the ranks: per step it costs more than a
            # small model's step. Per-step metrics already reach metrics.jsonl (rank 0);
            # Ray gets the evaluations and the checkpoints (the last step always has one).
            if "val_loss" in metrics:
                ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="rtp-ckpt-") as tmp:
            save(tmp)
            has_files = any(os.scandir(tmp))
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp) if has_files else None,
                checkpoint_dir_name=checkpoint_name(metrics["step"]))


def _warn_if_tp_spans_nodes(tp_size: int, local_world_size: int) -> None:
    """Ray Train numbers the workers of one node consecutively and a TP group is
    consecutive ranks: it stays on one node when the node's worker count is a multiple
    of tp_size. Otherwise its per-block all-reduces cross the network: say so. The
    launcher pins whole groups to nodes (launch/placement.py); this catches the runs it
    could not pin (and says so from where the group actually ran)."""
    if tp_size > 1 and local_world_size % tp_size:
        warnings.warn(f"this node runs {local_world_size} worker(s), not a multiple of "
                      f"parallel.tp_size ({tp_size}): a tensor-parallel group spans nodes and "
                      "its all-reduces use the inter-node network (slow); keep TP inside a node")


WORKERS_FILE = "workers.json"  # in the run directory: where each attempt's workers ran


def _record_workers(run_dir: str, env: DistEnv, job: ResolvedJob) -> None:
    """Append this attempt's workers (rank, node id, host, pid) to the run directory's
    workers.json: where a run's ranks were placed, and after a failure or an elastic
    restart, on how many workers it went on."""
    import socket
    import time

    import ray
    import torch.distributed as dist

    me = {"rank": env.rank, "node_id": ray.get_runtime_context().get_node_id(),
          "host": socket.gethostname(), "pid": os.getpid()}
    everyone: list[dict[str, object] | None] = [me]
    if dist.is_initialized() and env.world_size > 1:
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, me)
    if not env.is_rank0:
        return
    path = Path(run_dir) / WORKERS_FILE
    try:
        attempts = json.loads(path.read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        attempts = []
    s, t = job.config.scaling, job.config.train
    attempts.append({"time": time.time(), "world_size": env.world_size,
                     "grad_accum_steps": t.grad_accum_steps, "workers": everyone})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"attempts": attempts})
    if s.min_workers is not None or len(attempts) > 1:  # elastic, or restarted after a failure
        print(f"attempt {len(attempts)}: {env.world_size} worker(s), grad_accum_steps "
              f"{t.grad_accum_steps} (global batch {job.global_batch})", flush=True)


def train_loop_per_worker(loop_config: dict) -> None:
    import ray.train

    job = ResolvedJob.from_dict(loop_config["job"])
    cfg = job.config
    torch.set_num_threads(cfg.scaling.torch_threads or max(1, math.floor(cfg.scaling.cpus_per_worker)))
    env = DistEnv.current(use_gpu=cfg.scaling.use_gpu)
    if cfg.scaling.elastic:  # the worker count Ray got, with accumulation keeping the global batch
        job = job.at_world_size(env.world_size)
        cfg = job.config
    _record_workers(cfg.run.run_dir, env, job)
    _warn_if_tp_spans_nodes(cfg.parallel.tp_size, ray.train.get_context().get_local_world_size())
    checkpoint = ray.train.get_checkpoint()
    source, reporter = RayBatches(job, env), RayReporter()
    # Ray knows the checkpoints of this fit (after a worker failure) and those its
    # snapshot recorded; a driver killed right after a checkpoint was written leaves one
    # only the run directory knows: the driver found it and passes it. The newer wins
    # (names are checkpoint_<zero-padded step>).
    found = loop_config.get("resume_from")
    train = functools.partial(run_training, job, env, source=source, reporter=reporter,
                              run_dir=cfg.run.run_dir,
                              profiler=StepProfiler.from_dict(loop_config.get("profile")))
    if checkpoint is None or (found and Path(found).name > Path(checkpoint.path).name):
        train(resume_dir=found)
        return
    with checkpoint.as_directory() as resume_dir:
        train(resume_dir=resume_dir)
