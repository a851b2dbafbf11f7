"""Folders of text files through a real tokenizer (``data.source: text`` with
``data.tokenizer``): consecutive files grouped, each file one document (numpy only:
no Ray, no torch). A group is one piece of the tokenized dataset (`pieces.py`): its
documents are packed into windows together, and windows, not files, go to train or
val, by a hash of their id (``group_index << 32 | window``). Unlike the byte-level
source's windows and jsonl's records, which are split by their file's name
(`splits.split_keys`), a group's windows depend on which files the group holds: adding
a file can move windows of its group and of the groups after it between the splits.
"""

from __future__ import annotations

from typing import Iterator

from raytrain_platform.data.encode import encode_batches, load_tokenizer, text_documents
from raytrain_platform.data.specs import TokenSpec
from raytrain_platform.errors import DataError

__all__ = ["TEXT_GROUP_BYTES", "text_groups", "group_documents"]

# Consecutive text files are tokenized and packed together, about this many bytes to a
# group: one task each, and documents (files) pack across file ends, so short files
# are not each cut short by a dropped tail.
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


def group_documents(paths: tuple[str, ...], spec: TokenSpec) -> Iterator[tuple[list[int], list[int]]]:
    """Each file one document (BOS where the tokenizer has one, its text, EOS), in order."""
    tok = load_tokenizer(spec.tokenizer, need_chat_template=False)

    def texts() -> Iterator[str]:
        for path in paths:
            try:
                with open(path, "rb") as f:
                    yield f.read().decode("utf-8", errors="replace")
            except OSError as exc:
                raise DataError(f"{path}: cannot be read ({exc})") from None

    for batch in encode_batches(texts(), len):
        yield from text_documents(tok, batch)
