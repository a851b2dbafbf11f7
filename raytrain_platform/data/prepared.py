"""A tokenized dataset as written by the tokenizing pass (`tokenize_pass.py`): its key,
its manifest, and its windows in Parquet (numpy and pyarrow only: no Ray, no torch).

Layout under the cache root (``data.cache_path``, default ``<run.storage_path>/datasets``;
a folder, a shared mount or a pyarrow URI)::

    <kind>-<key>/manifest.json                    what was written, with exact window counts
    <kind>-<key>/<attempt>/<split>/<piece>.parquet each piece's windows of the split, in order

The key (`dataset_key`) is a hash of everything the windows depend on: the files'
identity (path, size, modification time), the tokenizer's files, the format and field
names, seq_len, the split and packing, and the library versions. A run, its resume,
every sweep trial and every node find the same manifest and read these files; nothing
is tokenized twice. The manifest is written last: a folder without one is an unfinished
pass, which the next pass writes again (under a new attempt).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np

from raytrain_platform.data.encode import record_spec
from raytrain_platform.data.packing import window_arrays
from raytrain_platform.data.pieces import Piece
from raytrain_platform.data.specs import SourceSpec
from raytrain_platform.data.splits import filesystem, rebatch
from raytrain_platform.errors import ConfigError, DataError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["SCHEME", "MANIFEST", "Manifest", "file_state", "dataset_key", "dataset_dir", "find_manifest", "load_manifest", "check_cache_root",
           "WindowWriter", "read_windows", "iter_range", "read_range", "join"]

SCHEME = 1  # the layout and window rules; part of the key
MANIFEST = "manifest.json"
# Windows per row group: about this many tokens (a read is at least one row group).
_ROW_GROUP_TOKENS = 1 << 20
# A tokenizer's own files (a model folder also holds weights, which are not hashed).
_TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template",
                       "spiece", "sentencepiece")


def join(root: str, *parts: str) -> str:
    """`parts` below `root`, a local path or a URI (whose query stays at the end)."""
    base, mark, query = root.partition("?") if "://" in root else (root, "", "")
    return "/".join([base.rstrip("/"), *parts]) + mark + query


def _tokenizer_state(folder: str) -> list:
    """(name, sha256) of the tokenizer's own files in `folder`."""
    out = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file() and (entry.name.startswith(_TOKENIZER_PREFIXES) or entry.name.endswith(".tiktoken")):
            with open(entry.path, "rb") as f:
                out.append((entry.name, hashlib.sha256(f.read()).hexdigest()))
    return out


def file_state(path: str) -> tuple[str, int, int]:
    """A file's identity in a key: its path, size and modification time (ns; -1 where the
    file system keeps none), a local path or a URI."""
    fs, local = filesystem(path)
    info = fs.get_file_info(local)
    mtime = info.mtime_ns if info.mtime_ns is not None else -1
    return path, info.size or 0, mtime


# The modules whose code decides the windows: a change to any tokenizes again.
_WINDOW_CODE = ("encode", "packing", "pieces", "jsonl", "tables", "text_groups", "splits")


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    """The libraries' versions and a hash of this package's tokenizing and packing code."""
    import importlib
    import importlib.metadata

    code = hashlib.sha256()
    for name in _WINDOW_CODE:
        with open(importlib.import_module(f"raytrain_platform.data.{name}").__file__ or "", "rb") as f:
            code.update(f.read())
    versions = {p: importlib.metadata.version(p) for p in ("transformers", "tokenizers", "jinja2")}
    return {**versions, "code": code.hexdigest()[:16], "scheme": str(SCHEME)}


def dataset_key(spec: SourceSpec, pieces: list[Piece]) -> str:
    """A hash of everything the windows depend on (see the module)."""
    t = spec.token_spec()
    what = {"kind": spec.kind, "record": dataclasses.asdict(record_spec(t)),  # the format and its field names
            "root": t.path, "seq_len": t.seq_len, "val_fraction": t.val_fraction, "packing": t.packing,
            "pieces": [[file_state(p) for p in piece.paths] for piece in pieces],
            "tokenizer": _tokenizer_state(t.tokenizer), "versions": _versions()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def dataset_dir(spec: SourceSpec, key: str) -> str:
    """Where the dataset of `key` is written under the spec's cache root."""
    assert spec.cache_root, "SourceSpec.from_config sets the cache root of a tokenized source"
    return join(spec.cache_root, f"{spec.kind}-{key}")


def check_cache_root(root: str) -> None:
    """ConfigError unless this process can create and write files under `root`."""
    allowed = "a folder or pyarrow URI this process can write (data.cache_path; default <run.storage_path>/datasets)"
    try:
        fs, local = filesystem(root, field="data.cache_path")
        fs.create_dir(local, recursive=True)
        probe = local.rstrip("/") + f"/.rtp-write-check-{uuid.uuid4().hex}"
        with fs.open_output_stream(probe) as f:
            f.write(b"ok")
        fs.delete_file(probe)
    except (OSError, DataError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("data.cache_path", root, f"{allowed}; {reason}") from None


@dataclass(frozen=True)
class Manifest:
    """A written dataset: its folder, and what `manifest.json` says."""

    dir: str
    content: dict

    @property
    def windows(self) -> dict[str, int]:
        return self.content["windows"]

    def pieces(self, split: str) -> list[int]:
        """Indexes (into ``content["pieces"]``) of the pieces with `split` windows, in order."""
        return [i for i, p in enumerate(self.content["pieces"]) if p[split]]

    def file(self, piece: int, split: str) -> str:
        entry = self.content["pieces"][piece]
        return join(self.dir, self.content["attempt"], split, f"{entry['index']:06d}.parquet")

    def write(self) -> str:
        """Writes manifest.json (last: it marks the dataset whole); returns its path."""
        fs, local = filesystem(join(self.dir, MANIFEST))
        fs.create_dir(local.rsplit("/", 1)[0], recursive=True)
        tmp = local + f".tmp-{uuid.uuid4().hex}"
        with fs.open_output_stream(tmp) as f:
            f.write(json.dumps(self.content, indent=1).encode())
        fs.move(tmp, local)
        return join(self.dir, MANIFEST)


def find_manifest(directory: str) -> Manifest | None:
    """The dataset written in `directory`, or None where no pass has finished there."""
    fs, local = filesystem(join(directory, MANIFEST))
    try:
        with fs.open_input_stream(local) as f:
            return Manifest(directory, json.loads(f.read()))
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=16)
def load_manifest(directory: str) -> Manifest:
    """The dataset written in `directory` (read once per process); DataError where none is."""
    found = find_manifest(directory)
    if found is None:
        raise DataError(f"{directory}: no tokenized dataset here (its pass did not finish, or it was deleted)")
    return found


def _fixed(array: np.ndarray) -> "pa.Array":
    import pyarrow as pa

    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(array).reshape(-1)), array.shape[1])


class WindowWriter:
    """A piece's windows of one split, written to one Parquet file as they come (opened
    at the first window: a piece without any writes no file); with `pairs`, its
    preference pairs' rows (`packing.PAIR_ARRAYS`: two sides of `seq_len` tokens)."""

    def __init__(self, path: str, seq_len: int, packing: str, *, pairs: bool = False):
        self.path, self.names = path, window_arrays(packing, pairs=pairs)
        self.rows_per_group = max(1, _ROW_GROUP_TOKENS // (seq_len * (2 if pairs else 1)))
        self.pending: list[dict[str, np.ndarray]] = []
        self.held = self.rows = 0
        self.writer = None
        self.bytes = 0

    def write(self, chunk: dict[str, np.ndarray]) -> None:
        n = len(chunk["sample_id"])
        if not n:
            return
        self.pending.append(chunk)
        self.held += n
        if self.held >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.pending:
            return
        batch = {k: np.concatenate([c[k] for c in self.pending]) for k in self.names}
        table = pa.table({k: (_fixed(v) if v.ndim == 2 else pa.array(v)) for k, v in batch.items()})
        if self.writer is None:
            fs, local = filesystem(self.path)
            fs.create_dir(local.rsplit("/", 1)[0], recursive=True)
            self.sink = fs.open_output_stream(local)
            self.writer = pq.ParquetWriter(self.sink, table.schema)
        writer: pq.ParquetWriter = self.writer
        writer.write_table(table, row_group_size=len(batch["sample_id"]))
        self.rows += len(batch["sample_id"])
        self.pending, self.held = [], 0

    def close(self) -> int:
        """Writes what is held; returns the rows written."""
        self._flush()
        if self.writer is not None:
            self.writer.close()
            self.bytes = self.sink.tell()
            self.sink.close()
        return self.rows


def _numpy(table: "pa.Table") -> dict[str, np.ndarray]:
    out = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if hasattr(column.type, "list_size"):
            out[name] = column.flatten().to_numpy().reshape(len(column), column.type.list_size)
        else:
            out[name] = column.to_numpy()
    return out


def read_windows(manifest: Manifest, piece: int, split: str, rows: int) -> Iterator[dict[str, np.ndarray]]:
    """A piece's `split` windows in order, `rows` at a time (the last may hold fewer)."""
    import pyarrow.parquet as pq

    path = manifest.file(piece, split)
    fs, local = filesystem(path)
    try:
        with fs.open_input_file(local) as f:
            reader = pq.ParquetFile(f)
            groups = (_numpy(reader.read_row_group(g)) for g in range(reader.num_row_groups))
            yield from rebatch(groups, rows, tail=True)
    except OSError as exc:
        raise DataError(f"{path}: the tokenized dataset cannot be read ({exc}); delete {manifest.dir} to write "
                        "it again") from None


def iter_range(manifest: Manifest, split: str, start: int, count: int) -> Iterator[dict[str, np.ndarray]]:
    """Windows ``start`` to ``start + count`` (exclusive) of the whole `split`, its
    pieces in order, one row group's share at a time (``0 <= start``, ``start + count <=
    manifest.windows[split]``): only the row groups that hold them are read."""
    import pyarrow.parquet as pq

    first = 0
    for piece in manifest.pieces(split):
        n = manifest.content["pieces"][piece][split]
        lo, hi = max(start, first), min(start + count, first + n)
        if lo < hi:
            path = manifest.file(piece, split)
            fs, local = filesystem(path)
            try:
                with fs.open_input_file(local) as f:
                    reader = pq.ParquetFile(f)
                    row = 0
                    for g in range(reader.num_row_groups):
                        rows = reader.metadata.row_group(g).num_rows
                        a, b = max(lo - first, row), min(hi - first, row + rows)
                        if a < b:
                            group = _numpy(reader.read_row_group(g))
                            yield {k: v[a - row:b - row] for k, v in group.items()}
                        row += rows
            except OSError as exc:
                raise DataError(f"{path}: the tokenized dataset cannot be read ({exc}); delete {manifest.dir} to "
                                "write it again") from None
        first += n
        if first >= start + count:
            break


def read_range(manifest: Manifest, split: str, start: int, count: int) -> dict[str, np.ndarray]:
    """`iter_range`'s windows as one batch: what a mixture draws from a source."""
    parts = list(iter_range(manifest, split, start, count))
    if not parts:
        raise ValueError(f"windows {start}..{start + count} of {split} are not in {manifest.dir}")
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
