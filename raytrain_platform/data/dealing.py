"""The one dealing rule of micro-batches to data-parallel ranks, shared by the Ray Data
reader (launch/worker.py) and the Ray-free one (data/local.py): micro-batch ``j`` of
an epoch goes to rank ``j % world``, and only whole rounds of one micro-batch per rank
are dealt (every rank takes the same number of steps).

>>> list(deal(range(7), rank=1, world=2, rounds=3))
[1, 3, 5]
>>> whole_rounds(10, batch_size=2, world=2)
2
"""

from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

__all__ = ["deal", "whole_rounds"]

T = TypeVar("T")


def deal(batches: Iterable[T], *, rank: int, world: int, rounds: int) -> Iterator[T]:
    """This rank's micro-batches of `batches`: ``j % world == rank``, for `rounds` rounds."""
    for j, batch in enumerate(batches):
        if j >= rounds * world:
            return
        if j % world == rank:
            yield batch


def whole_rounds(rows: int, *, batch_size: int, world: int) -> int:
    """Rounds of one `batch_size` micro-batch per rank that `rows` samples fill."""
    return rows // (batch_size * world)
