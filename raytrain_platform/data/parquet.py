"""Parquet sources (``data.source: parquet``): one chunk per row group, each row's
``sample_id`` its position across the sorted files; the schema and columns checked
before Ray starts (numpy and pyarrow only: no Ray, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from raytrain_platform.data.sources import DataInfo, SourceSpec, _count, filesystem, split_mask
from raytrain_platform.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

__all__ = ["MAX_CLASSES", "ParquetChunk", "parquet_files", "parquet_chunks", "check_parquet_columns",
           "read_parquet_chunk", "root_for", "describe_parquet"]

MAX_CLASSES = 1_000_000  # a classification label column's largest index + 1


def parquet_files(path: str, field: str = "data.path") -> tuple["pafs.FileSystem", list[str]]:
    import pyarrow.fs as pafs

    fs, root = filesystem(path, field)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"{field} = {path!r}: no such file or folder")
    if info.type == pafs.FileType.File:
        return fs, [root]
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet"))
    if not files:
        raise DataError(f"{field} = {path!r}: the folder holds no .parquet files")
    return fs, files


@dataclass(frozen=True)
class ParquetChunk:
    path: str
    row_group: int
    first_id: int
    num_rows: int


def parquet_chunks(path: str, spec: SourceSpec, field: str = "data.path") -> tuple[list[ParquetChunk], "pa.Schema"]:
    """One chunk per row group, with the global id of its first row; schemas checked."""
    import pyarrow.parquet as pq

    fs, files = parquet_files(path, field)
    chunks, offset, schema = [], 0, None
    for f in files:
        try:
            meta = pq.ParquetFile(f, filesystem=fs).metadata
        except Exception as exc:
            raise DataError(f"{field}: {f!r} is not a readable Parquet file ({exc})") from None
        file_schema = meta.schema.to_arrow_schema()
        if schema is None:
            schema = file_schema
        elif not file_schema.equals(schema):
            raise DataError(f"{field}: {f!r} has schema {file_schema.names} but the first file has "
                            f"{schema.names}; all files must share one schema")
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            if n:
                chunks.append(ParquetChunk(f, rg, offset, n))
                offset += n
    if not chunks:
        raise DataError(f"{field} = {path!r}: the Parquet files hold no rows")
    assert schema is not None
    return chunks, schema


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
    ids = np.arange(chunk.first_id, chunk.first_id + chunk.num_rows, dtype=np.int64)
    keep = split_mask(ids, spec.val_fraction, split) if spec.val_fraction else (
        np.ones_like(ids, dtype=bool) if split == "train" else np.zeros_like(ids, dtype=bool))
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


def root_for(spec: SourceSpec, split: str) -> tuple[str, SourceSpec, str]:
    """Which path feeds `split`, and the spec to read it with (val_path has no holdout)."""
    if split == "val" and spec.val_path:
        return spec.val_path, SourceSpec(**{**spec.__dict__, "val_fraction": 0.0}), "data.val_path"
    return spec.path or "", spec, "data.path"


def describe_parquet(spec: SourceSpec) -> DataInfo:
    """Exact train/val sizes and columns of a Parquet source, from metadata (and the
    label column, for the number of classes)."""
    chunks, schema = parquet_chunks(spec.path or "", spec)
    features = check_parquet_columns(schema, spec)
    total = sum(c.num_rows for c in chunks)
    ids = np.arange(total, dtype=np.int64)
    if spec.val_path:
        vchunks, vschema = parquet_chunks(spec.val_path, spec, "data.val_path")
        check_parquet_columns(vschema, spec, "data.val_path")
        num_train, num_val = total, sum(c.num_rows for c in vchunks)
    else:
        num_train, num_val = _count(ids, spec, "train"), _count(ids, spec, "val")
    classes = 0
    if spec.task == "classification":
        classes = _max_label(chunks, spec) + 1
    return DataInfo(num_train=num_train, num_val=num_val, num_features=len(features),
                    num_classes=classes, feature_columns=features)


def _max_label(chunks: list[ParquetChunk], spec: SourceSpec) -> int:
    """The largest class index in the training files (their label column, read whole)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    fs, _ = filesystem(spec.path or "")
    best = 0
    for path in sorted({c.path for c in chunks}):
        col = pq.read_table(path, columns=[spec.label_column], filesystem=fs).column(0)
        lo, hi = pc.min(col).as_py(), pc.max(col).as_py()
        if lo is None or lo < 0:
            raise DataError(f"data.label_column = {spec.label_column!r}: class indices must be "
                            f">= 0 (found {lo} in {path})")
        best = max(best, hi)
    if best >= MAX_CLASSES:
        raise DataError(f"data.label_column = {spec.label_column!r}: class indices below {MAX_CLASSES:,} "
                        f"(found {best}: the model would get that many outputs)")
    return int(best)
