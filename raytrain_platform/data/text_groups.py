"""Folders of text files through a real tokenizer (``data.source: text`` with
``data.tokenizer``): consecutive files grouped, each file one document, the group's
documents packed into `jsonl.JsonlSpec`'s windows (numpy only: no Ray, no torch). Windows,
not files, go to train or val, by a hash of their id (``group_index << 32 | window``).
Unlike the byte-level source's windows and jsonl's records, which are split by their
file's name (`sources.split_keys`), a group's windows depend on which files the group
holds: adding a file can move windows of its group and of the groups after it between
the splits.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from raytrain_platform.data.encode import _batches, _text_docs, load_tokenizer
from raytrain_platform.data.jsonl import JsonlSpec, _check_split, _joined, _pack, stream_rows
from raytrain_platform.data.sources import split_mask
from raytrain_platform.errors import DataError

__all__ = ["TEXT_GROUP_BYTES", "text_groups", "stream_text_group_windows", "text_group_windows"]

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
    """One group of text files packed into windows, the `split` part of them: windows
    (not files) go to train or val by a hash of their ``group_index << 32 |
    window_index`` id. Same arrays as `jsonl.jsonl_windows`."""
    return _joined(stream_text_group_windows(group_index, paths, spec, split), spec.seq_len)


def _group_key(group_index: int, spec: JsonlSpec) -> dict:
    """A text group's part of its windows' keys (its token sums need none: the group's
    files are the whole key)."""
    return {"text_group": group_index, "val_fraction": spec.val_fraction}
