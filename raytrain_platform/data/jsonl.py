"""JSONL records: the files of a source, read in blocks of whole lines by byte range,
each line parsed and checked for the source's format (numpy and pyarrow only).

One JSON object per line (blank lines are skipped):

* ``text``: ``{"text": ...}``; every token is trained on.
* ``prompt_completion``: ``{"prompt": ..., "completion": ...}``; only the completion
  and the closing EOS are trained on.
* ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the
  tokenizer's chat template; only the assistant turns are trained on.
* ``preference``: ``{"prompt": ..., "chosen": ..., "rejected": ...}`` pairs
  (`preference.py`), one pair per row, never packed.

A file is cut into byte ranges (`byte_ranges`) that Ray Data's tasks read side by side
(`pieces.py`): a range owns the lines that *start* in it (`read_lines`), so every line
is read by exactly one task, whole, however the ranges fall. A task does not know how
many lines come before its range; it numbers its lines from 0, and the tokenized
dataset's pass (`prepared.py`) adds the lines of the ranges before it.

``python -m raytrain_platform.tools.tiny_llm OUT`` writes a matching tokenizer
(``OUT/model``) and data in all three formats (``OUT/data``).
"""

from __future__ import annotations

import json
from typing import Iterator

from raytrain_platform.data.encode import RecordError, check_record
from raytrain_platform.data.preference import check_pair, pair_spec
from raytrain_platform.data.specs import TokenSpec
from raytrain_platform.data.splits import filesystem, uris_under
from raytrain_platform.errors import DataError

__all__ = ["BLOCK_BYTES", "jsonl_files", "byte_ranges", "read_lines", "records"]

# A read task's range: about this many bytes of a file (some seconds of tokenizing on
# one core); a file is split into ranges that tokenize side by side.
BLOCK_BYTES = 4 << 20
_SCAN = 1 << 16  # bytes read at a time while looking for a line's end


def jsonl_files(path: str) -> list[str]:
    """The .jsonl files under `path` (a file, a folder: recursive), sorted; URIs stay
    URIs (so any process can open them again), local paths become absolute."""
    import pyarrow.fs as pafs

    fs, root = filesystem(path)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"data.path = {path!r}: no such file or folder")
    if info.type == pafs.FileType.File:
        if not root.endswith(".jsonl"):
            raise DataError(f"data.path = {path!r}: expected a .jsonl file or a folder of them")
        if info.size == 0:
            raise DataError(f"data.path = {path!r}: the file is empty")
        return [path if "://" in path else root]
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    found = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".jsonl"))
    if not found:
        raise DataError(f"data.path = {path!r}: the folder holds no .jsonl files")
    return uris_under(path, root, found)


def byte_ranges(size: int, block_bytes: int = BLOCK_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of the ranges a file of `size` bytes is read in (one, of no
    bytes, for an empty file).

    >>> byte_ranges(10, 4), byte_ranges(0, 4)
    ([(0, 4), (4, 4), (8, 2)], [(0, 0)])
    """
    return [(start, min(block_bytes, size - start)) for start in range(0, size, block_bytes)] or [(0, 0)]


def _line_start(f, offset: int) -> int:
    """The first line start at or after `offset` (the file's end if none)."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    pos = offset - 1
    while True:
        chunk = f.read(_SCAN)
        if not chunk:
            return pos
        cut = chunk.find(b"\n")
        if cut >= 0:
            return pos + cut + 1
        pos += len(chunk)


def read_lines(path: str, offset: int, length: int) -> bytes:
    """The whole lines that start within ``[offset, offset + length)`` of the file (a
    line that runs past the range is read to its end). DataError when it cannot be read."""
    fs, local = filesystem(path)
    try:
        with fs.open_input_file(local) as f:
            start = _line_start(f, offset)
            if start >= offset + length:
                return b""
            f.seek(start)
            parts = [f.read(offset + length - start)]
            while not parts[-1].endswith(b"\n"):  # the last line owned runs on
                chunk = f.read(_SCAN)
                if not chunk:
                    break
                cut = chunk.find(b"\n")
                parts.append(chunk if cut < 0 else chunk[:cut + 1])
            return b"".join(parts)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc})") from None


def records(data: bytes, spec: TokenSpec) -> Iterator[tuple[int, dict, int]]:
    """(0-based line index within `data`, record, its bytes) for each non-blank line,
    each checked for `spec.format`; `RecordError` (the line's index) for a bad one."""
    for index, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise RecordError(index, f"not valid JSON ({getattr(exc, 'msg', exc)})") from None
        except RecursionError:
            raise RecordError(index, "JSON nested too deeply to read") from None
        try:
            if spec.format == "preference":
                check_pair(record, pair_spec(spec))
            else:
                check_record(record, spec)
        except DataError as exc:
            raise RecordError(index, str(exc)) from None
        yield index, record, len(raw)
