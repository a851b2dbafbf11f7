"""JSONL instruction data, tokenized with a Hugging Face tokenizer and packed into
fixed-length windows (numpy only: no Ray, no torch).

Ray Data runs `pieces.piece_windows` once per file inside ``map_batches``, and the
Ray-free reader runs the same function in a loop, so both paths see the same windows in the
same order: mapped from the token cache, where the driver's count pass keeps each
file's windows (`pieces.py`, `window_cache`), or else tokenized by `stream_jsonl_windows`, which
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
* ``preference``: ``{"prompt", "chosen", "rejected"}`` pairs, one pair per row, never
  packed (`preference.py`; read and counted by `pair_reader.py`, the hook of issue 49
  until the tokenizing pass of issue 48 takes them over).

Each document ends with the tokenizer's EOS. Documents go to train or val by a hash
of the file's path under ``data.path`` and the line's index (`sources.split_keys`)
*before* packing, so no window mixes the two splits, and a record keeps its split when
other files are added to the folder; then each file's documents are concatenated and cut into non-overlapping
windows of ``seq_len`` tokens (the tail is dropped): ``packing`` concat. With ``packing``
documents, whole documents are packed into windows instead, each apart (`packing.py`;
the windows then carry ``position_ids``). ``loss_mask[t]`` says whether
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

import json
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from raytrain_platform.data import pool
from raytrain_platform.data.packing import PACKINGS, DocumentPacker, pad_id, window_arrays
# Tokenizing records is encode.py's; its public names are this module's too.
from raytrain_platform.data.encode import _batches, _check_record, _encode, encode_record, load_tokenizer
from raytrain_platform.data.preference import PairSpec, check_pair
from raytrain_platform.data.sources import filesystem, split_key, split_keys, split_mask
from raytrain_platform.errors import ConfigError, DataError

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
    "check_fits",
    "make_packer",
]

FORMATS = ("text", "prompt_completion", "chat", "preference")
_VAL_BIT = 1 << 31  # set in the sample_id of val windows: ids never collide across splits


@dataclass(frozen=True)
class JsonlSpec:
    """Everything a reader needs, as plain picklable values (shipped to Ray tasks)."""

    path: str  # a .jsonl file or a folder of them (recursive); local path or URI
    format: str  # text | prompt_completion | chat | preference
    tokenizer: str  # local folder of a Hugging Face tokenizer
    seq_len: int  # tokens per window, including the extra target token (context + 1)
    val_fraction: float
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    chosen_field: str = "chosen"  # preference
    rejected_field: str = "rejected"  # preference
    window_cache: bool = True  # keep packed windows in the token cache (`_TokenCache`)
    tokenize_processes: int | str = "auto"  # the count pass's (`pool.count_processes`)
    packing: str = "concat"  # documents | concat (`packing.py`)

    def pair_spec(self) -> PairSpec:
        """What encoding a preference pair needs (``data.format: preference``)."""
        return PairSpec(row_len=self.seq_len, prompt_field=self.prompt_field,
                        chosen_field=self.chosen_field, rejected_field=self.rejected_field)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError("data.format", self.format, f"one of {', '.join(FORMATS)}")
        if self.packing not in PACKINGS:
            raise ConfigError("data.packing", self.packing, f"one of {', '.join(PACKINGS)}")
        if not (isinstance(self.seq_len, int) and self.seq_len >= 2):
            raise ConfigError("data.seq_len", self.seq_len, "an integer >= 2 (context + 1)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError("data.val_fraction", self.val_fraction, "a number in [0, 1)")


# ---------------------------------------------------------------- files


def jsonl_files(spec: JsonlSpec) -> list[str]:
    """The .jsonl files under ``spec.path``, sorted; URIs stay URIs (so any process can
    open them again), local paths become absolute."""
    import pyarrow.fs as pafs

    fs, root = filesystem(spec.path)
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
    # Rebuild each file's URI from the root's: keeps host, port, bucket and the query
    # (``?endpoint_override=...``), which follows the file's path.
    base, query_mark, query = spec.path.partition("?")
    base, root = base.rstrip("/"), root.rstrip("/")
    return [base + f[len(root):] + query_mark + query for f in found]


def _file_blocks(path: str, block_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(index of its first line, bytes) of consecutive blocks of whole lines of the file,
    read about `block_bytes` at a time: the file is never held whole. The last block
    holds what follows the last newline (empty when the file ends with one, and for an
    empty file: every file gives at least one block). DataError when it cannot be read."""
    fs, local = filesystem(path)
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
            if spec.format == "preference":
                check_pair(record, spec.pair_spec())
            else:
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
    of the file's name under ``data.path`` and its line index (`split_keys`), before
    packing, so no window mixes the splits.
    The file is read a block at a time and tokenized `ENCODE_BATCH` records at a time;
    the first bad line is the one named, whatever the batch."""
    tok = load_tokenizer(spec.tokenizer, need_chat_template=spec.format == "chat")
    blocks = [lines] if lines is not None else _file_blocks(path, pool.BLOCK_BYTES)
    records = (record for first, data in blocks for record in _records(path, data, spec, first))
    key = split_key(path, spec.path)
    for batch in _batches(records, lambda item: item[2]):
        keys = split_keys(key, np.array([i for i, _, _ in batch], dtype=np.int64))
        is_val = split_mask(keys, spec.val_fraction, "val").tolist()
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
        self.truncated = 0  # never: a document may span windows

    def _windows(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        n = ids.size // self.seq_len
        out = {"tokens": ids.reshape(n, self.seq_len), "loss_mask": mask.reshape(n, self.seq_len),
               "sample_id": np.int64(self.first_id) | np.arange(self.done, self.done + n, dtype=np.int64)}
        self.done += n
        return out

    def _joined(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate([i for i, _ in self.pending]), np.concatenate([m for _, m in self.pending])

    def add(self, doc_ids: list[int] | np.ndarray, doc_mask: list[int] | np.ndarray,
            lengths: object = None) -> list[dict[str, np.ndarray]]:
        """The chunks this document (or several, concatenated; their `lengths` do not
        matter here) completes (often none)."""
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


def make_packer(spec: JsonlSpec, first_id: int, rows: int) -> _Packer | DocumentPacker:
    """The packer of `spec.packing`: `_Packer` (concat) or `packing.DocumentPacker`,
    its windows' ids from `first_id` on, `rows` windows to a chunk."""
    if spec.packing == "concat":
        return _Packer(spec.seq_len, first_id, rows)
    tok = load_tokenizer(spec.tokenizer, need_chat_template=spec.format == "chat")
    return DocumentPacker(spec.seq_len, first_id, rows, pad_id(tok))


def _pack(docs: Iterable[tuple[list[int], list[int]]], seq_len: int, first_id: int,
          rows: int, packer: _Packer | DocumentPacker | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The chunks of `docs` (by `packer`, default `_Packer`), as the documents fill them."""
    packer = packer or _Packer(seq_len, first_id, rows)
    for doc_ids, doc_mask in docs:
        yield from packer.add(doc_ids, doc_mask)
    yield from packer.end()


def _joined(chunks: Iterable[dict[str, np.ndarray]], seq_len: int, packing: str = "concat") -> dict[str, np.ndarray]:
    """Chunks of windows as one batch (empty arrays of the right shapes if none)."""
    parts = list(chunks)
    if not parts:
        empty: dict[str, np.ndarray] = {
            "tokens": np.zeros((0, seq_len), np.int32), "loss_mask": np.zeros((0, seq_len), np.uint8),
            "sample_id": np.zeros(0, np.int64), "position_ids": np.zeros((0, seq_len), np.int32)}
        return {k: empty[k] for k in window_arrays(packing)}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def stream_jsonl_windows(file_index: int, path: str, spec: JsonlSpec, split: str, *,
                         rows: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """`jsonl_windows`'s arrays `rows` windows at a time (default `stream_rows`),
    each chunk yielded as soon as the records tokenized so far (`ENCODE_BATCH` at a
    time) fill it."""
    _check_split(split)
    docs = ((ids, mask) for _, ids, mask in _documents(file_index, path, spec, (split,)))
    first, rows = _first_id(file_index, split), rows or stream_rows(spec.seq_len)
    return _pack(docs, spec.seq_len, first, rows, make_packer(spec, first, rows))


def jsonl_windows(file_index: int, path: str, spec: JsonlSpec, split: str) -> dict[str, np.ndarray]:
    """One file's `split` documents packed into windows: ``tokens`` int32 (n, seq_len),
    ``loss_mask`` uint8 (n, seq_len) and a stable, unique ``sample_id`` int64 (n,);
    with ``data.packing: documents``, ``position_ids`` int32 (n, seq_len) too."""
    return _joined(stream_jsonl_windows(file_index, path, spec, split), spec.seq_len, spec.packing)


def iter_windows(spec: JsonlSpec, split: str) -> Iterator[dict[str, np.ndarray]]:
    """`jsonl_windows` of every file in order: the whole split, one batch per file."""
    for file_index, path in enumerate(jsonl_files(spec)):
        yield jsonl_windows(file_index, path, spec, split)


def _file_key(file_index: int, path: str, spec: JsonlSpec) -> dict:
    """A .jsonl file's part of its token cache keys (concat's as before packing was a choice)."""
    key = {"file_index": file_index, "split_key": split_key(path, spec.path), "format": spec.format,
           "val_fraction": spec.val_fraction,
           "fields": [spec.text_field, spec.prompt_field, spec.completion_field, spec.messages_field]}
    return key if spec.packing == "concat" else {**key, "packing": spec.packing}


def _first_id(file_index: int, split: str) -> int:
    return (file_index << 32) | (_VAL_BIT if split == "val" else 0)


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

