"""The parallel dimensions of a job: data (dp), tensor (tp) and pipeline (pp) parallel
sizes, and where a rank sits among them. Pure Python (no torch): the config layer
validates with it before anything starts, the data layer deals micro-batches by it.

Ranks are laid out ``(pp, dp, tp)`` with tp innermost, as in torchtitan: the ranks of
one TP group are consecutive, so they share a node whenever a node holds a multiple
of ``tp_size`` workers (TP needs the fastest links; see launch/resources.py).

>>> dims = ParallelDims(dp=2, tp=2, pp=1)
>>> [dims.coords(r) for r in range(4)]  # (pp_rank, dp_rank, tp_rank)
[(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
>>> dims.data_rank(3), dims.world
(1, 4)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ParallelDims", "PP_SCHEDULES", "stage_blocks"]

# schedule name -> model chunks (virtual stages) each pipeline rank holds
PP_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> "ParallelDims":
        """Of a `JobConfig` (its scaling and parallel sections)."""
        par = cfg.parallel
        return cls(dp=cfg.scaling.num_workers // (par.tp_size * par.pp_size),
                   tp=par.tp_size, pp=par.pp_size)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def model_parallel(self) -> bool:
        """True when one model replica spans several ranks."""
        return self.tp * self.pp > 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def data_rank(self, rank: int) -> int:
        """Which data-parallel replica `rank` belongs to: all ranks of one TP/PP group
        (one model replica) read the same micro-batches."""
        return self.coords(rank)[1]


def stage_blocks(n_layer: int, n_stages: int, split: list[int] | None = None) -> list[range]:
    """Block indices of each pipeline stage: `split` (blocks per stage) or balanced,
    earlier stages taking the remainder.

    >>> stage_blocks(5, 2)
    [range(0, 3), range(3, 5)]
    >>> stage_blocks(4, 2, [1, 3])
    [range(0, 1), range(1, 4)]
    """
    each, rest = divmod(n_layer, n_stages)
    counts = split or [each + (1 if i < rest else 0) for i in range(n_stages)]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def rank_blocks(n_layer: int, n_stages: int, pp: int, pp_rank: int,
                split: Sequence[int] | None = None) -> int:
    """How many blocks pipeline rank `pp_rank` of `pp` holds: its stages ``pp_rank,
    pp_rank + pp, ...`` of `stage_blocks` (one stage per rank, or several interleaved),
    counted in O(1) when balanced, without building every stage's range (the planner
    asks this for layouts of up to a million stages).

    >>> [rank_blocks(7, 4, 2, r) for r in range(2)], [len(b) for b in stage_blocks(7, 4)]
    ([4, 3], [2, 2, 2, 1])
    >>> rank_blocks(4, 2, 2, 1, [1, 3])
    3
    """
    stages = range(pp_rank, n_stages, pp)
    if split:
        return sum(split[i] for i in stages)
    each, rest = divmod(n_layer, n_stages)  # as stage_blocks: the first `rest` stages one more
    return len(stages) * each + len(range(pp_rank, rest, pp))
