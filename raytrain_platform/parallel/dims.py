"""The parallel dimensions of a job: data (dp), tensor (tp) and pipeline (pp) parallel
sizes, and where a rank sits among them. Pure Python (no torch): the config layer
validates with it before anything starts, the data layer deals micro-batches by it.

Ranks are laid out ``(pp, dp, tp)`` with tp innermost, as in torchtitan: the ranks of
one TP group are consecutive, so they share a node whenever a node holds a multiple
of ``tp_size`` workers (TP needs the fastest links; see launch/trainer.py).

>>> dims = ParallelDims(dp=2, tp=2, pp=1)
>>> [dims.coords(r) for r in range(4)]  # (pp_rank, dp_rank, tp_rank)
[(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
>>> dims.data_rank(3), dims.world
(1, 4)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain_platform.errors import ConfigError

if TYPE_CHECKING:
    from raytrain_platform.config import JobConfig

__all__ = ["ParallelDims", "PP_SCHEDULES", "validate_parallel_dims", "stage_blocks"]

# schedule name -> model chunks (virtual stages) each pipeline rank holds
PP_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @classmethod
    def from_config(cls, cfg: "JobConfig") -> "ParallelDims":
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
    counts = split or [n_layer // n_stages + (1 if i < n_layer % n_stages else 0)
                       for i in range(n_stages)]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(field, value, allowed)


def validate_parallel_dims(cfg: "JobConfig") -> None:
    """The checks that need several sections: sizes multiply to the workers, the model
    can be split that way. Each failure is one line naming the numbers."""
    par, n = cfg.parallel, cfg.scaling.num_workers
    tp, pp = par.tp_size, par.pp_size
    _check(n % (tp * pp) == 0, "scaling.num_workers", n,
           f"a multiple of parallel.tp_size ({tp}) x parallel.pp_size ({pp}) = {tp * pp} "
           f"(data-parallel size = num_workers / (tp_size x pp_size) = {n}/{tp * pp} must be whole)")
    if tp * pp == 1:
        return
    dp = n // (tp * pp)
    field = "parallel.tp_size" if tp > 1 else "parallel.pp_size"
    _check(cfg.model.name == "gpt", field, tp if tp > 1 else pp,
           f"1 for model '{cfg.model.name}' (tensor/pipeline parallel plans exist for gpt)")
    _check(tp == 1 or pp == 1, "parallel.pp_size", pp,
           f"1 when parallel.tp_size is {tp} (TP x PP in one job is not supported; use one of them)")
    _check(par.strategy != "ddp" or tp == 1 or dp == 1, "parallel.strategy", par.strategy,
           f"'fsdp' for data parallel over tensor-parallel groups (tp_size {tp} x dp {dp}: TP x FSDP)")
    _check(not par.activation_checkpointing, "parallel.activation_checkpointing", True,
           f"false with tp_size {tp} / pp_size {pp} (supported with FSDP alone)")
    kw = cfg.model.kwargs
    _check(kw["n_head"] % tp == 0, "parallel.tp_size", tp,
           f"a divisor of model.kwargs.n_head ({kw['n_head']}): each TP rank holds whole heads")
    if pp > 1:
        _validate_pipeline(cfg, kw["n_layer"])


def _validate_pipeline(cfg: "JobConfig", n_layer: int) -> None:
    par, batch = cfg.parallel, cfg.data.batch_size
    stages = par.pp_size * PP_SCHEDULES[par.pp_schedule]
    _check(n_layer >= stages, "parallel.pp_size", par.pp_size,
           f"at most model.kwargs.n_layer ({n_layer}) pipeline stages in all "
           f"({par.pp_size} ranks x {PP_SCHEDULES[par.pp_schedule]} for {par.pp_schedule} = {stages})")
    split = par.pp_split
    _check(split is None or (len(split) == stages and sum(split) == n_layer), "parallel.pp_split",
           split, f"{stages} block counts (one per stage) summing to model.kwargs.n_layer ({n_layer})")
    micro = par.pp_microbatches or par.pp_size
    _check(batch == "auto" or batch % micro == 0, "parallel.pp_microbatches", micro,
           f"a divisor of data.batch_size ({batch}): each micro-batch is cut into equal pipeline chunks")
    _check(par.pp_schedule == "gpipe" or micro >= par.pp_size, "parallel.pp_microbatches", micro,
           f"at least parallel.pp_size ({par.pp_size}) for {par.pp_schedule}")
    if par.pp_schedule == "interleaved_1f1b":
        _check(micro % par.pp_size == 0, "parallel.pp_microbatches", micro,
               f"a multiple of parallel.pp_size ({par.pp_size}) for interleaved_1f1b")
