"""A tokenized source in pieces: a piece is one .jsonl file (`jsonl.py`) or one group
of text files (`text_groups.py`). The driver's count pass tokenizes every piece once,
on one or more processes (`pool.py`), to count the windows and keep them in the token
cache (`token_cache.py`); Ray Data's read tasks and the Ray-free reader then take a
piece's windows from there (`piece_windows`), or tokenize it where none are kept.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from raytrain_platform.data import jsonl, pool, text_groups, window_cache
from raytrain_platform.data.jsonl import JsonlSpec, _check_split, _file_key, _first_id, make_packer, stream_rows
from raytrain_platform.data.sources import filesystem, split_mask
from raytrain_platform.data.token_cache import MAX_SIZE_ENV, _CountedWindows, _TokenCache, windows_limit
from raytrain_platform.errors import ConfigError, DataError
from raytrain_platform.units import format_size

__all__ = ["CountProgress", "Counted", "count_windows", "count_packed", "count_text_windows", "piece_windows"]


class CountProgress:
    """Progress of the driver's count pass, on stderr: nothing for a pass shorter than
    `quiet` seconds, then a line every `every` seconds and one at the end.

    >>> import io
    >>> out = io.StringIO()
    >>> p = CountProgress("data.path", quiet=0.0, every=3600.0, out=out)
    >>> p.add(120)
    >>> p.done(7, 1)
    >>> print(out.getvalue(), end="")  # doctest: +ELLIPSIS
    data.path: tokenizing to count the windows: 1 document, 120 tokens so far (0 s)
    data.path: tokenized 1 document, 120 tokens: 7 train and 1 validation windows in ...s
    """

    def __init__(self, what: str, *, quiet: float = 5.0, every: float = 10.0, out: Any = None):
        self.what, self.quiet, self.every, self.out = what, quiet, every, out
        self.docs = self.tokens = 0
        self.started = time.monotonic()
        self.next_line = self.started + quiet
        self.printed = False

    def _print(self, line: str) -> None:
        print(f"{self.what}: {line}", file=self.out or sys.stderr, flush=True)
        self.printed = True

    def _so_far(self) -> str:
        return f"{self.docs:,} document{'s' * (self.docs != 1)}, {self.tokens:,} tokens"

    def note(self, line: str) -> None:
        """Says `line` now (how the pass tokenizes)."""
        self._print(line)

    def aside(self, line: str) -> None:
        """Says `line` now, about something else than tokenizing (the token cache):
        a pass that printed nothing else prints no summary for it."""
        printed = self.printed
        self._print(line)
        self.printed = printed

    def add(self, tokens: int, docs: int = 1) -> None:
        """`docs` more documents, of `tokens` tokens in all."""
        self.docs, self.tokens = self.docs + docs, self.tokens + tokens
        now = time.monotonic()
        if now >= self.next_line:
            self._print(f"tokenizing to count the windows: {self._so_far()} so far "
                        f"({now - self.started:.0f} s)")
            self.next_line = now + self.every

    def done(self, train: int, val: int) -> None:
        if self.printed:
            self._print(f"tokenized {self._so_far()}: {train:,} train and {val:,} validation "
                        f"windows in {time.monotonic() - self.started:.1f}s")


@dataclass(frozen=True)
class _Piece:
    """What the count pass tokenizes as one: a .jsonl file (its `index` in the sorted
    files), or with `text` a group of text files (`text_groups`)."""

    index: int
    paths: tuple[str, ...]
    text: bool = False

    def key(self, spec: JsonlSpec) -> dict:
        """Its windows' key (its token sums': the same, or for a text group none but its files)."""
        return text_groups._group_key(self.index, spec) if self.text else _file_key(self.index, self.paths[0], spec)

    def sums_key(self, spec: JsonlSpec) -> dict:
        if self.text:
            return {"text_group": True}
        # documents: window counts, which depend on the window's length
        return self.key(spec) if spec.packing == "concat" else {**self.key(spec), "seq_len": spec.seq_len}

    def sums(self, spec: JsonlSpec) -> int:
        """Sums kept: train and val tokens for a file, all tokens for a text group (its
        windows go to a split by their ids, after packing); with ``data.packing:
        documents``, train and val windows and the documents truncated."""
        return 1 if self.text else 2 if spec.packing == "concat" else 3

    def tasks(self, spec: JsonlSpec) -> Iterator[tuple[tuple, bool]]:
        """(`_tokenize_task`'s task, whether it is the piece's last), in order: a text
        group whole (its files are never split), a file's lines in blocks of about
        `pool.BLOCK_BYTES` (at least one, for its 0-row entries). A file that cannot be
        read is a task that raises, in its place: what comes before it is counted first."""
        if self.text:
            yield ("text", self.paths, spec), True
            return
        path = self.paths[0]
        try:
            blocks = jsonl._file_blocks(path, pool.BLOCK_BYTES)
            block = next(blocks)
            for following in blocks:
                yield ("jsonl", self.index, path, *block, spec), False
                block = following
        except DataError as exc:
            yield ("error", str(exc)), True
            return
        yield ("jsonl", self.index, path, *block, spec), True


_Parts = dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]


def _tokenize_task(task: tuple) -> tuple[int, _Parts]:
    """(documents, {split: (token ids int32, loss mask uint8, document lengths int64)})
    of one task: each split's documents concatenated in order ("train" and "val" for a
    block of a file, "all" for a text group). Runs in the count pass's worker
    processes, or in its own."""
    parts: dict[str, tuple[list[int], list[int], list[int]]] = {}
    docs = 0
    if task[0] == "error":
        raise DataError(task[1])
    if task[0] == "text":
        found: Iterator[tuple[str, list[int], list[int]]] = (
            ("all", ids, mask) for ids, mask in text_groups._group_documents(task[1], task[2]))
    else:
        _, file_index, path, first, block, spec = task
        found = (("val" if v else "train", ids, mask)
                 for v, ids, mask in jsonl._documents(file_index, path, spec, lines=(first, block)))
    for split, ids, mask in found:
        all_ids, all_mask, lengths = parts.setdefault(split, ([], [], []))
        all_ids += ids
        all_mask += mask
        lengths.append(len(ids))
        docs += 1
    return docs, {split: (np.array(ids, dtype=np.int32), np.array(mask, dtype=np.uint8),
                          np.array(lengths, dtype=np.int64)) for split, (ids, mask, lengths) in parts.items()}


class _PieceCount:
    """One piece's tokens as its tasks give them back, in order: its sums (`_Piece.sums`),
    and its windows packed and written to the token cache (the splits it lacks)."""

    def __init__(self, piece: _Piece, spec: JsonlSpec, cache: _TokenCache | None, missing: list[str]):
        rows = stream_rows(spec.seq_len)
        self.out = _CountedWindows(cache, list(piece.paths), piece.key(spec), spec, missing)
        self.tokens = [0] * piece.sums(spec)
        # documents: windows are counted by packing them, kept or not
        self.counting = spec.packing == "documents"
        self.packers = ({"all": make_packer(spec, piece.index << 32, rows)} if piece.text else
                        {s: make_packer(spec, _first_id(piece.index, s), rows) for s in ("train", "val")})

    def _put(self, split: str, chunks: list[dict[str, np.ndarray]]) -> None:
        if split == "all":
            self.out.put_by_id(chunks)
        else:
            self.out.put(split, chunks)

    def _wants(self, split: str) -> bool:
        return bool(self.out.writers) if split == "all" else self.out.wants(split)

    def add(self, parts: _Parts) -> int:
        """Adds a task's tokens; returns how many."""
        added = 0
        for split, (ids, mask, lengths) in parts.items():
            if not self.counting:
                self.tokens[split == "val"] += ids.size
            added += ids.size
            if self._wants(split) or self.counting:
                chunks = self.packers[split].add(ids, mask, lengths)
                if self._wants(split):
                    self._put(split, chunks)
        return added

    def finish(self) -> list[int]:
        for split, packer in self.packers.items():
            if self._wants(split) or self.counting:
                chunks = packer.end()
                if self._wants(split):
                    self._put(split, chunks)
        self.out.commit()
        if self.counting:
            p = self.packers
            return [p["train"].done, p["val"].done, p["train"].truncated + p["val"].truncated]
        return self.tokens


def _count_pieces(pieces: list[_Piece], spec: JsonlSpec, progress: CountProgress) -> list[list[int]]:
    """Each piece's token sums: read back from the token cache where it holds them (and
    the piece's windows, or `data.window_cache` is off), else tokenized once, on
    ``pool.count_processes`` processes, the windows kept as they come and each piece's
    entries committed as soon as its last task is in (a later piece's error keeps them)."""
    cache = _TokenCache.open(spec)
    limit = windows_limit() if cache is not None and spec.window_cache else None  # bad: said before tokenizing
    sums: list[list[int] | None] = [None] * len(pieces)
    missing: list[list[str]] = [[] for _ in pieces]  # each piece's splits without kept windows
    if cache is not None:
        for i, piece in enumerate(pieces):
            missing[i] = cache.missing_windows(list(piece.paths), piece.key(spec), spec)
            if not missing[i]:
                sums[i] = cache.held_tokens(piece.paths, piece.sums_key(spec), piece.sums(spec))
    todo = [i for i, held in enumerate(sums) if held is None]
    todo_bytes = (sum(_size(p) for i in todo for p in pieces[i].paths)
                  if todo and spec.tokenize_processes == "auto" else 0)
    processes = pool.count_processes(spec.tokenize_processes, todo_bytes) if todo else 1
    if processes > 1:
        progress.note(f"tokenizing with {processes} processes")
    tasks = (((i, last), task) for i in todo for task, last in pieces[i].tasks(spec))
    current: _PieceCount | None = None
    with contextlib.closing(pool.ordered_map(_tokenize_task, tasks, processes)) as results:
        try:
            for (i, last), (docs, parts) in results:
                current = current or _PieceCount(pieces[i], spec, cache, missing[i])
                progress.add(current.add(parts), docs)
                if last:
                    sums[i] = tokens = current.finish()
                    current = None
                    if cache is not None:
                        cache.keep_tokens(pieces[i].paths, pieces[i].sums_key(spec), tokens)
        except BaseException:
            if current is not None:
                current.out.abort()
            raise
    counted = [s for s in sums if s is not None]
    if len(counted) != len(pieces):
        raise RuntimeError(f"the count pass has no token sums for {len(pieces) - len(counted)} piece(s)")
    if cache is not None and limit is not None:
        _prune_note(cache.prune(limit), limit, progress)
    return counted


def _prune_note(pruned: window_cache.Pruned, limit: int, progress: CountProgress) -> None:
    """Says what keeping the token cache within its limit did, where it did anything."""
    if pruned.removed:
        progress.aside(f"token cache: removed {window_cache.entries_text(pruned.removed)} used longest ago "
                      f"({format_size(pruned.removed_bytes)}) to stay within {MAX_SIZE_ENV} = {format_size(limit)}")
    if pruned.left_bytes > limit:
        progress.aside(f"token cache: its windows take {format_size(pruned.left_bytes)}, above {MAX_SIZE_ENV} = "
                      f"{format_size(limit)}: this run's, and any read now or used in the last hour, are kept; "
                      "raise the limit, or data.window_cache: false to keep none")


def _size(path: str) -> int:
    """The file's size in bytes (0 where it cannot be found: reading it then says why)."""
    try:
        if "://" not in path:
            return os.path.getsize(path)
        fs, local = filesystem(path)
        return max(0, fs.get_file_info(local).size or 0)
    except (OSError, DataError):
        return 0


@dataclass(frozen=True)
class Counted:
    """What the count pass found: windows per split, and (``data.packing: documents``)
    the documents longer than a window, truncated to it."""

    train: int
    val: int
    truncated: int = 0


def count_windows(spec: JsonlSpec) -> tuple[int, int]:
    """(train, val) windows over all files (`count_packed`)."""
    counted = count_packed(spec)
    return counted.train, counted.val


def count_packed(spec: JsonlSpec) -> Counted:
    """Windows over all files, and documents truncated; DataError when there is no
    training window. A pass of more than a few seconds reports its progress on stderr."""
    progress = CountProgress("data.path")
    pieces = [_Piece(i, (path,)) for i, path in enumerate(jsonl.jsonl_files(spec))]
    sums = _count_pieces(pieces, spec, progress)
    if spec.packing == "documents":
        train, val, truncated = (sum(s[k] for s in sums) for k in range(3))
    else:
        train, val, truncated = sum(s[0] // spec.seq_len for s in sums), sum(s[1] // spec.seq_len for s in sums), 0
    if train == 0:
        raise DataError(f"data.path = {spec.path!r}: no training window of data.seq_len = "
                        f"{spec.seq_len - 1} tokens (+1) (too little data, or lower data.seq_len)")
    progress.done(train, val)
    return Counted(train, val, truncated)


def count_text_windows(groups: list[tuple[str, ...]], spec: JsonlSpec) -> tuple[int, int]:
    """(train, val) windows over all groups; DataError when there is no training window."""
    progress = CountProgress("data.path")
    sums = _count_pieces([_Piece(g, paths, text=True) for g, paths in enumerate(groups)], spec, progress)
    train = val = 0
    for g, (tokens,) in enumerate(sums):
        ids = (np.int64(g) << np.int64(32)) | np.arange(tokens // spec.seq_len, dtype=np.int64)
        is_val = split_mask(ids, spec.val_fraction, "val")
        train, val = train + int((~is_val).sum()), val + int(is_val.sum())
    if train == 0:
        raise DataError(f"data.path = {spec.path!r}: no training window of data.seq_len = "
                        f"{spec.seq_len - 1} tokens (+1) in the tokenized text (too little text, or "
                        "lower data.seq_len)")
    progress.done(train, val)
    return train, val



# ---------------------------------------------------------------- the read tasks' windows


def piece_windows(index: int, piece: tuple[str, ...], spec: JsonlSpec, split: str, *, text: bool,
                  rows: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Piece `index` of a tokenized source (one .jsonl file; with `text`, a group of
    text files), its `split` windows about `rows` at a time (default `stream_rows`):
    mapped from the token cache where an entry holds them (the driver's count pass
    writes them, unless `data.window_cache` is off), else tokenized
    (`stream_jsonl_windows`, `stream_text_group_windows`: a node without the driver's
    cache, an entry removed since) and written there once the piece has been read to its
    end. The same arrays either way."""
    _check_split(split)
    rows = rows or stream_rows(spec.seq_len)
    key = _Piece(index, piece, text).key(spec)
    cache = _TokenCache.open(spec) if spec.window_cache else None
    held = cache.windows(piece, key, split, spec.seq_len) if cache else None
    if held is not None:
        return window_cache.slices(held, rows)
    chunks = (text_groups.stream_text_group_windows(index, piece, spec, split, rows=rows) if text
              else jsonl.stream_jsonl_windows(index, piece[0], spec, split, rows=rows))
    if cache is None:
        return chunks
    return _kept(window_cache.tee(chunks, lambda: cache.window_writer(piece, key, split, spec.seq_len)), cache)


_PRUNE_EVERY_S = 60.0  # a read task's process looks over the cache at most this often
_last_prune = -_PRUNE_EVERY_S
# A read task cannot tell its run's other entries: it leaves any used within the day.
_READ_TASK_RECENT_S = 24 * 3600


def _kept(chunks: Iterator[dict[str, np.ndarray]], cache: _TokenCache) -> Iterator[dict[str, np.ndarray]]:
    """`chunks` (a read task's, written to the token cache as they are read), then the
    cache kept within its limit (`windows_limit`; the driver has checked its value), at
    most once a minute per process: a node whose cache the driver does not see (its own
    home folder) stays within it too."""
    global _last_prune
    yield from chunks
    if time.monotonic() - _last_prune >= _PRUNE_EVERY_S:
        _last_prune = time.monotonic()
        with contextlib.suppress(ConfigError):
            cache.prune(windows_limit(), recent_s=_READ_TASK_RECENT_S)
