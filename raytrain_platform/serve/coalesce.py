"""Hand the compute thread everything that queued up while it was busy.

Serve's ``@serve.batch`` (Ray 2.60) forms a new batch every ``batch_wait_timeout_s``
whether or not the previous one is still computing; with its default of one batch at a
time (``max_concurrent_batches=1``) the formed batches then wait for the compute in
turn. When compute is the bottleneck the batches stay small (measured: 1-2 requests per
forward with 19 of 32 in flight for a 252M-parameter MLP) and batching saves nothing.
The replica lets every formed batch through at once, and the `Coalescer` sits between
those batches and the one compute thread: when the thread frees up, it takes every
batch waiting for the same kind of work, up to `max_items` requests, as one.

>>> import asyncio
>>> async def run(key, items):
...     await asyncio.sleep(0.01)
...     return [f"{key}:{x}" for x in items]
>>> async def demo():
...     queue = Coalescer(run, max_items=8)
...     return await asyncio.gather(queue.submit("a", [1]), queue.submit("a", [2, 3]))
>>> asyncio.run(demo())
[['a:1'], ['a:2', 'a:3']]
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Awaitable, Callable, Generic, Hashable, TypeVar

__all__ = ["Coalescer"]

_K = TypeVar("_K", bound=Hashable)  # the kind of work
_T = TypeVar("_T")  # one request's item
_Entry = tuple[_K, list[_T], asyncio.Future]


class Coalescer(Generic[_K, _T]):
    """`submit(key, items)` returns `run(key, merged_items)`'s results for `items`; entries
    of one key waiting together run as one call (in arrival order, at most `max_items`
    items, an entry never split)."""

    def __init__(self, run: Callable[[_K, list[_T]], Awaitable[list]], max_items: int):
        self._run, self._max_items = run, max_items
        self._pending: deque[_Entry[_K, _T]] = deque()
        self._drainer: asyncio.Task | None = None

    async def submit(self, key: _K, items: list[_T]) -> list:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((key, items, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    def _take(self) -> tuple[_K, list[_Entry[_K, _T]]]:
        key, count = self._pending[0][0], 0
        taken: list[_Entry[_K, _T]] = []
        rest: deque[_Entry[_K, _T]] = deque()
        for entry in self._pending:
            if entry[0] == key and (not taken or count + len(entry[1]) <= self._max_items):
                taken.append(entry)
                count += len(entry[1])
            else:
                rest.append(entry)
        self._pending = rest
        return key, taken

    async def _drain(self) -> None:
        while self._pending:
            key, taken = self._take()
            try:
                results: Any = await self._run(key, [item for _, items, _ in taken for item in items])
            except Exception as exc:  # every waiting request gets the error, the loop goes on
                for _, _, future in taken:
                    if not future.done():
                        future.set_exception(exc)
                continue
            start = 0
            for _, items, future in taken:
                if not future.done():  # a cancelled request (client gone) is skipped
                    future.set_result(results[start:start + len(items)])
                start += len(items)
