"""What the doctor concludes from measured runs: the tutorial's pitfalls, each with its
evidence (the numbers that triggered it) and its fix. Pure functions over the
per-run summaries that `measure.py` builds; no Ray, no torch.

| pitfall (seed)                          | evidence                                        | fix                                   |
|-----------------------------------------|-------------------------------------------------|---------------------------------------|
| GPU idle because data loading is slow   | data wait > 20% of the step                     | prefetch, CPUs for Ray Data, format   |
| per-GPU batch too small                 | gradient all-reduce > 30% of the step (2+ ranks)| larger micro-batch or accumulation    |
| DDP without proper sharding             | a sample id trained on by two ranks in an epoch | split the dataset across workers      |
| adding GPUs without measuring           | scaling efficiency < 75%, no other cause found  | profile before scaling further        |

>>> run1 = RunStats(workers=1, samples_per_s=1000.0, data_wait_frac=0.01, step_s=0.01,
...                 compute_s=0.008, comm_s=0.0, optimizer_s=0.001, batch_per_worker=32)
>>> run2 = RunStats(workers=2, samples_per_s=1900.0, data_wait_frac=0.02, step_s=0.011,
...                 compute_s=0.008, comm_s=0.001, optimizer_s=0.001, batch_per_worker=32)
>>> diagnose([run1, run2])
[]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["RunStats", "Finding", "diagnose", "scaling_efficiency", "THRESHOLDS"]

THRESHOLDS = {
    "data_wait_frac": 0.20,  # of a normal step's wall time
    "comm_frac": 0.30,  # of a breakdown step's wall time, with 2 or more ranks
    "scaling_efficiency": 0.75,  # throughput(n) / (n x throughput(1))
}


@dataclass(frozen=True)
class RunStats:
    """One measured run, summarised (times are seconds per optimizer step, medians)."""

    workers: int
    samples_per_s: float  # normal steps
    data_wait_frac: float  # normal steps: data wait / step time, slowest rank
    step_s: float  # breakdown steps
    compute_s: float  # forward + backward
    comm_s: float | None  # gradient all-reduce; None when the strategy cannot time it apart
    optimizer_s: float
    batch_per_worker: int  # samples per optimizer step per worker
    data_wait_s: float = 0.0  # breakdown steps
    duplicate_samples: int = 0  # (epoch, id) pairs trained on by more than one rank
    samples_checked: int = 0
    duplicate_examples: list = field(default_factory=list)
    strategy: str = ""

    @property
    def other_s(self) -> float:
        """Step time outside the four phases (loop bookkeeping, waiting on a slower rank's
        schedule, the OS running something else); the phases are medians taken apart."""
        return max(0.0, self.step_s - self.data_wait_s - self.compute_s - (self.comm_s or 0.0)
                   - self.optimizer_s)

    @property
    def comm_frac(self) -> float | None:
        return None if self.comm_s is None or self.step_s <= 0 else self.comm_s / self.step_s

    def to_dict(self) -> dict:
        return {**asdict(self), "comm_frac": self.comm_frac, "other_s": self.other_s}


@dataclass(frozen=True)
class Finding:
    check: str  # data_loading | batch_too_small | duplicate_samples | sublinear_scaling
    title: str
    evidence: str
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


def scaling_efficiency(runs: list[RunStats]) -> dict[int, float]:
    """{workers: (throughput(n) / throughput(b)) / (n / b)} for every run beside the
    smallest one, b (1 worker, or one model replica's ranks under TP/PP)."""
    if not runs:
        return {}
    base = min(runs, key=lambda r: r.workers)
    if base.samples_per_s <= 0:
        return {}
    return {r.workers: r.samples_per_s * base.workers / (r.workers * base.samples_per_s)
            for r in runs if r.workers > base.workers}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _data_loading(runs: list[RunStats]) -> Finding | None:
    worst = max(runs, key=lambda r: r.data_wait_frac)
    if worst.data_wait_frac <= THRESHOLDS["data_wait_frac"]:
        return None
    return Finding(
        "data_loading", "training waits for data (pitfall: GPU idle because data loading is slow)",
        f"at {worst.workers} worker(s) the step spends {_pct(worst.data_wait_frac)} of its time "
        f"waiting for the next batch (threshold {_pct(THRESHOLDS['data_wait_frac'])}); "
        + ", ".join(f"{r.workers}w: {_pct(r.data_wait_frac)}" for r in runs),
        "raise data.prefetch_batches; leave Ray Data more CPUs (fewer scaling.cpus_per_worker, or "
        "more CPU nodes); store the data in a faster format (Parquet with large row groups rather "
        "than many small files) or closer to the workers")


def _batch_too_small(runs: list[RunStats]) -> Finding | None:
    # (gradient all-reduce share, run) for the multi-worker runs that timed it apart
    multi = [(frac, r) for r in runs if r.workers > 1 and (frac := r.comm_frac) is not None]
    if not multi:
        return None
    comm_frac, worst = max(multi, key=lambda fr: fr[0])
    if comm_frac <= THRESHOLDS["comm_frac"]:
        return None
    assert worst.comm_s is not None, "comm_frac is None when comm_s is"
    factor = max(2, round(comm_frac / (1 - comm_frac) * 4))
    return Finding(
        "batch_too_small", "per-worker batch too small: gradient communication dominates "
        "(pitfall: batch per GPU too small)",
        f"at {worst.workers} workers the gradient all-reduce takes {_pct(comm_frac)} of the "
        f"step ({1000 * worst.comm_s:.1f} ms of {1000 * worst.step_s:.1f} ms; forward+backward "
        f"{1000 * worst.compute_s:.1f} ms) with {worst.batch_per_worker} samples per worker per step",
        f"raise data.batch_size (about {factor}x, to {worst.batch_per_worker * factor} per worker) or "
        f"train.grad_accum_steps (the all-reduce happens once per optimizer step, so accumulating "
        f"{factor} micro-batches divides its share by about {factor})")


def _duplicates(runs: list[RunStats]) -> Finding | None:
    bad = [r for r in runs if r.duplicate_samples > 0]
    if not bad:
        return None
    r = max(bad, key=lambda x: x.duplicate_samples)
    return Finding(
        "duplicate_samples", "the same samples train on several ranks (pitfall: DDP without "
        "proper sharding)",
        f"at {r.workers} workers {r.duplicate_samples} of {r.samples_checked} (epoch, sample id) "
        f"pairs were trained on by more than one rank, e.g. {r.duplicate_examples[:3]}: each step "
        "computes the same gradients several times",
        "split the training set across workers (data.split_across_workers: true, the default; "
        "Ray Train splits the datasets in DataConfig.datasets_to_split); with plain PyTorch, a "
        "DistributedSampler")


def _sublinear(runs: list[RunStats], explained: bool, min_efficiency: float) -> Finding | None:
    eff = scaling_efficiency(runs)
    low = {n: e for n, e in eff.items() if e < min_efficiency}
    if not low or explained:
        return None
    n = min(low)
    r = next(x for x in runs if x.workers == n)
    return Finding(
        "sublinear_scaling", "sub-linear scaling (pitfall: adding GPUs without measuring)",
        f"{n} workers give {_pct(low[n])} of linear throughput ("
        + ", ".join(f"{x.workers}w: {x.samples_per_s:,.0f} samples/s" for x in runs)
        + f"); per step: forward+backward {1000 * r.compute_s:.1f} ms, optimizer "
        f"{1000 * r.optimizer_s:.1f} ms, data wait {1000 * r.data_wait_s:.1f} ms"
        + (f", all-reduce {1000 * r.comm_s:.1f} ms" if r.comm_s is not None else ""),
        "do not add workers yet: the extra ones are not paying for themselves. Check that each "
        "worker has its own CPU cores/GPU (scaling.cpus_per_worker, torch_threads), that nothing "
        "else competes for the machine, and profile the step")


def diagnose(runs: list[RunStats], *,
             min_efficiency: float = THRESHOLDS["scaling_efficiency"]) -> list[Finding]:
    """The pitfalls these runs show, root causes first. Sub-linear scaling (below
    `min_efficiency`) is reported on its own only when neither slow data nor
    communication explains it."""
    runs = sorted(runs, key=lambda r: r.workers)
    causes = [f for f in (_data_loading(runs), _batch_too_small(runs)) if f is not None]
    dup = _duplicates(runs)
    found = causes + ([dup] if dup else [])
    sub = _sublinear(runs, explained=bool(causes), min_efficiency=min_efficiency)
    return found + ([sub] if sub else [])
