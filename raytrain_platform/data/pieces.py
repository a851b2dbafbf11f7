"""A tokenized source in pieces and blocks (numpy only: no Ray, no torch).

A *piece* is what is packed together: one .jsonl file (`jsonl.py`), one Arrow or
Parquet file of records (`tables.py`), or a group of consecutive text files
(`text_groups.py`). Its windows' ids are ``piece_index << 32 | window`` (a file of
records also sets bit 31 in its validation windows'). A *block* is what one task
tokenizes: a byte range of a .jsonl file, a whole table file, or a whole text group. The tokenized
dataset's pass (`prepared.py`) tokenizes blocks side by side (`tokenize_block`), then
packs each piece's blocks in order (`PiecePacker`); both are pure functions of their
input, so the windows never depend on how the work was spread.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from raytrain_platform.data import jsonl, tables
from raytrain_platform.data.encode import RecordError, encode_batches, encode_records, record_spec, tokenizer_for_format
from raytrain_platform.data.packing import PAIR_ARRAYS, Packer, make_packer, pad_id
from raytrain_platform.data.preference import empty_pairs, encode_pairs, pair_spec
from raytrain_platform.data.specs import SourceSpec, TokenSpec
from raytrain_platform.data.splits import filesystem, split_key, split_keys, split_mask, text_files
from raytrain_platform.data.text_groups import group_documents, text_groups
from raytrain_platform.errors import DataError

__all__ = ["VAL_BIT", "Piece", "Block", "Tokenized", "source_pieces", "tokenize_block", "error_text", "first_id",
           "PiecePacker"]

VAL_BIT = 1 << 31  # set in the sample_id of jsonl's validation windows: ids never collide across splits


@dataclass(frozen=True)
class Block:
    """What one task tokenizes: `length` bytes of a .jsonl file from `offset` (the lines
    that start there), or (`offset` and `length` 0) a text group whole."""

    piece: int
    index: int  # its place in the piece
    offset: int = 0
    length: int = 0


@dataclass(frozen=True)
class Piece:
    """A .jsonl file (`kind` jsonl), an Arrow or Parquet file of records (hf_dataset,
    parquet), or a group of text files (text), at `index` in the source's order; `size`:
    its bytes."""

    index: int
    kind: str
    paths: tuple[str, ...]
    size: int

    def blocks(self, block_bytes: int | None = None) -> list[Block]:
        """Its blocks, in order: byte ranges of a .jsonl file (`jsonl.BLOCK_BYTES` each,
        by default); a table file or a text group whole."""
        if self.kind != "jsonl":
            return [Block(self.index, 0)]
        ranges = jsonl.byte_ranges(self.size, block_bytes or jsonl.BLOCK_BYTES)
        return [Block(self.index, i, offset, length) for i, (offset, length) in enumerate(ranges)]


def _size(path: str) -> int:
    """A file's bytes (from its metadata; a URI's through its filesystem)."""
    fs, local = filesystem(path)
    info = fs.get_file_info(local)
    if info.size is None:
        raise DataError(f"{path}: cannot be read (no such file)")
    return info.size


def source_pieces(spec: SourceSpec) -> list[Piece]:
    """The pieces of a tokenized source, in order, from file metadata only."""
    if spec.kind == "jsonl":
        return [Piece(i, "jsonl", (path,), _size(path)) for i, path in enumerate(jsonl.jsonl_files(spec.path or ""))]
    if spec.kind in tables.TABLE_KINDS:
        files = tables.table_files(spec.kind, spec.path or "")
        tables.check_table_files(spec.kind, files, spec.token_spec())  # columns and types: metadata only
        return [Piece(i, spec.kind, (path,), _size(path)) for i, path in enumerate(files)]
    sized = text_files(spec.path, spec.glob, spec.max_files)
    sizes = dict(sized)
    return [Piece(i, "text", group, sum(sizes[p] for p in group)) for i, group in enumerate(text_groups(sized))]


@dataclass
class Tokenized:
    """A block's documents, concatenated: token ids, loss mask, each document's length
    and (jsonl) its line within the block; `lines`: the block's line count (its newlines);
    `error`: the first bad line's (index within the block, message), the documents
    before it kept. Preference pairs (`pairs`) are rows instead: ``PAIR_ARRAYS`` but
    ``sample_id`` (its ids are the packer's), ``ids`` and ``mask`` empty, ``lengths``
    each pair's tokens in its rows, and `cut` the pairs longer than a row."""

    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    lines_of: np.ndarray
    lines: int = 0
    error: tuple[int, str] | None = None
    pairs: dict[str, np.ndarray] | None = None
    cut: int = 0
    documents: int = field(init=False)

    def __post_init__(self) -> None:
        self.documents = int(self.lengths.size)

    @property
    def tokens(self) -> int:
        """Tokens this block adds to the dataset (a pair's: both its rows)."""
        return int(self.ids.size) if self.pairs is None else int(self.lengths.sum())

    def to_bytes(self) -> bytes:
        """As an .npz (no pickled objects)."""
        out = io.BytesIO()
        line, message = self.error if self.error else (-2, "")
        arrays: dict[str, Any] = {f"pair_{k}": v for k, v in (self.pairs or {}).items()}
        np.savez(out, ids=self.ids, mask=self.mask, lengths=self.lengths, lines_of=self.lines_of,
                 lines=np.int64(self.lines), error_line=np.int64(line), error=np.str_(message),
                 is_pairs=np.bool_(self.pairs is not None), cut=np.int64(self.cut), **arrays)
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Tokenized":
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            line = int(z["error_line"])
            pairs = ({k.removeprefix("pair_"): z[k] for k in z.files if k.startswith("pair_")}
                     if bool(z["is_pairs"]) else None)
            return cls(ids=z["ids"], mask=z["mask"], lengths=z["lengths"], lines_of=z["lines_of"],
                       lines=int(z["lines"]), error=(line, str(z["error"])) if line != -2 else None,
                       pairs=pairs, cut=int(z["cut"]))


def _arrays(docs: list[tuple[list[int], list[int]]], lines_of: list[int], lines: int,
            error: tuple[int, str] | None) -> Tokenized:
    # One array per document, then one copy: a generator over every token is many times slower.
    ids = np.concatenate([np.asarray(d, dtype=np.int32) for d, _ in docs]) if docs else np.zeros(0, np.int32)
    mask = np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in docs]) if docs else np.zeros(0, np.uint8)
    return Tokenized(ids, mask, np.array([len(d) for d, _ in docs], dtype=np.int64),
                     np.array(lines_of, dtype=np.int64), lines, error)


_TABLE_ROWS = 1024  # rows of a table file converted to records at a time


def _pair_arrays(parts: list[tuple[dict[str, np.ndarray], np.ndarray]], lines_of: list[int], lines: int,
                 error: tuple[int, str] | None, row_len: int) -> Tokenized:
    rows = [r for r, _ in parts]
    pairs = {k: np.concatenate([r[k] for r in rows]) if rows else empty_pairs(0, row_len)[k]
             for k in PAIR_ARRAYS if k != "sample_id"}
    n = len(pairs["chosen_tokens"])
    empty = np.zeros(0, np.int32)
    return Tokenized(empty, empty.astype(np.uint8), np.full(n, 2 * row_len, np.int64),
                     np.array(lines_of, dtype=np.int64), lines, error, pairs=pairs,
                     cut=int(sum(int(c.sum()) for _, c in parts)))


def _encoded(found: Iterator[tuple[int, dict, int]],
             encode: Callable[[list[dict]], Any]) -> tuple[list[Any], list[int], tuple[int, str] | None]:
    """`encode` of the records of `found`, a tokenizer batch at a time, up to the first
    bad one: (each batch's result, each record's line, (its line, message) or None)."""
    parts: list[Any] = []
    lines_of: list[int] = []
    try:
        for batch in encode_batches(found, lambda item: item[2]):
            try:
                parts.append(encode([r for _, r, _ in batch]))
            except RecordError as exc:  # records before it stay
                good = batch[:exc.index]
                parts.append(encode([r for _, r, _ in good]))
                lines_of += [i for i, _, _ in good]
                raise RecordError(batch[exc.index][0], str(exc)) from None
            lines_of += [i for i, _, _ in batch]
    except RecordError as exc:
        return parts, lines_of, (exc.index, str(exc))
    return parts, lines_of, None


def tokenize_block(piece: Piece, block: Block, spec: TokenSpec) -> Tokenized:
    """The block's documents (a text group's files; a byte range's or a table file's
    records, up to the first bad one, which is recorded, not raised: only the pass knows
    a line's number in its file), or with ``data.format: preference`` its pairs' rows."""
    if piece.kind == "text":
        return _arrays(list(group_documents(piece.paths, spec)), [], 0, None)
    if piece.kind == "jsonl":
        data = jsonl.read_lines(piece.paths[0], block.offset, block.length)
        found, lines = jsonl.records(data, spec), data.count(b"\n")
    else:
        found, lines = _table_records(piece, spec), 0
    tok = tokenizer_for_format(spec.tokenizer, spec.format)
    if spec.pairs:
        rows = pair_spec(spec)
        parts, lines_of, error = _encoded(found, lambda records: encode_pairs(
            tok, records, rows, np.zeros(len(records), np.int64)))
        return _pair_arrays(parts, lines_of, lines, error, spec.seq_len)
    parts, lines_of, error = _encoded(found, lambda records: encode_records(tok, records, spec))
    return _arrays([doc for part in parts for doc in part], lines_of, lines, error)


def _table_records(piece: Piece, spec: TokenSpec) -> Iterator[tuple[int, dict, int]]:
    """A table file's records; a bad row is a `RecordError` of its index."""
    fields = record_spec(spec).fields
    try:
        for first, rows in tables.table_blocks(piece.kind, piece.paths[0], _TABLE_ROWS,
                                              columns=[*fields[0], *fields[1]]):
            yield from tables.table_records(piece.paths[0], first, rows, spec)
    except DataError as exc:  # it names its file and row already
        raise RecordError(-1, str(exc)) from None


def error_text(piece: Piece, lines_before: int, index: int, message: str) -> str:
    """A bad record's one line: its file and line (`lines_before` its block, `index` in
    it), or as a table's reader said it (``-1``: it names its file and row)."""
    if index < 0:
        return message
    if piece.kind == "jsonl":
        return f"{piece.paths[0]}:{lines_before + index + 1}: {message}"
    return f"{piece.paths[0]}: row {lines_before + index + 1}: {message}"


def first_id(piece_index: int, split: str) -> int:
    """The id of a jsonl piece's first `split` window (its others count up from it)."""
    return (piece_index << 32) | (VAL_BIT if split == "val" else 0)


class PiecePacker:
    """One piece's tokenized blocks, added in order, packed into windows: a .jsonl
    file's documents go to train or val by a hash of the file's name under the source's
    root and their line (`splits.split_keys`) and are packed per split; a text group's
    are packed together and its windows go to a split by their ids. Preference pairs
    go to a split by the same rule and are never packed: the ``i``-th pair of a split
    is its row ``first_id(piece, split) | i``."""

    def __init__(self, piece: Piece, spec: TokenSpec, rows: int):
        self.piece, self.spec = piece, spec
        pad = pad_id(tokenizer_for_format(spec.tokenizer, spec.format))
        splits = () if spec.pairs else ("all",) if piece.kind == "text" else ("train", "val")
        self.packers: dict[str, Packer] = {
            s: make_packer(spec.packing, spec.seq_len, piece.index << 32 if s == "all" else first_id(piece.index, s),
                           rows, pad) for s in splits}
        self.pairs = {"train": 0, "val": 0}  # preference: pairs handed back per split
        self.cut = 0  # preference: pairs longer than a row, cut to it
        self.line = 0  # lines of the blocks added so far
        self.key = split_key(piece.paths[0], spec.path) if piece.kind != "text" else 0
        self.documents = self.tokens = 0

    def error(self, tokenized: Tokenized) -> str | None:
        """The one-line error of a block's bad line (its file and line), if it has one."""
        if tokenized.error is None:
            return None
        return error_text(self.piece, self.line, *tokenized.error)

    def add(self, tokenized: Tokenized) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        """(split, chunk of windows) that this block completes; DataError at a bad line."""
        said = self.error(tokenized)
        self.documents += tokenized.documents
        self.tokens += tokenized.tokens
        if tokenized.pairs is not None:
            yield from self._pair_rows(tokenized)
        elif self.piece.kind == "text":
            yield from self._split(self.packers["all"].add(tokenized.ids, tokenized.mask, tokenized.lengths))
        else:
            keys = split_keys(self.key, self.line + tokenized.lines_of)
            in_val = split_mask(keys, self.spec.val_fraction, "val")
            per_token = np.repeat(in_val, tokenized.lengths)
            for split, docs, tokens in (("train", ~in_val, ~per_token), ("val", in_val, per_token)):
                if docs.any():
                    for chunk in self.packers[split].add(tokenized.ids[tokens], tokenized.mask[tokens],
                                                         tokenized.lengths[docs]):
                        yield split, chunk
        self.line += tokenized.lines
        if said:
            raise DataError(said)

    def _pair_rows(self, tokenized: Tokenized) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        """(split, rows) of a block's pairs, each given the next id of its split."""
        assert tokenized.pairs is not None
        self.cut += tokenized.cut
        keys = split_keys(self.key, self.line + tokenized.lines_of)
        in_val = split_mask(keys, self.spec.val_fraction, "val")
        for split, keep in (("train", ~in_val), ("val", in_val)):
            n = int(keep.sum())
            if n:
                done = self.pairs[split]
                ids = np.int64(first_id(self.piece.index, split)) | np.arange(done, done + n, dtype=np.int64)
                yield split, {**{k: v[keep] for k, v in tokenized.pairs.items()}, "sample_id": ids}
                self.pairs[split] = done + n

    def end(self) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        """The chunks of what is still held."""
        if self.piece.kind == "text":
            yield from self._split(self.packers["all"].end())
            return
        for split, packer in self.packers.items():
            for chunk in packer.end():
                yield split, chunk

    def _split(self, chunks: list[dict[str, np.ndarray]]) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        for chunk in chunks:
            in_val = split_mask(chunk["sample_id"], self.spec.val_fraction, "val")
            for split, keep in (("train", ~in_val), ("val", in_val)):
                if keep.any():
                    yield split, {k: v[keep] for k, v in chunk.items()}

    @property
    def truncated(self) -> int:
        """Documents longer than a window, cut to it (``data.packing: documents``); pairs
        longer than a row (preference)."""
        return self.cut + sum(p.truncated for p in self.packers.values())

    def windows(self, split: str) -> int:
        """Windows (pairs) of `split` handed back so far (a text group's: counted by the caller)."""
        return self.pairs[split] if self.spec.pairs else self.packers[split].done
