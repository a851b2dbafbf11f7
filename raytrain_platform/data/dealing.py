"""The one dealing rule of micro-batches to data-parallel ranks, shared by the Ray Data
reader (launch/worker.py) and the Ray-free one (data/local.py): micro-batch ``j`` of
an epoch goes to rank ``j % world``, and only whole rounds of one micro-batch per rank
are dealt (every rank takes the same number of steps).

>>> list(deal(range(7), rank=1, world=2, rounds=3))
[1, 3, 5]
>>> whole_rounds(10, batch_size=2, world=2)
2

Evaluation reads the first micro-batches of the validation split, the last one possibly
partial, dealt by the same rule (`deal_eval`). A rank left with fewer micro-batches than
the others (a split smaller than one round) runs the split's first micro-batch again
marked `EVAL_PAD`: every rank makes the same number of forwards (each is a collective
under FSDP), and a marked one adds nothing to the sums.

>>> eval_micro_batches(3, batch_size=8, world=2, most=4)
1
>>> [(b, EVAL_PAD in b) for b in deal_eval([{"n": 3}], rank=1, world=2, micro=1)]
[({'n': 3, 'eval_pad': True}, True)]
"""

from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

__all__ = ["EVAL_PAD", "deal", "deal_eval", "eval_micro_batches", "whole_rounds"]

EVAL_PAD = "eval_pad"  # key of a validation micro-batch run only to keep the ranks in step

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


def eval_micro_batches(rows: int, *, batch_size: int, world: int, most: int, whole: bool = False) -> int:
    """Validation micro-batches read in all (over the ranks): the first ``most`` per rank,
    or all of `rows` when fewer, the last one partial (dropped when `whole`: a pipeline's
    stages have fixed shapes)."""
    read = min(rows, most * world * batch_size)
    return read // batch_size if whole else -(-read // batch_size)


def deal_eval(batches: Iterable[dict], *, rank: int, world: int, micro: int) -> list[dict]:
    """This rank's share of the first `micro` validation micro-batches of `batches` (the
    same stream on every rank), padded to ``ceil(micro / world)`` with the first one
    marked `EVAL_PAD`."""
    rounds = -(-micro // world)
    first, own = None, []
    for j, batch in enumerate(batches):
        if j >= micro:
            break
        first = batch if first is None else first
        if j % world == rank:
            own.append(batch)
    if len(own) < rounds:
        assert first is not None, "a rank pads only when the split has a micro-batch"
        own += [{**first, EVAL_PAD: True}] * (rounds - len(own))
    return own
