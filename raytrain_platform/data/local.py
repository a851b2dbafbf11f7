"""A Ray-free reader for the torchrun core: the same sources, order and dealing rule
as the Ray Data pipeline (data/dealing.py)."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from raytrain_platform.data import sources
from raytrain_platform.data.dealing import deal, deal_eval, eval_micro_batches, whole_rounds
from raytrain_platform.data.sources import SourceSpec

__all__ = ["LocalBatches"]


class LocalBatches:
    """`BatchSource` over the source files directly (used under torchrun), for a
    `ResolvedJob` (its config and data sizes)."""

    def __init__(self, job: Any, *, rank: int, world_size: int):
        self.job, self.rank, self.world = job, rank, world_size
        self.spec = SourceSpec.from_config(job.config, prepared=job.data.prepared)
        self.batch = job.config.data.batch_size

    def _dealt(self, split: str, rounds: int, *, world: int) -> Iterator[dict[str, torch.Tensor]]:
        stream = sources.rebatch(sources.iter_source(self.spec, split, self.job.data.feature_columns),
                                 self.batch, tail=False)
        for b in deal(stream, rank=self.rank % world, world=world, rounds=rounds):
            yield {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in b.items()}

    def train_epoch(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        # Unsplit (data.split_across_workers false): every rank reads every micro-batch.
        world = self.world if self.job.config.data.split_across_workers else 1
        return self._dealt("train", whole_rounds(self.job.data.num_train, batch_size=self.batch, world=world),
                           world=world)

    def val_batches(self, n: int) -> list[dict[str, torch.Tensor]]:
        # The first n micro-batches per rank, the last one partial (data/dealing.py deal_eval).
        whole = self.job.config.parallel.pp_size > 1  # a pipeline's stages have fixed shapes
        micro = eval_micro_batches(self.job.data.num_val, batch_size=self.batch, world=self.world, most=n,
                                   whole=whole)
        stream = sources.rebatch(sources.iter_source(self.spec, "val", self.job.data.feature_columns),
                                 self.batch, tail=not whole)
        tensors = ({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in b.items()} for b in stream)
        return deal_eval(tensors, rank=self.rank % self.world, world=self.world, micro=micro)
