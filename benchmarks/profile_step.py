"""CPU profile of quickstart training steps (torch.profiler): where a step's time goes.

    python benchmarks/profile_step.py            # writes benchmarks/profile.md (~1 min)
    python benchmarks/profile_step.py --smoke    # fewer steps, writes to a temporary file

The quickstart's job (`pipelines/configs/quickstart.yaml`: byte-level gpt, 2 blocks,
d 128, context 64, micro-batch 16, DDP over 2 ranks, 1 torch thread each), run by the
Ray-free core under torchrun (2 ranks, gloo) with its own data reader: the engine's
loop (`Engine.fit`) exactly as it trains, without Ray Data's threads. Rank 0 is
profiled over ``--active`` steps after ``--warmup`` steps; the engine's phases are
marked with `record_function` (``rtp::micro_step`` = forward + backward with DDP's
all-reduce hooks, ``rtp::optimizer_step`` = grad clip + the non-finite check's small
all-reduce (which also sums the step's loss and tokens for the metrics) + AdamW +
zero_grad, ``rtp::step_metrics`` = the metric dict, no collective, ``rtp::next_batch`` =
the reader) by wrapping the engine's methods in this script; the engine is unchanged.

Output: per-step wall time, the phases' share, and the top ops by self CPU time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import free_port  # noqa: E402

QUICKSTART = ROOT / "pipelines/configs/quickstart.yaml"
PHASES = ("rtp::next_batch", "rtp::micro_step", "rtp::optimizer_step", "rtp::step_metrics")


class _ProfilingReporter:
    """The engine reports every step (log_every 1): each report advances the profiler."""

    def __init__(self, prof):
        self.prof = prof

    def report(self, metrics, save) -> None:
        self.prof.step()


def _wrap(obj, name: str, label: str) -> None:
    import torch

    fn = getattr(obj, name)

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


class _MarkedSource:
    """The reader, each batch fetch marked (it runs inside the engine's loop)."""

    def __init__(self, source):
        self.source = source

    def train_epoch(self, epoch: int):
        import torch

        it = iter(self.source.train_epoch(epoch))
        while True:
            with torch.profiler.record_function("rtp::next_batch"):
                batch = next(it, None)
            if batch is None:
                return
            yield batch

    def val_batches(self, n: int):
        return self.source.val_batches(n)


def worker(out: Path, warmup: int, active: int) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from raytrain_platform.config import load_config
    from raytrain_platform.core.dist import init_torchrun
    from raytrain_platform.core.engine import Engine
    from raytrain_platform.data.local import LocalBatches
    from raytrain_platform.resolve import resolve_job

    world = int(os.environ["WORLD_SIZE"])
    steps = 1 + warmup + active + 1  # wait 1, warm up, record; the last (eval, checkpoint) not
    cfg = load_config(QUICKSTART, [f"scaling.num_workers={world}", f"train.max_steps={steps}",
                                   "run.eval_every=0", "run.checkpoint_every=0", "run.log_every=1",
                                   f"run.storage_path={out.parent}"])
    torch.set_num_threads(cfg.scaling.torch_threads or 1)
    env = init_torchrun(use_gpu=False)
    job = resolve_job(cfg)
    engine = Engine(job, env)
    for name, label in (("micro_step", PHASES[1]), ("optimizer_step", PHASES[2]),
                        ("_step_metrics", PHASES[3])):
        _wrap(engine, name, label)
    source = _MarkedSource(LocalBatches(job, rank=env.rank, world_size=env.world_size))
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=warmup, active=active, repeat=1),
                 record_shapes=False) as prof:
        t0 = time.perf_counter()
        final = engine.fit(source, _ProfilingReporter(prof))
        wall = time.perf_counter() - t0
    if env.is_rank0:
        out.write_text(_report(prof, active=active, steps=steps, wall=wall, final=final, world=world))
        print(f"wrote {out}")
    torch.distributed.destroy_process_group()
    return 0


def _report(prof, *, active: int, steps: int, wall: float, final: dict, world: int) -> str:
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events)  # us over the active steps
    step_us = total_self / active
    phases = {e.key: e.cpu_time_total / active for e in events if e.key in PHASES}
    lines = [
        "# CPU profile of a quickstart step", "",
        f"`python benchmarks/profile_step.py` ({time.strftime('%Y-%m-%d %H:%M')}, 1-minute load "
        f"average {os.getloadavg()[0]:.1f} on 2 cores shared with other jobs; torch.profiler, rank 0 "
        f"of {world} DDP ranks under torchrun, 1 torch thread each, {active} profiled steps after "
        f"warm-up; the whole {steps}-step run took {wall:.1f}s, the last step's "
        f"{final.get('tokens_per_s', 0):,.0f} tokens/s over both ranks).", "",
        f"Profiled CPU time per step (rank 0, all ops' self time): **{step_us / 1000:.1f} ms**.", "",
        "| phase (record_function around the engine's method) | ms per step | share |", "|---|---:|---:|"]
    for key in PHASES:
        if key in phases:
            lines.append(f"| `{key}` | {phases[key] / 1000:.2f} | {100 * phases[key] / step_us:.0f}% |")
    lines += ["", "Top ops by self CPU time (per step; `rtp::*` rows are the phases above, their self "
              "time is the Python between ops):", "",
              "| op | self CPU ms per step | share | calls per step |", "|---|---:|---:|---:|"]
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    for e in top:
        lines.append(f"| `{e.key}` | {e.self_cpu_time_total / active / 1000:.3f} | "
                     f"{100 * e.self_cpu_time_total / total_self:.1f}% | {e.count / active:g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="2 profiled steps; output to a temporary file")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/profile.md")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--active", type=int, default=20)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.active = 1, 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="rtp-profile-")) / "profile.md" if args.smoke
                       else ROOT / "benchmarks" / "profile.md")
    if args.worker:
        return worker(out, args.warmup, args.active)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(Path(__file__).resolve()), "--worker",
           "--out", str(out), "--warmup", str(args.warmup), "--active", str(args.active)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode == 0:
        print(out.read_text())
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
