"""Step profiling for `rtp doctor`: per-step time split into data wait, forward+backward,
gradient communication and optimizer, plus the sample ids each rank trained on.

A profiled run has three phases, by optimizer step:

- ``step < measure_from``: warm-up (Ray Data start-up, allocator, first-step costs), not recorded;
- ``measure_from <= step < breakdown_from``: normal steps, recorded: their wall time gives
  throughput and their data wait is what training really waits;
- ``step >= breakdown_from``: breakdown steps. Gradients are not all-reduced inside
  backward (where DDP overlaps them with compute) but after it, by the strategy's
  ``sync_grads``, so communication gets a time of its own. The result is the same mean
  gradient; the step is a little slower than a normal one, by the overlap it gives up.

Nothing here imports Ray; rank 0 writes ``profile.json`` into the run directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from raytrain_platform.core.rundir import write_json

__all__ = ["StepProfiler", "PROFILE_FILE", "duplicate_samples"]

PROFILE_FILE = "profile.json"


def duplicate_samples(seen_by_rank: list[list[tuple[int, int]]]) -> dict:
    """(epoch, sample_id) pairs that more than one data-parallel replica trained on.

    >>> duplicate_samples([[(0, 1), (0, 2)], [(0, 2), (0, 3)], [(1, 1)]])
    {'samples': 5, 'distinct': 4, 'on_several_ranks': 1, 'examples': [[0, 2]]}
    """
    owners: dict[tuple[int, ...], set[int]] = {}
    for rank, pairs in enumerate(seen_by_rank):
        for pair in pairs:
            owners.setdefault(tuple(pair), set()).add(rank)
    shared = sorted(k for k, ranks in owners.items() if len(ranks) > 1)
    return {"samples": sum(len(p) for p in seen_by_rank), "distinct": len(owners),
            "on_several_ranks": len(shared), "examples": [list(k) for k in shared[:5]]}


@dataclass
class StepProfiler:
    measure_from: int  # first recorded optimizer step (0-based)
    breakdown_from: int  # first step with gradients synced apart from backward
    steps: list[dict] = field(default_factory=list)
    seen: list[tuple[int, int]] = field(default_factory=list)  # (epoch, sample_id)

    @classmethod
    def from_dict(cls, d: dict | None) -> "StepProfiler | None":
        return None if not d else cls(measure_from=int(d["measure_from"]),
                                      breakdown_from=int(d["breakdown_from"]))

    def mode(self, step: int) -> str | None:
        if step < self.measure_from:
            return None
        return "measure" if step < self.breakdown_from else "breakdown"

    def see(self, epoch: int, sample_ids: torch.Tensor) -> None:
        self.seen += [(epoch, int(i)) for i in sample_ids.tolist()]

    def record(self, **row: float | int | str | None) -> None:
        self.steps.append(dict(row))

    def finish(self, *, rank: int, world_size: int, data_rank: int,
               run_dir: str | os.PathLike | None) -> None:
        """Gather every rank's records on rank 0, which writes ``profile.json``. Ranks of
        one TP/PP group share a `data_rank` and are meant to see the same samples."""
        mine = {"rank": rank, "data_rank": data_rank, "steps": self.steps, "seen": self.seen}
        if dist.is_initialized() and world_size > 1:
            gathered: list = [None] * world_size
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if rank != 0 or run_dir is None:
            return
        replicas = sorted({g["data_rank"] for g in gathered})
        write_json(Path(run_dir) / PROFILE_FILE, {
            "world_size": world_size, "data_parallel": len(replicas),
            "ranks": [{"rank": g["rank"], "steps": g["steps"]} for g in gathered],
            "duplicates": duplicate_samples(
                [next(g["seen"] for g in gathered if g["data_rank"] == d) for d in replicas]),
        })
