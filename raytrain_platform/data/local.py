"""A Ray-free reader for the torchrun core: the same sources, order and sharding
rule as the Ray Data pipeline (micro-batch ``j`` of an epoch goes to rank
``j % world``; only whole rounds of one micro-batch per rank are dealt)."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from raytrain_platform.data import sources
from raytrain_platform.data.sources import SourceSpec
from raytrain_platform.resolve import ResolvedJob, val_rounds

__all__ = ["LocalBatches"]


def _rebatch(pieces: Iterator[dict[str, np.ndarray]], batch: int) -> Iterator[dict[str, np.ndarray]]:
    """Cut a stream of variable-size pieces into batches of exactly `batch` rows."""
    buf: list[dict[str, np.ndarray]] = []
    have = 0
    for piece in pieces:
        n = piece["sample_id"].shape[0]
        if not n:
            continue
        buf.append(piece)
        have += n
        while have >= batch:
            joined = {k: np.concatenate([p[k] for p in buf]) for k in buf[0]}
            yield {k: v[:batch] for k, v in joined.items()}
            rest = {k: v[batch:] for k, v in joined.items()}
            have -= batch
            buf = [rest] if have else []


class LocalBatches:
    """`BatchSource` over the source files directly (used under torchrun)."""

    def __init__(self, job: ResolvedJob, *, rank: int, world_size: int):
        self.job, self.rank, self.world = job, rank, world_size
        self.spec = SourceSpec.from_config(job.config)
        self.batch = job.config.data.batch_size

    def _strided(self, split: str, limit_rounds: int | None, *,
                 world: int) -> Iterator[dict[str, torch.Tensor]]:
        stream = _rebatch(sources.iter_source(self.spec, split, self.job.data.feature_columns),
                          self.batch)
        for j, b in enumerate(stream):
            if limit_rounds is not None and j >= limit_rounds * world:
                return
            if j % world == self.rank % world:
                yield {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in b.items()}

    def train_epoch(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        # Unsplit (data.split_across_workers false): every rank reads every micro-batch.
        world = self.world if self.job.config.data.split_across_workers else 1
        return self._strided("train", self.job.data.num_train // (world * self.batch), world=world)

    def val_batches(self, n: int) -> list[dict[str, torch.Tensor]]:
        return list(self._strided("val", min(n, val_rounds(self.job)), world=self.world))
