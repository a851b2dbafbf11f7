"""``data.packing: documents``: whole documents packed into windows, each document
apart (numpy only: no Ray, no torch).

`ConcatPacker` (``concat``) cuts one concatenated stream into windows, so a
document may start in one window and end in the next, and attends to the ones before
it. With `DocumentPacker` (``documents``) a window of ``seq_len`` tokens holds whole documents, chosen by best-fit
decreasing over a bounded buffer of `PACK_BUFFER` documents (so it streams): each
document goes into the open window with the least room that still fits it, the
longest first; a buffer's windows are handed back once it is full, or at the end. A
document longer than the window is truncated to it (`DocumentPacker.truncated` counts
them); the rest of a window is padding (the tokenizer's pad id, or EOS), loss mask 0.

Each window carries ``position_ids`` (int32, like ``tokens``): each document's
positions start at 0, and the padding's too. transformers turns position ids that
restart into a block-causal mask (masking_utils ``find_packed_sequence_indices``), so
a document attends only to itself (sdpa and eager: tests/test_packing.py; not flash, whose
varlen path reads them for a batch of one row only: models/hf.py `takes_position_ids`).
A document's first token is never a target (its loss mask is 0 there): alone, it has
no token before it to be predicted from.

The windows depend only on the documents in order and on `seq_len`: not on how many
documents are added at a time, nor on the chunk size.

>>> p = DocumentPacker(seq_len=6, first_id=0, rows=8, pad_id=0)
>>> p.add(np.array([1, 2, 3, 4, 5, 6, 7, 8]), np.ones(8), np.array([3, 5]))
[]
>>> w = p.end()[0]
>>> w["tokens"].tolist(), w["position_ids"].tolist(), w["loss_mask"].tolist()
([[4, 5, 6, 7, 8, 0], [1, 2, 3, 0, 0, 0]], [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 2]], [[0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable

import numpy as np

from raytrain_platform.data.specs import PACKINGS

__all__ = ["PACKINGS", "PACK_BUFFER", "PAIR_ARRAYS", "ConcatPacker", "DocumentPacker", "Packer", "make_packer",
           "window_arrays", "pad_id", "joined"]

# Documents held at once: best-fit over more of them pads less, and holds more in
# memory before the first window can be handed on.
PACK_BUFFER = 512
_CONCAT_ARRAYS = ("tokens", "loss_mask", "sample_id")
# A preference pair's row (`preference.py`): never packed, each side (n, seq_len).
PAIR_ARRAYS = ("chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask", "sample_id")


def window_arrays(packing: str, *, pairs: bool = False) -> tuple[str, ...]:
    """The arrays a window of `packing` has (what the tokenized dataset keeps of it);
    with `pairs`, a preference pair's row's (`PAIR_ARRAYS`), whatever the packing.

    >>> window_arrays("concat"), window_arrays("documents")[-1]
    (('tokens', 'loss_mask', 'sample_id'), 'position_ids')
    >>> window_arrays("concat", pairs=True)[:2]
    ('chosen_tokens', 'chosen_mask')
    """
    if pairs:
        return PAIR_ARRAYS
    return _CONCAT_ARRAYS + (("position_ids",) if packing == "documents" else ())


def pad_id(tok: Any) -> int:
    """What padding is filled with: the tokenizer's pad token, else its EOS (no loss
    counts it and no document attends to it: any id would do)."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


class ConcatPacker:
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


class DocumentPacker:
    """Documents added in order, packed whole into windows of `seq_len` tokens (see the
    module), `rows` windows to a chunk (the last may hold fewer), a chunk handed back as
    soon as it is full. Window ``i`` gets ``sample_id`` ``first_id | i``. The same
    `add`/`end` as `ConcatPacker`."""

    def __init__(self, seq_len: int, first_id: int, rows: int, pad_id: int, buffer: int = PACK_BUFFER):
        self.seq_len, self.first_id, self.rows, self.pad, self.buffer = seq_len, first_id, rows, pad_id, buffer
        self.docs: list[tuple[np.ndarray, np.ndarray]] = []
        self.ready: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # windows not yet in a chunk
        self.done = 0  # windows handed back
        self.truncated = 0  # documents longer than a window, cut to it

    def add(self, ids: list[int] | np.ndarray, mask: list[int] | np.ndarray,
            lengths: list[int] | np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
        """The chunks these documents complete (often none): `ids` and `mask` of one
        document, or with `lengths` of several, concatenated."""
        ids, mask = np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)
        ends = np.cumsum(lengths if lengths is not None else [ids.size])
        out: list[dict[str, np.ndarray]] = []
        for start, end in zip(np.concatenate([[0], ends[:-1]]), ends):
            if end - start > self.seq_len:
                self.truncated += 1
                end = start + self.seq_len
            self.docs.append((ids[start:end], mask[start:end]))
            if len(self.docs) == self.buffer:
                self._flush()
                out += self._chunks(last=False)
        return out

    def end(self) -> list[dict[str, np.ndarray]]:
        """The windows of the documents still held, in chunks."""
        self._flush()
        return self._chunks(last=True)

    def _flush(self) -> None:
        """Best-fit decreasing over the held documents: each, longest first (ties in
        order), into the window with the least room that fits it, else a new one."""
        bins: list[list[int]] = []
        room: list[tuple[int, int]] = []  # (free tokens, bin), sorted
        for i in sorted(range(len(self.docs)), key=lambda i: (-self.docs[i][0].size, i)):
            size = self.docs[i][0].size
            at = bisect.bisect_left(room, (size, -1))
            if at == len(room):
                bins.append([i])
                free, b = self.seq_len, len(bins) - 1
            else:
                free, b = room.pop(at)
                bins[b].append(i)
            bisect.insort(room, (free - size, b))
        self.ready += [self._window([self.docs[i] for i in b]) for b in bins]
        self.docs = []

    def _window(self, docs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        used = sum(d.size for d, _ in docs)
        pad = self.seq_len - used
        tokens = np.concatenate([d for d, _ in docs] + [np.full(pad, self.pad, np.int32)])
        mask = np.concatenate([m for _, m in docs] + [np.zeros(pad, np.uint8)])
        sizes = [d.size for d, _ in docs] + ([pad] if pad else [])
        starts = np.cumsum([0] + sizes[:-1])
        mask[starts[: len(docs)]] = 0  # a document's first token has nothing before it
        positions = np.arange(self.seq_len, dtype=np.int32) - np.repeat(starts, sizes).astype(np.int32)
        return tokens, mask, positions

    def _chunks(self, *, last: bool) -> list[dict[str, np.ndarray]]:
        out = []
        while len(self.ready) >= self.rows or (last and self.ready):
            part, self.ready = self.ready[: self.rows], self.ready[self.rows:]
            n = len(part)
            out.append({"tokens": np.stack([t for t, _, _ in part]), "loss_mask": np.stack([m for _, m, _ in part]),
                        "sample_id": np.int64(self.first_id) | np.arange(self.done, self.done + n, dtype=np.int64),
                        "position_ids": np.stack([p for _, _, p in part])})
            self.done += n
        return out


Packer = ConcatPacker | DocumentPacker


def make_packer(packing: str, seq_len: int, first_id: int, rows: int, pad: int) -> Packer:
    """The packer of `packing` (``concat`` or ``documents``), its windows' ids from
    `first_id` on, `rows` windows to a chunk, `pad` filling the rest of a window."""
    if packing == "concat":
        return ConcatPacker(seq_len, first_id, rows)
    return DocumentPacker(seq_len, first_id, rows, pad)


def joined(chunks: Iterable[dict[str, np.ndarray]], seq_len: int, packing: str = "concat", *,
           pairs: bool = False) -> dict[str, np.ndarray]:
    """Chunks of windows (or pair rows) as one batch (empty arrays of the right shapes if none)."""
    parts = list(chunks)
    if not parts:
        empty = {name: (np.zeros(0, np.int64) if name == "sample_id" else
                        np.zeros((0, seq_len), np.uint8 if name.endswith("mask") else np.int32))
                 for name in window_arrays(packing, pairs=pairs)}
        return empty
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
