"""Tokenizing on several cores: the driver's count pass (`pieces.py`) hands blocks of
its files to worker processes and takes their tokens back in order.

A worker process imports ``transformers`` and loads the tokenizer before its first
block (about 3 s here), so a pass uses them only when it has enough to tokenize:
``data.tokenize_processes: auto`` tokenizes in the driver's own process below
`PARALLEL_MIN_BYTES` and in a Ray actor, else on every core this process may use
(shared with the other ranks of a torchrun node; at most `MAX_AUTO_PROCESSES`). The
tokens are the same either way: every block is tokenized by the same function, and
the results are packed in the source's order.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import os
import signal
import sys
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Generator, Iterable, TypeVar

from raytrain_platform.errors import DataError

__all__ = ["BLOCK_BYTES", "BROKEN", "MAX_AUTO_PROCESSES", "PARALLEL_MIN_BYTES", "count_processes", "ordered_map",
           "usable_cores"]

# A worker's unit of work: about this many bytes of whole JSONL lines (about 1 s of
# tokenizing on one core).
BLOCK_BYTES = 1 << 20
# Less than this to tokenize (16 MiB: some 6 s of text or prompt_completion and 13 s of
# chat, batched, on 2 cores here): starting the workers costs more than they save on a
# few cores.
PARALLEL_MIN_BYTES = 16 << 20
# `auto`'s most workers: each holds its own `transformers` and tokenizer (a few hundred MB).
MAX_AUTO_PROCESSES = 16

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
    per usable core, at most one per block and `MAX_AUTO_PROCESSES`.

    >>> count_processes(3, 10), count_processes("auto", 10)
    (3, 1)
    """
    if setting != "auto":
        return int(setting)
    if todo_bytes < PARALLEL_MIN_BYTES or _in_ray_actor():
        return 1
    return max(1, min(usable_cores(), MAX_AUTO_PROCESSES, math.ceil(todo_bytes / BLOCK_BYTES)))


def _worker_start(parent: int) -> None:
    # Ctrl-C reaches the whole process group: the driver stops the pass and the
    # workers with it, and no worker prints a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A driver killed outright (SIGKILL, the OOM killer) takes its workers with it: a
    # worker waiting on its task queue would otherwise outlive it, its tokenizer loaded.
    if sys.platform == "linux":
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # the driver died before the prctl
            os._exit(1)
    # One thread per process: the workers already fill the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


_PR_SET_PDEATHSIG = 1  # <sys/prctl.h>

# What a failed worker pool says (BrokenProcessPool carries no reason of its own).
BROKEN = ("a tokenizing worker process stopped or could not start (killed, out of memory, or "
          "a script that starts training at import, without an `if __name__ == \"__main__\":` "
          "guard, which each worker re-runs): set data.tokenize_processes to 1 to tokenize in "
          "this process")


def _result(future: Future) -> Any:
    """`future.result()`, an exception raised with its own message only: the worker's
    traceback, which concurrent.futures chains as its cause (a text whose first line is
    three quotes: the one line the CLI would print), becomes a note instead, which a full
    traceback still shows."""
    try:
        return future.result()
    except BrokenProcessPool as exc:
        raise DataError(BROKEN) from exc
    except Exception as exc:
        remote = exc.__cause__
        if remote is not None and type(remote).__name__ == "_RemoteTraceback":
            add_note = getattr(exc, "add_note", None)  # Python 3.11+
            if add_note is not None:
                add_note(f"in a tokenizing worker process:{remote}")
            raise exc.with_traceback(None) from None
        raise


def ordered_map(fn: Callable[[T], R], tasks: Iterable[tuple[Any, T]],
                processes: int) -> Generator[tuple[Any, R], None, None]:
    """(tag, fn(task)) for each (tag, task), in the order of `tasks`: in this process
    when `processes` is 1, else on that many fresh worker processes (``spawn``: no copy
    of this process's threads or Ray connection), at most two tasks per worker in
    flight (the tasks are read as the results are taken). A task's exception is raised
    here, with its own message; a worker pool that fails is a DataError that says how
    to do without one. Leaving early (an error, Ctrl-C, the caller stopping) stops the
    workers at once, not after their tasks."""
    if processes <= 1:
        for tag, task in tasks:
            yield tag, fn(task)
        return
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_start, initargs=(os.getpid(),))
    pending: deque[tuple[Any, Future]] = deque()
    done = False
    try:
        for tag, task in tasks:
            try:
                pending.append((tag, pool.submit(fn, task)))
            except BrokenProcessPool:
                raise DataError(BROKEN) from None
            if len(pending) >= 2 * processes:
                tag, future = pending.popleft()
                yield tag, _result(future)
        while pending:
            tag, future = pending.popleft()
            yield tag, _result(future)
        done = True
    finally:
        if not done:  # the running tasks are of no use now: end them (a private field, read with care)
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                with contextlib.suppress(Exception):
                    proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
