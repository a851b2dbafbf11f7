"""Language-model records from tables: a Hugging Face ``datasets`` folder
(``data.source: hf_dataset``: ``Dataset.save_to_disk``'s Arrow files) or Parquet files
(``data.source: parquet`` with an lm model), one record per row, of the columns
`data.format` reads (its field names are the column names). The same shapes as
`jsonl.py`'s readers: `table_blocks` is its ``_file_blocks`` (blocks of a file, never
held whole) and `table_records` its ``_records`` (each row checked by
`encode.check_record`, a bad one named by its file and row). pyarrow and numpy only.

>>> import pyarrow as pa
>>> block = pa.table({"instruction": ["Add.", "Name it."], "input": ["1 2", None], "output": ["3", "x"]})
>>> [record for _, record, _ in table_records("t.parquet", 0, block, RecordSpec("alpaca"))]
[{'instruction': 'Add.', 'input': '1 2', 'output': '3'}, {'instruction': 'Name it.', 'output': 'x'}]
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

import numpy as np

from raytrain_platform.data.encode import RecordSpec, check_record, record_spec
from raytrain_platform.data.parquet import parquet_files
from raytrain_platform.data.splits import filesystem, uris_under
from raytrain_platform.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

    from raytrain_platform.data.specs import TokenSpec

__all__ = ["TABLE_KINDS", "table_files", "table_schema", "table_blocks", "check_columns", "check_table_files",
           "table_records"]

TABLE_KINDS = ("hf_dataset", "parquet")


# ---------------------------------------------------------------- files


def _kind(kind: str) -> None:
    if kind not in TABLE_KINDS:
        raise ValueError(f"kind must be one of {TABLE_KINDS}, not {kind!r}")


def _read_json(fs: "pafs.FileSystem", local: str, where: str) -> Any:
    try:
        with fs.open_input_stream(local) as f:
            return json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise DataError(f"{where}: {local.rsplit('/', 1)[-1]} cannot be read as JSON ({exc})") from None


def _hf_dataset_files(path: str, field: str) -> list[str]:
    import pyarrow.fs as pafs

    fs, root = filesystem(path, field)
    where = f"{field} = {path!r}"
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"{where}: no such file or folder")
    if info.type == pafs.FileType.File:
        if not root.endswith(".arrow"):
            raise DataError(f"{where}: expected a datasets save_to_disk folder, or .arrow files")
        return uris_under(path, root, [root])
    exists = {name: fs.get_file_info(f"{root}/{name}").type == pafs.FileType.File
              for name in ("dataset_dict.json", "state.json")}
    if exists["dataset_dict.json"]:  # a DatasetDict: its "train" split
        splits = _read_json(fs, f"{root}/dataset_dict.json", where).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{where}: a DatasetDict folder without a 'train' split (its splits "
                            f"are {splits}); set {field} to one split's folder")
        base, mark, query = path.partition("?")
        return _hf_dataset_files(f"{base.rstrip('/')}/train{mark}{query}", field)
    if exists["state.json"]:  # save_to_disk's own list, in the dataset's order
        state = _read_json(fs, f"{root}/state.json", where)
        found = [f"{root}/{entry['filename']}" for entry in state.get("_data_files", [])]
        missing = [f for f in found if fs.get_file_info(f).type != pafs.FileType.File]
        if missing:
            raise DataError(f"{where}: state.json lists {missing[0]!r}, which is not there")
    else:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        found = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".arrow"))
    if not found:
        raise DataError(f"{where}: the folder holds no .arrow files")
    return uris_under(path, root, found)


def table_files(kind: str, path: str, field: str = "data.path") -> list[str]:
    """The files of a table source, in the order their rows are read.

    ``hf_dataset``: a ``datasets.Dataset.save_to_disk`` folder (the Arrow files its
    state.json lists, in order); a ``DatasetDict.save_to_disk`` folder: its ``train``
    split, the only one read (a DatasetDict without one is refused, naming its splits);
    else the folder's .arrow files (recursive, sorted), or one .arrow file.
    ``parquet``: the .parquet files, sorted, as `parquet.parquet_files` lists them.
    Local paths come back absolute, URIs as URIs. Errors name `field` (the config key
    that gave `path`)."""
    _kind(kind)
    if kind == "hf_dataset":
        return _hf_dataset_files(path, field)
    _, root, files = parquet_files(path, field)
    return uris_under(path, root, files)


# ---------------------------------------------------------------- blocks


def _arrow_batches(path: str) -> tuple["pa.Schema", Iterator["pa.RecordBatch"]]:
    """An Arrow IPC file's schema and record batches, memory-mapped where local (its
    pages read as the batches are used, not the file at once). save_to_disk writes the
    stream format; the file format ("ARROW1" first) is read too."""
    import pyarrow as pa

    fs, local = filesystem(path)
    try:
        source = pa.memory_map(local) if "://" not in path else fs.open_input_file(local)
        if source.read(6) == b"ARROW1":
            source.seek(0)
            file_reader = pa.ipc.open_file(source)
            return file_reader.schema, (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        source.seek(0)
        stream_reader = pa.ipc.open_stream(source)
        return stream_reader.schema, iter(stream_reader)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"{path}: cannot be read as an Arrow file ({exc})") from None


def _parquet(path: str) -> Any:
    import pyarrow.parquet as pq

    fs, local = filesystem(path)
    try:
        return pq.ParquetFile(local, filesystem=fs)
    except Exception as exc:  # pyarrow raises OSError, ArrowInvalid...
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None


def table_schema(kind: str, path: str) -> "pa.Schema":
    """The schema of one file of `table_files`, its rows left unread (a Parquet
    footer; an Arrow file's first message)."""
    _kind(kind)
    return _arrow_batches(path)[0] if kind == "hf_dataset" else _parquet(path).schema_arrow


def _rechunked(batches: Iterator["pa.RecordBatch"], schema: "pa.Schema",
               rows: int) -> Iterator[tuple[int, "pa.Table"]]:
    """(first row, table of `rows` rows; the last fewer) of consecutive `batches`;
    one empty table where there are no rows. Slices: no row is copied here."""
    import pyarrow as pa

    pending: list[pa.RecordBatch] = []
    have = first = 0
    for batch in batches:
        pending.append(batch)
        have += batch.num_rows
        if have < rows:
            continue
        table = pa.Table.from_batches(pending, schema)
        whole = have // rows * rows
        for start in range(0, whole, rows):
            yield first, table.slice(start, rows)
            first += rows
        pending, have = table.slice(whole).to_batches(), have - whole
    if have or not first:
        yield first, pa.Table.from_batches(pending, schema)


def table_blocks(kind: str, path: str, rows: int, *,
                 columns: Sequence[str] | None = None) -> Iterator[tuple[int, "pa.Table"]]:
    """(index of its first row in the file, a pyarrow Table of `rows` rows, the last
    fewer) of consecutive blocks of one file of `table_files`, read as they are used:
    the file is never held whole. A file of no rows gives one empty block. `columns`:
    only those of them the file has (a missing one is `table_records`' to name)."""
    _kind(kind)
    if not (isinstance(rows, int) and rows >= 1):
        raise ValueError(f"rows must be an integer >= 1, not {rows!r}")
    if kind == "hf_dataset":
        schema, arrow_batches = _arrow_batches(path)
        keep = schema.names if columns is None else [c for c in schema.names if c in columns]
        batches = (b.select(keep) for b in arrow_batches)
    else:
        parquet = _parquet(path)
        schema = parquet.schema_arrow
        keep = schema.names if columns is None else [c for c in schema.names if c in columns]
        batches = parquet.iter_batches(batch_size=rows, columns=keep)
    try:
        yield from _rechunked(batches, _select(schema, keep), rows)
    except (OSError, ValueError) as exc:  # a truncated or corrupt file; pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: cannot be read ({exc})") from None


def _select(schema: "pa.Schema", names: list[str]) -> "pa.Schema":
    import pyarrow as pa

    return pa.schema([schema.field(n) for n in names], metadata=schema.metadata)


# ---------------------------------------------------------------- records


def _is_string(t: "pa.DataType") -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(t: "pa.DataType") -> bool:
    import pyarrow as pa

    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type)


def check_columns(path: str, schema: "pa.Schema", spec: Union[RecordSpec, "TokenSpec"]) -> None:
    """DataError naming the file, the column and the file's columns unless `schema` has
    the columns `spec.format` needs, of its types: strings, and for chat and sharegpt a
    list of structs; an optional alpaca column may be absent, or all null."""
    import pyarrow as pa

    spec = record_spec(spec)
    required, optional = spec.fields
    messages = spec.format in ("chat", "sharegpt")
    need = "a list of structs" if messages else "strings"
    for name in (*required, *optional):
        if name not in schema.names:
            if name in optional:
                continue
            raise DataError(f"{path}: no column {name!r}, which data.format {spec.format} reads; its columns "
                            f"are {schema.names}")
        t = schema.field(name).type
        fits = _is_messages(t) if messages else _is_string(t) or (name in optional and pa.types.is_null(t))
        if not fits:
            raise DataError(f"{path}: column {name!r} has type {t}; data.format {spec.format} needs {need}")


def check_table_files(kind: str, files: Sequence[str], spec: Union[RecordSpec, "TokenSpec"]) -> None:
    """`check_columns` of every file's schema (footers and first messages only): bad
    columns found before any row is read."""
    for path in files:
        check_columns(path, table_schema(kind, path), spec)


def _value_bytes(arr: "pa.Array") -> np.ndarray:
    """Bytes of the strings in each value of `arr` (in lists and structs too; 0 for others)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if _is_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_struct(t):
        return sum((_value_bytes(child) for child in arr.flatten()), np.zeros(len(arr), np.int64))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        counts = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        sums = np.concatenate([[0], np.cumsum(_value_bytes(arr.flatten()))])
        ends = np.cumsum(counts)
        return sums[ends] - sums[ends - counts]
    return np.zeros(len(arr), np.int64)


def _without_nulls(value: Any) -> Any:
    """A list of structs as JSON would hold it: a struct's null fields left out (Arrow
    gives every row every field of the column's struct type)."""
    if isinstance(value, list):
        return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]
    return value


def table_records(path: str, first: int, block: Union["pa.Table", "pa.RecordBatch"],
                  spec: Union[RecordSpec, "TokenSpec"]) -> Iterator[tuple[int, dict, int]]:
    """(row index in the file, record, approximate bytes) of each row of `block` (rows
    `first` on of `path`, from `table_blocks`), each checked by `encode.check_record`;
    a bad row is a DataError ``"{path}: row {index + 1}: ..."``. Only the columns the
    format reads become Python values (a list of structs: a list of dicts). A null in
    a column the format needs is an error; a null optional alpaca field is left out."""
    spec = record_spec(spec)
    check_columns(path, block.schema, spec)
    required, optional = spec.fields
    table = block.select([name for name in block.schema.names if name in (*required, *optional)])
    sizes = sum((_value_bytes(column) for column in _arrays(table)), np.zeros(table.num_rows, np.int64))
    for offset, row in enumerate(table.to_pylist()):
        index = first + offset
        record = {}
        for name, value in row.items():
            if value is None and name in required:
                raise DataError(f"{path}: row {index + 1}: column {name!r} is null; data.format {spec.format} "
                                "needs a value")
            if value is not None:
                record[name] = _without_nulls(value)
        try:
            check_record(record, spec)
        except DataError as exc:
            raise DataError(f"{path}: row {index + 1}: {exc}") from None
        yield index, record, int(sizes[offset])


def _arrays(table: Union["pa.Table", "pa.RecordBatch"]) -> Iterator["pa.Array"]:
    """Each column of `table` as one array (a Table's chunks joined)."""
    import pyarrow as pa

    for column in table.columns:
        yield column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
