"""Tokenized windows kept on disk: a tokenized source (jsonl, text with a tokenizer) is
tokenized and packed once, and later reads of the same piece and split memory-map the
windows instead of tokenizing them again.

An entry is a folder holding one raw file per array (``tokens`` int32 and ``loss_mask``
uint8, ``(rows, seq_len)``; ``sample_id`` int64, ``(rows,)``; ``position_ids`` int32
for ``data.packing: documents``, `ARRAYS` plus it) and ``meta.json``, its
key and row count. It is written under a temporary name, synced, and renamed into place
when complete, so a reader sees a whole entry or none; a writer stopped early (a run
that ends mid-epoch, a bad record, a full disk) removes what it wrote, and the folder
of one killed outright is swept a day later by the next writer. One process writes an
entry at a time (a lock file beside it; the others read on without writing). A reader
checks the key and every file's size against the row count before it trusts an entry,
and anything missing, foreign or cut short reads as no entry: the piece is tokenized
again. The key (built by `token_cache._TokenCache`) holds everything the windows depend on:
the files' identity, the tokenizer's files, the spec, the library versions and the
code (this module's too).

Entries are evicted least recently used first (`prune`): a read marks its entry used
(the meta file's modification time). A reader holds a shared lock on the entry's use
file (``NAME.use``, apart from the writers' ``NAME.lock``) while its arrays are mapped,
and `remove` takes it exclusively or leaves the entry: on a cache shared between
machines (NFS) a removed file's pages would vanish from under a reader on another
machine. An entry is renamed to a temporary name before it is deleted, so a reader
sees it whole or not at all. The two lock files stay (empty) when the entry goes: one
deleted while another process has it open would let two processes each hold "the" lock.

numpy only: no Ray, no torch.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

import numpy as np

__all__ = ["FORMAT", "DTYPES", "ARRAYS", "Held", "read", "Writer", "tee", "slices", "Entry", "entries", "entries_text",
           "remove", "prune", "Pruned"]

FORMAT = 1  # part of every key: a change of layout never reads an old entry
DTYPES: dict[str, np.dtype] = {"tokens": np.dtype(np.int32), "loss_mask": np.dtype(np.uint8),
                                "sample_id": np.dtype(np.int64), "position_ids": np.dtype(np.int32)}
# The arrays an entry holds unless told (`packing.window_arrays`: documents add position_ids).
ARRAYS = ("tokens", "loss_mask", "sample_id")
_META = "meta.json"
_STALE_S = 24 * 3600  # a temporary folder untouched this long was left by a killed writer
# `prune` leaves an entry used this recently by default: another run may read it again.
RECENT_S = 3600


def _shape(name: str, rows: int, seq_len: int) -> tuple[int, ...]:
    return (rows,) if name == "sample_id" else (rows, seq_len)


def _lock_path(folder: Path, kind: str = "lock") -> Path:
    """The entry's writers' lock file (``lock``), or its readers' and removers' (``use``)."""
    return folder.with_name(f"{folder.name}.{kind}")


def _open_lock(path: Path) -> IO | None:
    """The lock file opened for reading and writing (NFS turns flock into POSIX locks,
    and a shared one needs a file open for reading), None where it cannot be."""
    try:
        return open(path, "a+")
    except OSError:
        return None


class Held(dict[str, np.ndarray]):
    """An entry's arrays, memory-mapped, with a shared lock on the entry that keeps
    `remove` from deleting it while they are read: released by `close`, or when this
    object is freed."""

    def __init__(self, arrays: dict[str, np.ndarray], lock: IO | None):
        super().__init__(arrays)
        self.lock = lock

    def close(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def __del__(self) -> None:
        self.close()


def read(folder: Path, key: dict, seq_len: int, arrays: tuple[str, ...] = ARRAYS) -> Held | None:
    """The entry's arrays (memory-mapped, under a shared lock), or None: no entry at
    `folder`, another key, a file missing or of the wrong size, or the entry being
    removed. Marks the entry used."""
    if not (folder / _META).is_file():  # no entry: no lock file made for it
        return None
    lock = _open_lock(_lock_path(folder, "use"))  # None: a read-only cache, nobody here removes
    if lock is not None:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # a remover holds it
            lock.close()
            return None
        except OSError:  # no locks on this filesystem (ENOLCK): read without one
            lock.close()
            lock = None
    held = _arrays(folder, key, seq_len, arrays)
    if held is None:
        if lock is not None:
            lock.close()
        return None
    try:
        os.utime(folder / _META)  # used now: `prune` evicts the least recently used first
    except OSError:  # a cache on a read-only filesystem
        pass
    return Held(held, lock)


def _arrays(folder: Path, key: dict, seq_len: int, arrays: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """`read`'s arrays, without the lock."""
    try:
        meta = json.loads((folder / _META).read_text())
        rows = meta["rows"]
        if meta["key"] != key or type(rows) is not int or rows < 0:
            return None
        out: dict[str, np.ndarray] = {}
        for name in arrays:
            dtype = DTYPES[name]
            path, shape = folder / f"{name}.bin", _shape(name, rows, seq_len)
            if path.stat().st_size != int(np.prod(shape)) * dtype.itemsize:
                return None
            out[name] = np.memmap(path, dtype=dtype, mode="r", shape=shape) if rows else np.zeros(shape, dtype)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return out


def slices(arrays: dict[str, np.ndarray], rows: int) -> Iterator[dict[str, np.ndarray]]:
    """`arrays` `rows` windows at a time (the last chunk may hold fewer), each chunk a
    copy in memory (a Ray block or a tensor must not point into the mapped file); a
    `Held` entry's lock is released at the end."""
    try:
        n = len(arrays["sample_id"])
        for start in range(0, n, rows):
            yield {k: np.array(v[start:start + rows]) for k, v in arrays.items()}
    finally:
        if isinstance(arrays, Held):
            arrays.close()


_swept: set[Path] = set()  # once per process and folder: a count pass opens a writer per piece


def _sweep(parent: Path) -> None:
    """Remove temporary folders whose files all are older than `_STALE_S` (a writer
    killed outright, which never ran its `abort`), once per process."""
    if parent in _swept:
        return
    _swept.add(parent)
    cutoff = time.time() - _STALE_S
    for tmp in parent.glob("*.tmp"):
        try:
            if all(p.stat().st_mtime < cutoff for p in [tmp, *tmp.iterdir()]):
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            continue


class Writer:
    """One entry being written: `add` chunks in order, then `commit` (or `abort`).
    Raises OSError when the folder cannot be made, and BlockingIOError when another
    process is writing the same entry. A write that fails (a full disk) drops the
    entry: `add` says so, and nothing is written or committed after it."""

    def __init__(self, folder: Path, key: dict, seq_len: int, arrays: tuple[str, ...] = ARRAYS):
        self.folder, self.key, self.seq_len, self.rows = folder, key, seq_len, 0
        self.arrays = arrays
        self.failed = False
        self.tmp = folder.with_name(f"{folder.name}.{uuid.uuid4().hex}.tmp")
        self.files: dict = {}
        folder.parent.mkdir(parents=True, exist_ok=True)
        self.lock = open(_lock_path(folder), "a+")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: another writer
            _sweep(folder.parent)
            self.tmp.mkdir()
            self.files = {name: open(self.tmp / f"{name}.bin", "wb") for name in arrays}
        except BaseException:
            self.abort()
            raise

    def add(self, chunk: dict[str, np.ndarray]) -> bool:
        """Writes the chunk; False once a write has failed (the entry is then dropped)."""
        if self.failed:
            return False
        n = len(chunk["sample_id"])
        try:
            for name in self.arrays:
                array = np.ascontiguousarray(chunk[name], dtype=DTYPES[name])
                if array.shape != _shape(name, n, self.seq_len):
                    raise ValueError(f"{name}: shape {array.shape}, expected {_shape(name, n, self.seq_len)}")
                self._write(name, array)
        except (OSError, ValueError):
            self.abort()
            return False
        self.rows += n
        return True

    def _write(self, name: str, array: np.ndarray) -> None:
        self.files[name].write(array.tobytes())

    def commit(self) -> None:
        """Put the entry in place (nothing once a write failed). A whole entry of the
        same key already there (another process's: the same windows) is kept; a broken
        one is replaced. A failure leaves no new entry."""
        if self.failed:
            return
        try:
            for f in self.files.values():
                f.flush()
                os.fsync(f.fileno())  # the data on disk before the meta that vouches for it
                f.close()
            with open(self.tmp / _META, "w") as f:
                f.write(json.dumps({"key": self.key, "rows": self.rows, "seq_len": self.seq_len}))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.rename(self.tmp, self.folder)
            except OSError:  # the folder exists (a non-empty folder is never replaced)
                if _arrays(self.folder, self.key, self.seq_len, self.arrays) is not None:
                    raise
                shutil.rmtree(self.folder, ignore_errors=True)
                os.rename(self.tmp, self.folder)
        except OSError:
            self.abort()
        self.lock.close()  # releases the lock

    def abort(self) -> None:
        self.failed = True
        for f in self.files.values():
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.lock.close()


def tee(chunks: Iterable[dict[str, np.ndarray]],
        make_writer: Callable[[], Writer | None]) -> Iterator[dict[str, np.ndarray]]:
    """`chunks`, each also written to the entry `make_writer()` opens once they are
    first read (None: no entry): committed when they are all read, dropped when the
    reader stops early or they raise. A write that fails stops the writing, never the
    reading."""
    writer = make_writer()
    try:
        for chunk in chunks:
            if writer is not None:
                writer.add(chunk)
            yield chunk
    except BaseException:  # GeneratorExit (the reader stopped), a bad record
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.commit()


@dataclass(frozen=True)
class Entry:
    """A complete entry in the folder: its path, its bytes on disk, when it was last
    used (read or written; seconds since the epoch)."""

    path: Path
    bytes: int
    used: float


def entries(parent: Path) -> list[Entry]:
    """The complete entries under `parent`, least recently used first (none for a
    folder that does not exist); entries being written (temporary folders) are left out."""
    out = []
    try:
        children = list(parent.iterdir())
    except OSError:
        return []
    for child in children:
        if child.suffix in (".tmp", ".lock", ".use"):
            continue
        try:
            used = (child / _META).stat().st_mtime
            size = sum(f.stat().st_size for f in child.iterdir())
        except OSError:  # not an entry, or removed meanwhile
            continue
        out.append(Entry(child, size, used))
    return sorted(out, key=lambda e: (e.used, e.path.name))


def entries_text(n: int) -> str:
    """
    >>> entries_text(1), entries_text(3)
    ('1 window entry', '3 window entries')
    """
    return f"{n} window entr{'y' if n == 1 else 'ies'}"


def remove(folder: Path) -> bool:
    """Removes the entry at `folder` under its lock, taken exclusively: renamed away
    first (a reader then finds no entry, never part of one), then deleted. False where
    it is in use (read or written), gone already, or cannot be removed."""
    lock = _open_lock(_lock_path(folder, "use"))
    if lock is None:
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            doomed = folder.with_name(f"{folder.name}.{uuid.uuid4().hex}.tmp")
            os.rename(folder, doomed)
        except OSError:  # BlockingIOError: in use
            return False
        shutil.rmtree(doomed, ignore_errors=True)  # what a crash leaves here, `_sweep` removes later
    return True


@dataclass(frozen=True)
class Pruned:
    """What `prune` did: entries and bytes removed, and the bytes of the entries left."""

    removed: int
    removed_bytes: int
    left_bytes: int


def prune(parent: Path, max_bytes: int, *, keep: Iterable[Path] = (), recent_s: float = RECENT_S) -> Pruned:
    """Removes the least recently used entries under `parent` until the rest take at
    most `max_bytes`, leaving those in `keep` (the caller's run's), those used less than
    `recent_s` seconds ago (another run may read them again) and those being read: those
    are left even where they alone take more."""
    found = entries(parent)
    left = sum(e.bytes for e in found)
    kept = {Path(p) for p in keep}
    cutoff = time.time() - recent_s
    removed = removed_bytes = 0
    for entry in found:  # least recently used first
        if left <= max_bytes or entry.used >= cutoff:
            break
        if entry.path in kept:
            continue
        try:
            if (entry.path / _META).stat().st_mtime >= cutoff:  # read since `entries` looked
                continue
        except OSError:  # removed meanwhile, by another process
            left -= entry.bytes
            continue
        if remove(entry.path):
            removed, removed_bytes, left = removed + 1, removed_bytes + entry.bytes, left - entry.bytes
        elif not entry.path.exists():
            left -= entry.bytes
    return Pruned(removed, removed_bytes, left)
