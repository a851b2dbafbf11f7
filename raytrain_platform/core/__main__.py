"""The training core without Ray, under plain torchrun (or one plain process):

    torchrun --nproc-per-node 2 -m raytrain_platform.core --config CONFIG [--set KEY=VALUE ...]

Same config, model, strategy, data order and sharding rule as a Ray run; the
run directory gets metrics.jsonl and checkpoints. Used for GPU benchmarks on
machines where Ray is not installed.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch

from raytrain_platform.config import add_set_flag, load_config
from raytrain_platform.core.dist import barrier, init_torchrun
from raytrain_platform.core.adapters import trainable_share
from raytrain_platform.core.checkpoint import read_state, split_changed_warning
from raytrain_platform.core.engine import run_training
from raytrain_platform.data.local import LocalBatches
from raytrain_platform.errors import NonFiniteError, OneLineParser, UserError
from raytrain_platform.parallel.dims import ParallelDims
from raytrain_platform.resolve import resolve_job
from raytrain_platform.core.rundir import CONFIG_FILE, checkpoint_name, latest_checkpoint, prune_checkpoints
from raytrain_platform.core.rundir import TRACKING_FILE
from raytrain_platform.tracking import TrackedRun, open_training_run


class LocalReporter:
    """Checkpoints straight into the run directory; keeps the newest `keep`."""

    def __init__(self, run_dir: Path, keep: int, is_rank0: bool):
        self.run_dir, self.keep, self.is_rank0 = run_dir, keep, is_rank0

    def report(self, metrics, save) -> None:
        if save is None:
            return
        target = self.run_dir / checkpoint_name(metrics["step"])
        save(str(target))
        barrier()
        if self.is_rank0:
            prune_checkpoints(self.run_dir, self.keep)
            print(f"step {metrics['step']}: loss {metrics['loss']:.4f}, checkpoint {target}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m raytrain_platform.core")
    p.add_argument("--config", required=True)
    add_set_flag(p)
    args = p.parse_args(argv)
    try:
        # The worker count is torchrun's, set before validation (tp/pp sizes must divide it).
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg = load_config(args.config, [*args.overrides, f"scaling.num_workers={world}"])
        cfg = cfg.replace({"run.storage_path": os.path.abspath(cfg.run.storage_path)})
        job = resolve_job(cfg)
    except UserError as exc:
        # Every rank of a node read the same config and found the same error: its first
        # local rank says it (one line per node, not one per rank) and exits 2. The others
        # exit 2 a moment later, so that torchrun, which stops the rest once one rank
        # exits, never stops the first before it has said it.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr, flush=True)
        else:
            time.sleep(2.0)
        return 2
    if os.environ.get("RANK", "0") == "0":  # said once, by the first rank
        for said in job.warnings:
            print(said, file=sys.stderr, flush=True)
    torch.set_num_threads(cfg.scaling.torch_threads or max(1, math.floor(cfg.scaling.cpus_per_worker)))
    env = init_torchrun(use_gpu=cfg.scaling.use_gpu, cpu_offload=cfg.parallel.cpu_offload)
    run_dir = Path(cfg.run.run_dir)
    tracked = TrackedRun()  # run.tracking: mlflow; rank 0 opens it (its trackers read the run id)
    if env.is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(cfg.to_yaml())
        tracked = open_training_run(cfg, state_file=run_dir / TRACKING_FILE)
    barrier()
    resume = latest_checkpoint(run_dir)
    warning = split_changed_warning(resume, read_state(resume), cfg) if resume and env.is_rank0 else None
    if warning:
        print(warning, file=sys.stderr, flush=True)
    dims = ParallelDims.from_config(cfg)  # data-parallel coordinates: TP/PP groups share batches
    source = LocalBatches(job, rank=dims.data_rank(env.rank), world_size=dims.dp)
    try:
        final = run_training(job, env, source=source,
                             reporter=LocalReporter(run_dir, cfg.run.keep_checkpoints, env.is_rank0),
                             resume_dir=str(resume) if resume else None, run_dir=str(run_dir))
    except NonFiniteError as exc:  # a diverged run: one line (every rank raised it; rank 0 says it)
        tracked.finish("FAILED")
        if env.is_rank0:
            print(f"error: train failed: NonFiniteError: {exc}", file=sys.stderr)
        return 1
    except UserError as exc:  # bad input found on a rank (its model folder, its data): one line
        tracked.finish("FAILED")
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tracked.log_artifacts([run_dir / CONFIG_FILE])
    tracked.finish()
    if env.is_rank0:
        print(f"done: {final.get('step', 0)} steps, final loss {final.get('loss', float('nan')):.4f}"
              f"{trainable_share(final)}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
