"""Tokenizing on several cores: the driver's count pass (`jsonl.py`) hands blocks of
its files to worker processes and takes their tokens back in order.

A worker process imports ``transformers`` and loads the tokenizer before its first
block (about 3 s here), so a pass uses them only when it has enough to tokenize:
``data.tokenize_processes: auto`` tokenizes in the driver's own process below
`PARALLEL_MIN_BYTES`, else on every core this process may use (shared with the other
ranks of a torchrun node). The tokens are the same either way: every block is
tokenized by the same function, and the results are packed in the source's order.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import sys
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator, TypeVar

from raytrain_platform.errors import DataError

__all__ = ["BLOCK_BYTES", "PARALLEL_MIN_BYTES", "count_processes", "ordered_map"]

# A worker's unit of work: about this many bytes of whole JSONL lines (about 1 s of
# tokenizing on one core).
BLOCK_BYTES = 1 << 20
# Less than this to tokenize (about 15 s on one core): starting the workers costs more
# than they save on a few cores.
PARALLEL_MIN_BYTES = 16 << 20

T = TypeVar("T")
R = TypeVar("R")


def usable_cores() -> int:
    """Cores this process may run on, divided among the ranks of a torchrun node
    (``LOCAL_WORLD_SIZE``), which each count the same data."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cores // local)


def _in_ray_actor() -> bool:
    """In a Ray actor (a sweep's trial counting its data again): Ray gave it its CPUs."""
    ray = sys.modules.get("ray")
    try:
        return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # Ray's internals: never a reason to fail a count
        return False


def count_processes(setting: int | str, todo_bytes: int) -> int:
    """Processes to tokenize `todo_bytes` with: `setting` when it is a number; for
    ``auto``, 1 (this process) below `PARALLEL_MIN_BYTES` or in a Ray actor, else one
    per usable core, at most one per block.

    >>> count_processes(3, 10), count_processes("auto", 10)
    (3, 1)
    >>> 1 <= count_processes("auto", 40 << 20) <= 40
    True
    """
    if setting != "auto":
        return int(setting)
    if todo_bytes < PARALLEL_MIN_BYTES or _in_ray_actor():
        return 1
    return max(1, min(usable_cores(), math.ceil(todo_bytes / BLOCK_BYTES)))


def _worker_start() -> None:
    # Ctrl-C reaches the whole process group: the driver stops the pass and the
    # workers with it, and no worker prints a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One thread per process: the workers already fill the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def ordered_map(fn: Callable[[T], R], tasks: Iterable[tuple[Any, T]], processes: int) -> Iterator[tuple[Any, R]]:
    """(tag, fn(task)) for each (tag, task), in the order of `tasks`: in this process
    when `processes` is 1, else on that many fresh worker processes (``spawn``: no copy
    of this process's threads or Ray connection), at most two tasks per worker in
    flight (the tasks are read as the results are taken). A task's exception is raised
    here; leaving early cancels the tasks not yet started. A worker that dies (killed,
    out of memory) is a DataError that says how to do without them."""
    if processes <= 1:
        for tag, task in tasks:
            yield tag, fn(task)
        return
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_start)
    pending: deque[tuple[Any, Future]] = deque()
    try:
        for tag, task in tasks:
            pending.append((tag, pool.submit(fn, task)))
            if len(pending) >= 2 * processes:
                tag, done = pending.popleft()
                yield tag, done.result()
        while pending:
            tag, done = pending.popleft()
            yield tag, done.result()
    except BrokenProcessPool:
        raise DataError(f"a tokenizing process stopped (killed, or out of memory) after {processes} "
                        "were started: set data.tokenize_processes to fewer, or 1 to tokenize in "
                        "this process") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
