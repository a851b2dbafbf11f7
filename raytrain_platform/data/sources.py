"""Data sources as plain functions over numpy and pyarrow (no Ray, no torch).

Ray Data pipelines (`ray_data.py`) and the Ray-free torchrun reader (`local.py`)
both call these, so the two paths see the same samples in the same order.

Every sample has a stable 64-bit ``sample_id``: text windows are
``file_index << 32 | window_index``, synthetic rows are their index, Parquet rows
their position across the sorted files (`parquet.py`). The validation split holds out the
samples whose hash falls under ``val_fraction``: for synthetic rows a hash of the id; for
a file's windows, lines or rows a hash of the file's path under ``data.path`` and the
sample's place in that file (`split_keys`), so the split never depends on world size, and
a sample keeps its split when files are added or removed beside its own (Parquet with
``data.val_path``: every row of that path, ids from ``1 << 62`` on).

With a tokenizer (``data.tokenizer``, or the model family's own), text and jsonl are
*tokenized* sources (`jsonl.py`, `text_groups.py`; counted and read by piece in
`pieces.py`): int32 token windows with a ``loss_mask``, read one
piece at a time (a .jsonl file, or a group of consecutive text files); a piece's
windows are ``piece_index << 32 | window_index`` (jsonl's validation windows also set
bit 31). Without a tokenizer, text is bytes as above. A ``preference`` jsonl source
gives pairs instead of windows (`pair_reader.py`): the ``i``-th pair of a file's split is
``file_index << 32 | i``, by the same rule.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from raytrain_platform.errors import DataError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from raytrain_platform.config import JobConfig
    from raytrain_platform.data.jsonl import JsonlSpec

__all__ = [
    "SourceSpec",
    "DataInfo",
    "default_text_root",
    "split_mask",
    "split_key",
    "split_keys",
    "split_by_file",
    "VAL_SPLIT",
    "filesystem",
    "glob_match",
    "text_files",
    "text_windows",
    "synthetic_rows",
    "token_pieces",
    "rebatch",
    "token_windows",
    "describe",
    "iter_source",
    "head",
]

_SYNTH_CHUNK = 256  # rows generated together from one seeded RNG


def default_text_root() -> str:
    """The Python standard library's own sources: real text every machine has."""
    return sysconfig.get_paths()["stdlib"]


def filesystem(path: str, field: str = "data.path") -> tuple["pafs.FileSystem", str]:
    """A local path or a pyarrow filesystem URI (``s3://...``) as (filesystem, path in
    it); one `DataError` naming `field` when pyarrow cannot make sense of it."""
    import pyarrow.fs as pafs

    try:
        if "://" in path:
            return pafs.FileSystem.from_uri(path)
        return pafs.LocalFileSystem(), os.path.abspath(path)
    except Exception as exc:  # pyarrow raises several types for bad URIs
        raise DataError(f"{field} = {path!r}: not a readable path or filesystem URI ({exc})") from None


def split_mask(ids: np.ndarray, val_fraction: float, split: str) -> np.ndarray:
    """True where a sample belongs to `split` ("train" | "val"), from a hash of its id."""
    z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)  # splitmix64 finaliser
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    is_val = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < val_fraction
    return is_val if split == "val" else ~is_val


# The validation split's scheme, recorded in each checkpoint: 2 deals a file's samples by
# the file's name and their place in it (`split_keys`); before it (none recorded), by the
# file's index among the sorted files.
VAL_SPLIT = 2


def split_by_file(spec: "SourceSpec") -> bool:
    """Whether `spec`'s validation split is dealt by `split_keys` (scheme 2): byte-level
    text, Parquet without data.val_path and jsonl, with a validation split at all."""
    by_file = spec.kind == "jsonl" or (spec.kind == "text" and not spec.tokenized) or (
        spec.kind == "parquet" and not spec.val_path)
    return by_file and spec.val_fraction > 0


def split_key(path: str, root: str) -> int:
    """A 32-bit number for a file, from its path under the source's `root` (its own name
    where `root` is the file; a URI's query is left out): what `split_keys` puts above
    each sample's place in the file. It names the file, not its place among the others,
    so adding, removing or renaming *other* files moves no sample between the splits.

    >>> split_key("/d/a/x.jsonl", "/d") == split_key("/e/a/x.jsonl", "/e/") == split_key("s3://b/d/a/x.jsonl?r=1", "s3://b/d?r=1")
    True
    >>> split_key("/d/x.jsonl", "/d/x.jsonl") == split_key("/d/x.jsonl", "/d")
    True
    >>> split_key("/d/run?1/a.txt", "/d/run?1") == split_key("/d/run?1/b.txt", "/d/run?1")  # no query here
    False
    """
    if "://" in root:  # a URI: its query follows each file's path (`jsonl.jsonl_files`)
        path, root = path.partition("?")[0], root.partition("?")[0].rstrip("/")
    else:  # a local path, or a path in a filesystem (Parquet's bucket/key)
        path, root = os.path.abspath(path), os.path.abspath(root)
    if path == root:
        name = path.rsplit("/", 1)[-1]
    elif path.startswith(root.rstrip("/") + "/"):
        name = path[len(root.rstrip("/")) + 1:]
    else:  # every caller lists its files under the root
        raise ValueError(f"{path!r} is not under the source's path {root!r}")
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=4).digest(), "big")


def split_keys(key: int, positions: np.ndarray) -> np.ndarray:
    """``key << 32 | position`` (uint64) for samples at `positions` of the file `key`
    names (`split_key`): what `split_mask` hashes to deal them to train or val."""
    return (np.uint64(key) << np.uint64(32)) | positions.astype(np.uint64)


@dataclass(frozen=True)
class SourceSpec:
    """Everything a reader needs, as plain picklable values (shipped to Ray tasks)."""

    kind: str  # text | synthetic | parquet | jsonl
    task: str  # lm | classification | regression
    val_fraction: float
    seq_len: int = 0  # lm: tokens per sample (data.seq_len + 1)
    path: str | None = None
    val_path: str | None = None
    glob: str = "**/*.py"
    max_files: int | None = None
    num_samples: int = 0
    num_features: int = 0
    num_classes: int = 0
    seed: int = 0
    feature_columns: tuple[str, ...] = ()
    label_column: str = "label"
    max_read_rows_per_s: float | None = None  # a read task sleeps to stay under this rate
    tokenizer: str | None = None  # text, jsonl: a local tokenizer folder (None: text as bytes)
    format: str = "text"  # jsonl: text | prompt_completion | chat | preference
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    chosen_field: str = "chosen"  # jsonl preference
    rejected_field: str = "rejected"
    window_cache: bool = True  # tokenized: keep packed windows in the token cache
    tokenize_processes: int | str = "auto"  # tokenized: the driver's count pass's
    packing: str = "concat"  # jsonl: documents | concat (`packing.py`)

    @classmethod
    def from_config(cls, cfg: "JobConfig") -> "SourceSpec":
        d, m, tokens = cfg.data, cfg.model, cfg.seq_len  # tokens: None unless lm (then required)
        seq_len = tokens + 1 if tokens is not None else 0  # + 1: targets are inputs shifted by one
        # The default text root resolved here, on the driver: every process then splits
        # (and reads) the files the driver listed under the same root.
        path = d.path if d.path or d.source != "text" else default_text_root()
        return cls(kind=d.source, task=m.resolved_task, val_fraction=d.val_fraction, seq_len=seq_len,
                   path=path, val_path=d.val_path, glob=d.glob, max_files=d.max_files,
                   num_samples=d.num_samples, num_features=d.num_features,
                   num_classes=d.num_classes, seed=d.seed,
                   feature_columns=tuple(d.feature_columns or ()), label_column=d.label_column,
                   max_read_rows_per_s=d.max_read_rows_per_s, tokenizer=d.tokenizer_for(m),
                   format=d.format, text_field=d.text_field, prompt_field=d.prompt_field,
                   completion_field=d.completion_field, messages_field=d.messages_field,
                   chosen_field=d.chosen_field, rejected_field=d.rejected_field, window_cache=d.window_cache, tokenize_processes=d.tokenize_processes,
                   packing=d.resolved_packing)

    @property
    def pairs(self) -> bool:
        """``data.format: preference``: rows of preference pairs (`pair_reader.py`), not windows."""
        return self.kind == "jsonl" and self.format == "preference"

    @property
    def tokenized(self) -> bool:
        """jsonl, or text read through a tokenizer (token ids and a loss mask, not bytes)."""
        return self.kind == "jsonl" or (self.kind == "text" and self.tokenizer is not None)

    def token_spec(self) -> "JsonlSpec":
        """What `jsonl.py` tokenizes and packs with (a tokenized source only)."""
        from raytrain_platform.data.jsonl import JsonlSpec

        assert self.tokenized and self.tokenizer, self
        return JsonlSpec(path=self.path or default_text_root(), tokenizer=self.tokenizer,
                         format=self.format if self.kind == "jsonl" else "text",
                         seq_len=self.seq_len, val_fraction=self.val_fraction,
                         text_field=self.text_field, prompt_field=self.prompt_field,
                         completion_field=self.completion_field, messages_field=self.messages_field,
                         chosen_field=self.chosen_field, rejected_field=self.rejected_field,
                         window_cache=self.window_cache, tokenize_processes=self.tokenize_processes,
                         packing=self.packing if self.kind == "jsonl" else "concat")

    def throttle(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sleep as long as reading these rows takes at ``max_read_rows_per_s`` (no-op
        without a limit): slow storage on demand, which `rtp doctor`'s tests rely on."""
        if self.max_read_rows_per_s:
            time.sleep(rows["sample_id"].shape[0] / self.max_read_rows_per_s)
        return rows


@dataclass(frozen=True)
class DataInfo:
    """What the driver knows about the data before any training worker starts."""

    num_train: int
    num_val: int
    num_features: int = 0  # tabular
    num_classes: int = 0  # classification
    feature_columns: tuple[str, ...] = ()
    truncated: int = 0  # data.packing documents: documents longer than a window, cut to it; preference: pairs


# ---------------------------------------------------------------- text


def glob_match(parts: tuple[str, ...], pattern: str) -> bool:
    """Whether a relative path (its folder and file names) matches a ``/``-separated
    glob: ``*``, ``?`` and ``[...]`` match within one name, ``**/`` zero or more
    folders, and a final ``**`` everything below.

    >>> [glob_match(p, "**/*.py") for p in [("a.py",), ("x", "y", "a.py"), ("a.txt",)]]
    [True, True, False]
    >>> [glob_match(p, "sub/*.txt") for p in [("sub", "a.txt"), ("a.txt",), ("sub", "x", "a.txt")]]
    [True, False, False]
    >>> [glob_match(p, "sub/**") for p in [("sub", "a"), ("sub", "x", "b"), ("other", "a"), ("sub",)]]
    [True, True, False, False]
    """
    names = pattern.strip("/").split("/")

    def match(i: int, j: int) -> bool:  # parts[i:] against names[j:]
        if j == len(names):
            return i == len(parts)
        if names[j] == "**":
            last = j == len(names) - 1  # a final ** is one or more names, not zero
            return any(match(k, j + 1) for k in range(i + last, len(parts) + 1))
        return i < len(parts) and fnmatch.fnmatch(parts[i], names[j]) and match(i + 1, j + 1)

    return match(0, 0)


def text_files(spec: SourceSpec) -> list[tuple[str, int]]:
    """(path, size) of the text files, sorted; site-packages are never part of a corpus."""
    root = Path(spec.path or default_text_root())
    if not root.is_dir():
        raise DataError(f"data.path = {str(root)!r}: expected an existing folder of text files")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages",
                                                               "__pycache__"))
        for name in filenames:
            full = os.path.join(dirpath, name)
            if glob_match(Path(os.path.relpath(full, root)).parts, spec.glob):
                found.append(full)
    found.sort()
    if spec.max_files is not None:
        found = found[: spec.max_files]
    try:
        files = [(p, os.path.getsize(p)) for p in found]
    except OSError as exc:  # a dangling symlink, a file removed meanwhile, no permission
        raise DataError(f"data.path = {str(root)!r}: {exc.filename}: cannot be read ({exc.strerror})") from None
    if not files:
        raise DataError(f"data.path = {str(root)!r}: no files match data.glob = {spec.glob!r}")
    return files


def text_window_ids(file_index: int, size: int, seq_len: int) -> np.ndarray:
    n = size // seq_len  # non-overlapping windows; the tail of each file is dropped
    return (np.int64(file_index) << np.int64(32)) | np.arange(n, dtype=np.int64)


def _text_split(path: str, size: int, spec: SourceSpec, split: str) -> np.ndarray:
    """Which of the file's windows belong to `split`, by the file's name and their place."""
    n = size // spec.seq_len
    keys = split_keys(split_key(path, spec.path or default_text_root()), np.arange(n))
    return split_mask(keys, spec.val_fraction, split)


def text_windows(file_index: int, path: str, spec: SourceSpec, split: str) -> dict[str, np.ndarray]:
    """One file cut into byte windows of seq_len tokens: tokens (n, seq_len) uint8."""
    raw = np.fromfile(path, dtype=np.uint8)
    n = raw.size // spec.seq_len
    ids = text_window_ids(file_index, raw.size, spec.seq_len)
    keep = _text_split(path, raw.size, spec, split)
    tokens = raw[: n * spec.seq_len].reshape(n, spec.seq_len)[keep]
    return spec.throttle({"tokens": tokens, "sample_id": ids[keep]})


# ---------------------------------------------------------------- tokenized (text, jsonl)


def token_pieces(spec: SourceSpec) -> list[tuple[str, ...]]:
    """The read tasks of a tokenized source, in order: one .jsonl file each, or a group
    of consecutive text files (`text_groups.text_groups`)."""
    from raytrain_platform.data import jsonl, text_groups

    if spec.kind == "jsonl":
        return [(path,) for path in jsonl.jsonl_files(spec.token_spec())]
    return text_groups.text_groups(text_files(spec))


def rebatch(pieces: Iterable[dict[str, np.ndarray]], rows: int, *,
            tail: bool) -> Iterator[dict[str, np.ndarray]]:
    """Cut a stream of variable-size pieces into batches of exactly `rows` rows, in
    order; the last, shorter batch is yielded when `tail`, dropped otherwise.

    >>> parts = [{"x": np.arange(3)}, {"x": np.arange(3, 4)}, {"x": np.arange(4, 9)}]
    >>> [b["x"].tolist() for b in rebatch(parts, 4, tail=True)]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    >>> [b["x"].tolist() for b in rebatch(parts, 4, tail=False)]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    buf: list[dict[str, np.ndarray]] = []
    have = 0
    for piece in pieces:
        n = len(next(iter(piece.values())))
        if not n:
            continue
        buf.append(piece)
        have += n
        while have >= rows:
            joined = {k: np.concatenate([p[k] for p in buf]) for k in buf[0]} if len(buf) > 1 else buf[0]
            yield {k: v[:rows] for k, v in joined.items()}
            have -= rows
            buf = [{k: v[rows:] for k, v in joined.items()}] if have else []
    if tail and have:
        yield {k: np.concatenate([p[k] for p in buf]) for k in buf[0]}


def token_windows(index: int, piece: tuple[str, ...], spec: SourceSpec, split: str, *,
                  rows: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Piece `index` tokenized and packed, the `split` part of it, about `rows` windows
    at a time (default `jsonl.stream_rows`) as it is tokenized, or from the token cache
    (`pieces.piece_windows`): tokens int32 and loss_mask uint8 (n, seq_len), sample_id (n,)."""
    from raytrain_platform.data import pair_reader, pieces

    if spec.pairs:  # issue 49's hook: pairs are read by pair_reader (no packing, no token cache)
        for chunk in pair_reader.stream_pair_rows(index, piece[0], spec.token_spec(), split, rows=rows):
            yield spec.throttle(chunk)
        return
    for chunk in pieces.piece_windows(index, piece, spec.token_spec(), split, text=spec.kind != "jsonl", rows=rows):
        yield spec.throttle(chunk)


def _count_tokenized(spec: SourceSpec) -> DataInfo:
    """Exact window counts: tokenizes everything once, on the driver (before Ray)."""
    from raytrain_platform.data import pair_reader, pieces

    if spec.pairs:  # issue 49's hook: every pair tokenized once on the driver (pair_reader)
        train, val, truncated = pair_reader.count_pairs(spec.token_spec())
        return DataInfo(num_train=train, num_val=val, truncated=truncated)
    if spec.kind == "jsonl":
        counted = pieces.count_packed(spec.token_spec())
        return DataInfo(num_train=counted.train, num_val=counted.val, truncated=counted.truncated)
    train, val = pieces.count_text_windows(token_pieces(spec), spec.token_spec())
    return DataInfo(num_train=train, num_val=val)


# ---------------------------------------------------------------- synthetic


def _synthetic_chunk(chunk: int, spec: SourceSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([spec.seed, chunk])
    if spec.task == "lm":
        # Learnable structure: each token follows from the previous by a fixed random
        # permutation, with 10% of positions replaced by noise.
        perm = np.random.default_rng([spec.seed, 1 << 30]).permutation(256)
        toks = np.empty((_SYNTH_CHUNK, spec.seq_len), dtype=np.uint8)
        toks[:, 0] = rng.integers(0, 256, _SYNTH_CHUNK)
        noise = rng.random((_SYNTH_CHUNK, spec.seq_len)) < 0.1
        rand = rng.integers(0, 256, (_SYNTH_CHUNK, spec.seq_len))
        for t in range(1, spec.seq_len):
            toks[:, t] = np.where(noise[:, t], rand[:, t], perm[toks[:, t - 1]])
        return {"tokens": toks}
    w_rng = np.random.default_rng([spec.seed, 1 << 31])
    x = rng.standard_normal((_SYNTH_CHUNK, spec.num_features)).astype(np.float32)
    if spec.task == "classification":
        w = w_rng.standard_normal((spec.num_features, spec.num_classes))
        return {"x": x, "y": np.argmax(x @ w, axis=1).astype(np.int64)}
    w = w_rng.standard_normal(spec.num_features)
    y = x @ w / np.sqrt(spec.num_features) + 0.1 * rng.standard_normal(_SYNTH_CHUNK)
    return {"x": x, "y": y.astype(np.float32)}


def synthetic_rows(ids: np.ndarray, spec: SourceSpec) -> dict[str, np.ndarray]:
    """Rows for the given ids; each row depends only on (seed, id)."""
    ids = np.asarray(ids, dtype=np.int64)
    parts: dict[str, list[np.ndarray]] = {}
    chunks = ids // _SYNTH_CHUNK
    for chunk in np.unique(chunks):
        rows = _synthetic_chunk(int(chunk), spec)
        sel = ids[chunks == chunk] - chunk * _SYNTH_CHUNK
        for key, value in rows.items():
            parts.setdefault(key, []).append(value[sel])
    out = {k: np.concatenate(v) for k, v in parts.items()}
    out["sample_id"] = ids
    return spec.throttle(out)


def synthetic_ids(spec: SourceSpec, split: str) -> np.ndarray:
    ids = np.arange(spec.num_samples, dtype=np.int64)
    return ids[split_mask(ids, spec.val_fraction, split)]


# ---------------------------------------------------------------- shared


def _count(ids: np.ndarray, spec: SourceSpec, split: str) -> int:
    return int(split_mask(ids, spec.val_fraction, split).sum())


def describe(spec: SourceSpec) -> DataInfo:
    """Exact train/val sizes and tabular shape, from file sizes and metadata only (a
    tokenized source is tokenized to count its windows)."""
    if spec.tokenized:
        return _count_tokenized(spec)
    if spec.kind == "text":
        val = np.concatenate([_text_split(path, size, spec, "val") for path, size in text_files(spec)])
        return DataInfo(num_train=int((~val).sum()), num_val=int(val.sum()))
    if spec.kind == "synthetic":
        ids = np.arange(spec.num_samples, dtype=np.int64)
        classes = spec.num_classes if spec.task == "classification" else 0
        return DataInfo(num_train=_count(ids, spec, "train"), num_val=_count(ids, spec, "val"),
                        num_features=spec.num_features if spec.task != "lm" else 0,
                        num_classes=classes)
    from raytrain_platform.data import parquet

    return parquet.describe_parquet(spec)


def iter_source(spec: SourceSpec, split: str, features: tuple[str, ...] = ()) -> Iterator[dict[str, np.ndarray]]:
    """The whole split in source order, one piece (file, chunk) at a time: the order the
    Ray Data pipeline produces with ``preserve_order``."""
    if spec.tokenized:
        for index, piece in enumerate(token_pieces(spec)):
            yield from token_windows(index, piece, spec, split)
    elif spec.kind == "text":
        for i, (path, _) in enumerate(text_files(spec)):
            yield text_windows(i, path, spec, split)
    elif spec.kind == "synthetic":
        ids = synthetic_ids(spec, split)
        for start in range(0, ids.size, 4096):
            yield synthetic_rows(ids[start:start + 4096], spec)
    else:
        from raytrain_platform.data import parquet

        root, chunks = parquet.split_chunks(spec, split)
        for chunk in chunks:
            yield parquet.read_parquet_chunk(chunk, spec, features, split, root)


def head(spec: SourceSpec, split: str, rows: int,
         features: tuple[str, ...] = ()) -> dict[str, np.ndarray] | None:
    """The first `rows` rows of `split` in source order (all of them if it has fewer;
    None if none), read only as far as they go."""
    return next(rebatch(iter_source(spec, split, features), rows, tail=True), None)
