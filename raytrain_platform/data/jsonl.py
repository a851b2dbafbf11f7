"""JSONL instruction data, tokenized with a Hugging Face tokenizer and packed into
fixed-length windows (numpy only: no Ray, no torch).

Ray Data runs `piece_windows` once per file inside ``map_batches``, and the Ray-free
reader runs the same function in a loop, so both paths see the same windows in the
same order: mapped from the token cache, where the driver's count pass keeps each
file's windows (`window_cache`), or else tokenized by `stream_jsonl_windows`, which
yields them a chunk at a time as it tokenizes. Everything is pure and deterministic:
same files, tokenizer and spec → same arrays, whatever the chunk size, however many
records are tokenized per call, on however many processes (`pool.py`, the count
pass), and whether cached.

Three record formats, one JSON object per line (blank lines are skipped):

* ``text``: ``{"text": ...}``; every token is trained on.
* ``prompt_completion``: ``{"prompt": ..., "completion": ...}``; only the completion
  and the closing EOS are trained on.
* ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the
  tokenizer's chat template; only the assistant turns are trained on.

Each document ends with the tokenizer's EOS. Documents go to train or val by a hash
of ``(file_index << 32) | line_index`` *before* packing, so no window mixes the two
splits; then each file's documents are concatenated and cut into non-overlapping
windows of ``seq_len`` tokens (the tail is dropped). ``loss_mask[t]`` says whether
token ``t`` is a training target: a trainer that predicts ``tokens[:, 1:]`` from
``tokens[:, :-1]`` weights its loss by ``loss_mask[:, 1:]``.

>>> spec = JsonlSpec(path="data/chat.jsonl", format="chat", tokenizer="model",
...                  seq_len=129, val_fraction=0.1)
>>> spec.seq_len - 1  # the model's context
128
>>> batch = jsonl_windows(0, jsonl_files(spec)[0], spec, "train")  # doctest: +SKIP
>>> batch["tokens"].shape[1], batch["tokens"].dtype, batch["loss_mask"].dtype  # doctest: +SKIP
(129, dtype('int32'), dtype('uint8'))

``python -m raytrain_platform.tools.tiny_llm OUT`` writes a matching tokenizer
(``OUT/model``) and data in all three formats (``OUT/data``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from raytrain_platform.data import pool, window_cache
# Tokenizing records (encode.py) and the token cache (token_cache.py) are their own
# modules; their public names are this module's too.
from raytrain_platform.data.encode import _batches, _check_record, _encode, _text_docs, encode_record, load_tokenizer
from raytrain_platform.data.sources import split_mask
from raytrain_platform.data.token_cache import (CACHE_ENV, MAX_SIZE_ENV, _CountedWindows, _TokenCache, cache_dir,
                                                windows_limit)
from raytrain_platform.errors import ConfigError, DataError
from raytrain_platform.units import format_size

if TYPE_CHECKING:
    import pyarrow.fs as pafs

__all__ = [
    "FORMATS",
    "JsonlSpec",
    "jsonl_files",
    "load_tokenizer",
    "encode_record",
    "STREAM_TOKENS",
    "stream_rows",
    "stream_jsonl_windows",
    "jsonl_windows",
    "iter_windows",
    "CountProgress",
    "CACHE_ENV",
    "MAX_SIZE_ENV",
    "cache_dir",
    "windows_limit",
    "count_windows",
    "text_groups",
    "stream_text_group_windows",
    "text_group_windows",
    "count_text_windows",
    "piece_windows",
    "check_fits",
]

FORMATS = ("text", "prompt_completion", "chat")
_VAL_BIT = 1 << 31  # set in the sample_id of val windows: ids never collide across splits


@dataclass(frozen=True)
class JsonlSpec:
    """Everything a reader needs, as plain picklable values (shipped to Ray tasks)."""

    path: str  # a .jsonl file or a folder of them (recursive); local path or URI
    format: str  # text | prompt_completion | chat
    tokenizer: str  # local folder of a Hugging Face tokenizer
    seq_len: int  # tokens per window, including the extra target token (context + 1)
    val_fraction: float
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    window_cache: bool = True  # keep packed windows in the token cache (`_TokenCache`)
    tokenize_processes: int | str = "auto"  # the count pass's (`pool.count_processes`)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError("data.format", self.format, f"one of {', '.join(FORMATS)}")
        if not (isinstance(self.seq_len, int) and self.seq_len >= 2):
            raise ConfigError("data.seq_len", self.seq_len, "an integer >= 2 (context + 1)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError("data.val_fraction", self.val_fraction, "a number in [0, 1)")


# ---------------------------------------------------------------- files


def _filesystem(path: str) -> tuple["pafs.FileSystem", str]:
    import pyarrow.fs as pafs

    try:
        if "://" in path:
            return pafs.FileSystem.from_uri(path)
        return pafs.LocalFileSystem(), os.path.abspath(path)
    except Exception as exc:  # pyarrow raises several types for bad URIs
        raise DataError(f"data.path = {path!r}: not a readable path or URI ({exc})") from None


def jsonl_files(spec: JsonlSpec) -> list[str]:
    """The .jsonl files under ``spec.path``, sorted; URIs stay URIs (so any process can
    open them again), local paths become absolute."""
    import pyarrow.fs as pafs

    fs, root = _filesystem(spec.path)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"data.path = {spec.path!r}: no such file or folder")
    if info.type == pafs.FileType.File:
        if not root.endswith(".jsonl"):
            raise DataError(f"data.path = {spec.path!r}: expected a .jsonl file or a folder of them")
        if info.size == 0:
            raise DataError(f"data.path = {spec.path!r}: the file is empty")
        return [spec.path if "://" in spec.path else root]
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    found = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".jsonl"))
    if not found:
        raise DataError(f"data.path = {spec.path!r}: the folder holds no .jsonl files")
    if "://" not in spec.path:
        return found
    # Rebuild each file's URI from the root's: keeps host, port and bucket.
    base, root = spec.path.rstrip("/"), root.rstrip("/")
    return [base + f[len(root):] for f in found]


def _file_blocks(path: str, block_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(index of its first line, bytes) of consecutive blocks of whole lines of the file,
    read about `block_bytes` at a time: the file is never held whole. The last block
    holds what follows the last newline (empty when the file ends with one, and for an
    empty file: every file gives at least one block). DataError when it cannot be read."""
    fs, local = _filesystem(path)
    try:
        stream = fs.open_input_stream(local)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc})") from None
    with stream:
        line = 0
        parts: list[bytes] = []  # the start of a line that has not ended yet
        while True:
            try:
                chunk = stream.read(block_bytes)
            except OSError as exc:
                raise DataError(f"{path}: cannot be read ({exc})") from None
            if not chunk:
                yield line, b"".join(parts)
                return
            cut = chunk.rfind(b"\n") + 1
            if not cut:  # a line longer than a block: joined once it ends, not copied per chunk
                parts.append(chunk)
                continue
            block = b"".join([*parts, chunk[:cut]])
            yield line, block
            line += block.count(b"\n")
            parts = [chunk[cut:]]


def _records(path: str, data: bytes, spec: JsonlSpec, first_line: int = 0) -> Iterator[tuple[int, dict, int]]:
    """(0-based line index, record, its bytes) for each non-blank line of `data` (the
    lines of `path` from `first_line` on), each checked for `spec.format`."""
    for index, raw in enumerate(data.split(b"\n"), first_line):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise DataError(f"{path}:{index + 1}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
        except RecursionError:
            raise DataError(f"{path}:{index + 1}: JSON nested too deeply to read") from None
        try:
            _check_record(record, spec)
        except DataError as exc:
            raise DataError(f"{path}:{index + 1}: {exc}") from None
        yield index, record, len(raw)


# ---------------------------------------------------------------- windows

# A read task yields its windows about this many tokens at a time, as it tokenizes: a
# consumer (each epoch's first batch) waits for one such chunk, not for a whole file.
STREAM_TOKENS = 1 << 13


def stream_rows(seq_len: int) -> int:
    """Windows per chunk a read task yields (about `STREAM_TOKENS` tokens).

    >>> stream_rows(129), stream_rows(1 << 20)
    (63, 1)
    """
    return max(1, STREAM_TOKENS // seq_len)


def _check_split(split: str) -> None:
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")


def _documents(file_index: int, path: str, spec: JsonlSpec, splits: tuple[str, ...] = ("train", "val"), *,
               lines: tuple[int, bytes] | None = None) -> Iterator[tuple[bool, list[int], list[int]]]:
    """(in val, token ids, loss mask) of each record of the file in `splits`, in line
    order (with `lines`, (index of its first line, bytes of whole lines): of those lines
    only); the other records are checked, not tokenized. A record goes to val by a hash
    of ``(file_index << 32) | line_index``, before packing, so no window mixes the splits.
    The file is read a block at a time and tokenized `ENCODE_BATCH` records at a time;
    the first bad line is the one named, whatever the batch."""
    tok = load_tokenizer(spec.tokenizer, need_chat_template=spec.format == "chat")
    blocks = [lines] if lines is not None else _file_blocks(path, pool.BLOCK_BYTES)
    records = (record for first, data in blocks for record in _records(path, data, spec, first))
    for batch in _batches(records, lambda item: item[2]):
        line_ids = (np.int64(file_index) << np.int64(32)) | np.array([i for i, _, _ in batch], dtype=np.int64)
        is_val = split_mask(line_ids, spec.val_fraction, "val").tolist()
        keep = [(v, i, r) for v, (i, r, _) in zip(is_val, batch) if ("val" if v else "train") in splits]
        docs = _encode(tok, [r for _, _, r in keep], spec, where=lambda k: f"{path}:{keep[k][1] + 1}: ")
        for (v, _, _), (ids, mask) in zip(keep, docs):
            yield v, ids, mask


class _Packer:
    """Documents (ids, mask) concatenated in order and cut into non-overlapping windows
    of `seq_len` tokens (the tail is dropped), `rows` windows to a chunk (the last may
    hold fewer), each chunk handed back as soon as the documents fill it. Window ``i``
    gets ``sample_id`` ``first_id | i``. Each token is copied a bounded number of times,
    however long a document is."""

    def __init__(self, seq_len: int, first_id: int, rows: int):
        self.seq_len, self.first_id, self.chunk = seq_len, first_id, rows * seq_len
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.have = self.done = 0

    def _windows(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        n = ids.size // self.seq_len
        out = {"tokens": ids.reshape(n, self.seq_len), "loss_mask": mask.reshape(n, self.seq_len),
               "sample_id": np.int64(self.first_id) | np.arange(self.done, self.done + n, dtype=np.int64)}
        self.done += n
        return out

    def _joined(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate([i for i, _ in self.pending]), np.concatenate([m for _, m in self.pending])

    def add(self, doc_ids: list[int] | np.ndarray, doc_mask: list[int] | np.ndarray) -> list[dict[str, np.ndarray]]:
        """The chunks this document (or several, concatenated) completes (often none)."""
        self.pending.append((np.asarray(doc_ids, dtype=np.int32), np.asarray(doc_mask, dtype=np.uint8)))
        self.have += len(doc_ids)
        if self.have < self.chunk:
            return []
        ids, mask = self._joined()
        whole = self.have // self.chunk * self.chunk
        out = [self._windows(ids[start:start + self.chunk], mask[start:start + self.chunk])
               for start in range(0, whole, self.chunk)]
        self.pending, self.have = [(ids[whole:], mask[whole:])], self.have - whole
        return out

    def end(self) -> list[dict[str, np.ndarray]]:
        """The last, shorter chunk of whole windows, if any."""
        if self.have < self.seq_len:
            return []
        ids, mask = self._joined()
        n = self.have // self.seq_len * self.seq_len
        return [self._windows(ids[:n], mask[:n])]


def _pack(docs: Iterable[tuple[list[int], list[int]]], seq_len: int, first_id: int,
          rows: int) -> Iterator[dict[str, np.ndarray]]:
    """`_Packer`'s chunks of `docs`, as the documents fill them."""
    packer = _Packer(seq_len, first_id, rows)
    for doc_ids, doc_mask in docs:
        yield from packer.add(doc_ids, doc_mask)
    yield from packer.end()


def _joined(chunks: Iterable[dict[str, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """Chunks of windows as one batch (empty arrays of the right shapes if none)."""
    parts = list(chunks)
    if not parts:
        return {"tokens": np.zeros((0, seq_len), np.int32), "loss_mask": np.zeros((0, seq_len), np.uint8),
                "sample_id": np.zeros(0, np.int64)}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def stream_jsonl_windows(file_index: int, path: str, spec: JsonlSpec, split: str, *,
                         rows: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """`jsonl_windows`'s arrays `rows` windows at a time (default `stream_rows`),
    each chunk yielded as soon as the records tokenized so far (`ENCODE_BATCH` at a
    time) fill it."""
    _check_split(split)
    docs = ((ids, mask) for _, ids, mask in _documents(file_index, path, spec, (split,)))
    return _pack(docs, spec.seq_len, _first_id(file_index, split), rows or stream_rows(spec.seq_len))


def jsonl_windows(file_index: int, path: str, spec: JsonlSpec, split: str) -> dict[str, np.ndarray]:
    """One file's `split` documents packed into windows: ``tokens`` int32 (n, seq_len),
    ``loss_mask`` uint8 (n, seq_len) and a stable, unique ``sample_id`` int64 (n,)."""
    return _joined(stream_jsonl_windows(file_index, path, spec, split), spec.seq_len)


def iter_windows(spec: JsonlSpec, split: str) -> Iterator[dict[str, np.ndarray]]:
    """`jsonl_windows` of every file in order: the whole split, one batch per file."""
    for file_index, path in enumerate(jsonl_files(spec)):
        yield jsonl_windows(file_index, path, spec, split)


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


def _file_key(file_index: int, spec: JsonlSpec) -> dict:
    """A .jsonl file's part of its token cache keys."""
    return {"file_index": file_index, "format": spec.format, "val_fraction": spec.val_fraction,
            "fields": [spec.text_field, spec.prompt_field, spec.completion_field, spec.messages_field]}


def _first_id(file_index: int, split: str) -> int:
    return (file_index << 32) | (_VAL_BIT if split == "val" else 0)


@dataclass(frozen=True)
class _Piece:
    """What the count pass tokenizes as one: a .jsonl file (its `index` in the sorted
    files), or with `text` a group of text files (`text_groups`)."""

    index: int
    paths: tuple[str, ...]
    text: bool = False

    def key(self, spec: JsonlSpec) -> dict:
        """Its windows' key (its token sums': the same, or for a text group none but its files)."""
        return _group_key(self.index, spec) if self.text else _file_key(self.index, spec)

    def sums_key(self, spec: JsonlSpec) -> dict:
        return {"text_group": True} if self.text else self.key(spec)

    @property
    def sums(self) -> int:
        """Token sums kept: train and val for a file, all for a text group (its windows
        go to a split by their ids, after packing)."""
        return 1 if self.text else 2

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
            blocks = _file_blocks(path, pool.BLOCK_BYTES)
            block = next(blocks)
            for following in blocks:
                yield ("jsonl", self.index, path, *block, spec), False
                block = following
        except DataError as exc:
            yield ("error", str(exc)), True
            return
        yield ("jsonl", self.index, path, *block, spec), True


def _tokenize_task(task: tuple) -> tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(documents, {split: (token ids int32, loss mask uint8)}) of one task: each
    split's documents concatenated in order ("train" and "val" for a block of a file,
    "all" for a text group). Runs in the count pass's worker processes, or in its own."""
    parts: dict[str, tuple[list[int], list[int]]] = {}
    docs = 0
    if task[0] == "error":
        raise DataError(task[1])
    if task[0] == "text":
        found: Iterator[tuple[str, list[int], list[int]]] = (
            ("all", ids, mask) for ids, mask in _group_documents(task[1], task[2]))
    else:
        _, file_index, path, first, block, spec = task
        found = (("val" if v else "train", ids, mask)
                 for v, ids, mask in _documents(file_index, path, spec, lines=(first, block)))
    for split, ids, mask in found:
        all_ids, all_mask = parts.setdefault(split, ([], []))
        all_ids += ids
        all_mask += mask
        docs += 1
    return docs, {split: (np.array(ids, dtype=np.int32), np.array(mask, dtype=np.uint8))
                  for split, (ids, mask) in parts.items()}


class _PieceCount:
    """One piece's tokens as its tasks give them back, in order: its token sums, and
    its windows packed and written to the token cache (the splits it lacks)."""

    def __init__(self, piece: _Piece, spec: JsonlSpec, cache: _TokenCache | None, missing: list[str]):
        rows = stream_rows(spec.seq_len)
        self.out = _CountedWindows(cache, list(piece.paths), piece.key(spec), spec, missing)
        self.tokens = [0] * piece.sums
        self.packers = ({"all": _Packer(spec.seq_len, piece.index << 32, rows)} if piece.text else
                        {s: _Packer(spec.seq_len, _first_id(piece.index, s), rows) for s in ("train", "val")})

    def _put(self, split: str, chunks: list[dict[str, np.ndarray]]) -> None:
        if split == "all":
            self.out.put_by_id(chunks)
        else:
            self.out.put(split, chunks)

    def _wants(self, split: str) -> bool:
        return bool(self.out.writers) if split == "all" else self.out.wants(split)

    def add(self, parts: dict[str, tuple[np.ndarray, np.ndarray]]) -> int:
        """Adds a task's tokens; returns how many."""
        added = 0
        for split, (ids, mask) in parts.items():
            self.tokens[split == "val"] += ids.size
            added += ids.size
            if self._wants(split):
                self._put(split, self.packers[split].add(ids, mask))
        return added

    def finish(self) -> list[int]:
        for split, packer in self.packers.items():
            if self._wants(split):
                self._put(split, packer.end())
        self.out.commit()
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
                sums[i] = cache.held_tokens(piece.paths, piece.sums_key(spec), piece.sums)
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
        fs, local = _filesystem(path)
        return max(0, fs.get_file_info(local).size or 0)
    except (OSError, DataError):
        return 0


def count_windows(spec: JsonlSpec) -> tuple[int, int]:
    """(train, val) windows over all files; DataError when there is no training window.
    A pass of more than a few seconds reports its progress on stderr."""
    progress = CountProgress("data.path")
    pieces = [_Piece(i, (path,)) for i, path in enumerate(jsonl_files(spec))]
    sums = _count_pieces(pieces, spec, progress)
    train = sum(t // spec.seq_len for t, _ in sums)
    val = sum(v // spec.seq_len for _, v in sums)
    if train == 0:
        raise DataError(f"data.path = {spec.path!r}: no training window of data.seq_len = "
                        f"{spec.seq_len - 1} tokens (+1) (too little data, or lower data.seq_len)")
    progress.done(train, val)
    return train, val


# ---------------------------------------------------------------- text files

# Consecutive text files are tokenized and packed together, about this many bytes to a
# group: one read task each, and documents (files) pack across file ends, so short
# files are not each cut short by a dropped tail. A fast BPE tokenizes a group in ~1 s.
TEXT_GROUP_BYTES = 1 << 20


def text_groups(files: list[tuple[str, int]], group_bytes: int = TEXT_GROUP_BYTES) -> list[tuple[str, ...]]:
    """(path, size) of sorted text files -> tuples of consecutive paths of at least
    `group_bytes` bytes each (the last group may hold less).

    >>> text_groups([("a", 5), ("b", 7), ("c", 1)], group_bytes=10)
    [('a', 'b'), ('c',)]
    """
    groups: list[tuple[str, ...]] = []
    current: list[str] = []
    size = 0
    for path, n in files:
        current.append(path)
        size += n
        if size >= group_bytes:
            groups.append(tuple(current))
            current, size = [], 0
    if current:
        groups.append(tuple(current))
    return groups


def _group_documents(paths: tuple[str, ...], spec: JsonlSpec) -> Iterator[tuple[list[int], list[int]]]:
    """Each file one document (BOS where the tokenizer has one, its text, EOS), in order."""
    tok = load_tokenizer(spec.tokenizer, need_chat_template=False)

    def texts() -> Iterator[str]:
        for path in paths:
            try:
                with open(path, "rb") as f:
                    yield f.read().decode("utf-8", errors="replace")
            except OSError as exc:
                raise DataError(f"{path}: cannot be read ({exc})") from None

    for batch in _batches(texts(), len):
        yield from _text_docs(tok, batch)


def stream_text_group_windows(group_index: int, paths: tuple[str, ...], spec: JsonlSpec, split: str, *,
                              rows: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """`text_group_windows`'s arrays about `rows` windows at a time (default
    `stream_rows`; fewer once the other split's windows are left out), each chunk
    yielded as soon as the group's files fill it."""
    _check_split(split)
    for chunk in _pack(_group_documents(paths, spec), spec.seq_len, group_index << 32,
                       rows or stream_rows(spec.seq_len)):
        keep = split_mask(chunk["sample_id"], spec.val_fraction, split)
        if keep.any():
            yield {k: v[keep] for k, v in chunk.items()}


def text_group_windows(group_index: int, paths: tuple[str, ...], spec: JsonlSpec,
                       split: str) -> dict[str, np.ndarray]:
    """One group of text files packed into windows, the `split` part of them: as the
    byte-level text source, windows (not files) go to train or val by a hash of their
    ``group_index << 32 | window_index`` id. Same arrays as `jsonl_windows`."""
    return _joined(stream_text_group_windows(group_index, paths, spec, split), spec.seq_len)


def _group_key(group_index: int, spec: JsonlSpec) -> dict:
    """A text group's part of its windows' keys (its token sums need none: the group's
    files are the whole key)."""
    return {"text_group": group_index, "val_fraction": spec.val_fraction}


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
    chunks = (stream_text_group_windows(index, piece, spec, split, rows=rows) if text
              else stream_jsonl_windows(index, piece[0], spec, split, rows=rows))
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


def check_fits(spec: JsonlSpec, *, vocab_size: int | None, max_positions: int | None) -> None:
    """ConfigError unless the tokenizer's ids fit the model's embedding and each window's
    context (seq_len - 1) fits its positions; None skips a check."""
    tok = load_tokenizer(spec.tokenizer, need_chat_template=spec.format == "chat")
    if vocab_size is not None and len(tok) > vocab_size:
        raise ConfigError("data.tokenizer", spec.tokenizer,
                          f"a tokenizer of at most the model's vocab_size {vocab_size} tokens "
                          f"(this one has {len(tok)})")
    if max_positions is not None and spec.seq_len - 1 > max_positions:
        raise ConfigError("data.seq_len", spec.seq_len,
                          f"at most {max_positions + 1}: the model has {max_positions} positions "
                          "and sees seq_len - 1 tokens")
