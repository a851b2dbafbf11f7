"""Parquet sources (``data.source: parquet``): one chunk per row group, each row's
``sample_id`` its position across the sorted files (``data.val_path``'s rows from
`VAL_PATH_ID` on, so ids never collide across splits), its split by a hash of its file's
name and its place in the file (`splits.split_keys`); the schema, columns and nulls
checked before Ray starts (numpy and pyarrow only: no Ray, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from raytrain_platform.data.specs import DataInfo, SourceSpec
from raytrain_platform.data.splits import filesystem, split_key, split_keys, split_mask
from raytrain_platform.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

__all__ = ["MAX_CLASSES", "VAL_PATH_ID", "ParquetChunk", "parquet_files", "parquet_chunks",
           "check_parquet_columns", "read_parquet_chunk", "split_chunks", "describe_parquet"]

MAX_CLASSES = 1_000_000  # a classification label column's largest index + 1
VAL_PATH_ID = 1 << 62  # the sample_id of data.val_path's first row


def parquet_files(path: str, field: str = "data.path") -> tuple["pafs.FileSystem", str, list[str]]:
    """(filesystem, the path's own path in it, its .parquet files' paths in it, sorted)."""
    import pyarrow.fs as pafs

    fs, root = filesystem(path, field)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"{field} = {path!r}: no such file or folder")
    if info.type == pafs.FileType.File:
        return fs, root, [root]
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet"))
    if not files:
        raise DataError(f"{field} = {path!r}: the folder holds no .parquet files")
    return fs, root, files


@dataclass(frozen=True)
class ParquetChunk:
    path: str
    row_group: int
    first_id: int  # its first row's sample_id
    num_rows: int
    file_row: int = 0  # its first row's place in its file
    key: int = 0  # its file's `split_key`


@dataclass(frozen=True)
class _Footers:
    """What a Parquet path's file footers say, each footer read once."""

    chunks: list[ParquetChunk]
    schema: "pa.Schema"
    files: list[tuple[str, "pq.FileMetaData"]]
    fs: "pafs.FileSystem"


def _read_footers(path: str, field: str, first_id: int) -> _Footers:
    import pyarrow.parquet as pq

    fs, root, files = parquet_files(path, field)
    chunks, offset, schema, metas = [], first_id, None, []
    for f in files:
        try:
            meta = pq.ParquetFile(f, filesystem=fs).metadata
        except Exception as exc:
            raise DataError(f"{field}: {f!r} is not a readable Parquet file ({exc})") from None
        file_schema = meta.schema.to_arrow_schema()
        if schema is None:
            schema = file_schema
        elif not file_schema.equals(schema):
            raise DataError(f"{field}: {f!r} has columns {_columns(file_schema)} but the first file has "
                            f"{_columns(schema)}; all files must share one schema")
        metas.append((f, meta))
        key, file_row = split_key(f, root), 0
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            if n:
                chunks.append(ParquetChunk(f, rg, offset, n, file_row, key))
                offset, file_row = offset + n, file_row + n
    if not chunks:
        raise DataError(f"{field} = {path!r}: the Parquet files hold no rows")
    assert schema is not None
    return _Footers(chunks, schema, metas, fs)


def _columns(schema: "pa.Schema") -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in schema) + ")"


def parquet_chunks(path: str, spec: SourceSpec, field: str = "data.path", *,
                   first_id: int = 0) -> tuple[list[ParquetChunk], "pa.Schema"]:
    """One chunk per row group, with the global id of its first row (the first file's
    first row is `first_id`); schemas checked."""
    footers = _read_footers(path, field, first_id)
    return footers.chunks, footers.schema


def _val_rows(chunk: ParquetChunk, spec: SourceSpec) -> np.ndarray:
    """Which of the chunk's rows are held out for validation (no `data.val_path`)."""
    keys = split_keys(chunk.key, np.arange(chunk.file_row, chunk.file_row + chunk.num_rows))
    return split_mask(keys, spec.val_fraction, "val")


def check_parquet_columns(schema: "pa.Schema", spec: SourceSpec, field: str = "data.path") -> tuple[str, ...]:
    """The feature columns to use; missing or non-numeric columns are a `DataError`."""
    import pyarrow as pa

    names = schema.names
    if spec.label_column not in names:
        raise DataError(f"data.label_column = {spec.label_column!r}: no such column in {field}; "
                        f"columns are {names}")
    label_type = schema.field(spec.label_column).type
    if spec.task == "classification" and not pa.types.is_integer(label_type):
        raise DataError(f"data.label_column = {spec.label_column!r} has type {label_type}: "
                        "expected an integer class index for classification")
    if spec.task == "regression" and not (pa.types.is_integer(label_type) or pa.types.is_floating(label_type)):
        raise DataError(f"data.label_column = {spec.label_column!r} has type {label_type}: "
                        "expected a number for regression")
    features = spec.feature_columns or tuple(n for n in names if n != spec.label_column)
    for col in features:
        if col not in names:
            raise DataError(f"data.feature_columns: column {col!r} is not in {field}; columns are {names}")
        t = schema.field(col).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            raise DataError(f"data.feature_columns: column {col!r} has type {t}: expected a number")
    if not features:
        raise DataError(f"{field}: no feature columns besides the label {spec.label_column!r}")
    return tuple(features)


def read_parquet_chunk(chunk: ParquetChunk, spec: SourceSpec, features: tuple[str, ...],
                       split: str, root: str) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq

    fs, _ = filesystem(root)
    table = pq.ParquetFile(chunk.path, filesystem=fs).read_row_group(
        chunk.row_group, columns=[*features, spec.label_column])
    for col in table.column_names:  # a null would become NaN, and a class index INT64_MIN
        if table.column(col).null_count:
            raise DataError(_nulls(f"{chunk.path}: row group {chunk.row_group}", col, table.column(col).null_count))
    ids = np.arange(chunk.first_id, chunk.first_id + chunk.num_rows, dtype=np.int64)
    # With data.val_path each split is every row of its own files (`split_chunks`).
    if spec.val_path:
        keep = np.ones(ids.shape, dtype=bool)
    else:
        val = _val_rows(chunk, spec)
        keep = val if split == "val" else ~val
    x = np.stack([table.column(c).to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
                  for c in features], axis=1)
    y = table.column(spec.label_column).to_numpy(zero_copy_only=False)
    y = y.astype(np.int64 if spec.task == "classification" else np.float32, copy=False)
    if not np.isfinite(x).all():
        raise DataError(f"{chunk.path}: row group {chunk.row_group} has NaN or infinite features")
    if spec.task == "regression" and not np.isfinite(y).all():
        raise DataError(f"{chunk.path}: row group {chunk.row_group} has NaN or infinite labels "
                        f"({spec.label_column!r})")
    return spec.throttle({"x": x[keep], "y": y[keep], "sample_id": ids[keep]})


def split_chunks(spec: SourceSpec, split: str) -> tuple[str, list[ParquetChunk]]:
    """The path that feeds `split` and its chunks: with data.val_path, train is every
    row of data.path and val every row of data.val_path (as `describe_parquet` counts
    them); else both come from data.path, val_fraction held out by a hash of each row's
    file and place in it."""
    if split == "val" and spec.val_path:
        return spec.val_path, parquet_chunks(spec.val_path, spec, "data.val_path", first_id=VAL_PATH_ID)[0]
    return spec.path or "", parquet_chunks(spec.path or "", spec)[0]


def _nulls(where: str, column: str, count: int) -> str:
    return f"{where}: column {column!r} has {count} null value(s); every row needs a number"


def _check_no_nulls(footers: _Footers, columns: tuple[str, ...], field: str) -> None:
    """DataError where a row group's statistics count nulls in `columns` (a file written
    without statistics is checked as its row groups are read, `read_parquet_chunk`)."""
    for f, meta in footers.files:
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            for j in range(group.num_columns):
                col, stats = group.column(j), group.column(j).statistics
                if (col.path_in_schema in columns and stats is not None and stats.has_null_count
                        and stats.null_count):
                    raise DataError(f"{field}: " + _nulls(f"{f}: row group {rg}", col.path_in_schema,
                                                          stats.null_count))


def describe_parquet(spec: SourceSpec) -> DataInfo:
    """Exact train/val sizes and columns of a Parquet source, from its footers (each read
    once) and, for the number of classes, the label column (every class index of either
    path)."""
    train = _read_footers(spec.path or "", "data.path", 0)
    features = check_parquet_columns(train.schema, spec)
    paths = [(train, "data.path")]
    if spec.val_path:
        val = _read_footers(spec.val_path, "data.val_path", VAL_PATH_ID)
        check_parquet_columns(val.schema, spec, "data.val_path")
        paths.append((val, "data.val_path"))
        num_train, num_val = sum(c.num_rows for c in train.chunks), sum(c.num_rows for c in val.chunks)
    else:
        num_val = sum(int(_val_rows(c, spec).sum()) for c in train.chunks)
        num_train = sum(c.num_rows for c in train.chunks) - num_val
    for footers, field in paths:
        _check_no_nulls(footers, (*features, spec.label_column), field)
    classes = 0
    if spec.task == "classification":
        classes = max(_max_label(footers, field, spec) for footers, field in paths) + 1
    return DataInfo(num_train=num_train, num_val=num_val, num_features=len(features),
                    num_classes=classes, feature_columns=features)


def _max_label(footers: _Footers, field: str, spec: SourceSpec) -> int:
    """The largest class index in the files of `footers` (their label column, read whole)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    best = 0
    for f, _ in footers.files:
        col = pq.read_table(f, columns=[spec.label_column], filesystem=footers.fs).column(0)
        if col.null_count:  # pc.min and pc.max skip nulls
            raise DataError(f"{field}: " + _nulls(f, spec.label_column, col.null_count))
        lo, hi = pc.min(col).as_py(), pc.max(col).as_py()
        if lo is None:  # a file of no rows
            continue
        if lo < 0:
            raise DataError(f"data.label_column = {spec.label_column!r}: class indices must be "
                            f">= 0 (found {lo} in {f})")
        best = max(best, hi)
    if best >= MAX_CLASSES:
        raise DataError(f"data.label_column = {spec.label_column!r}: class indices below {MAX_CLASSES:,} "
                        f"(found {best}: the model would get that many outputs)")
    return int(best)
