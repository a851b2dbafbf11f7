"""The bottom of data/: file systems, the validation split's rules, file globs and
rebatching (numpy and pyarrow only). Every other data module builds on these.

Every sample has a stable 64-bit ``sample_id`` (see `sources.py`). The validation
split holds out the samples whose hash falls under ``val_fraction``: for synthetic rows
a hash of the id; for a file's windows, lines or rows a hash of the file's path under
``data.path`` and the sample's place in that file (`split_keys`), so the split never
depends on world size, and a sample keeps its split when files are added or removed
beside its own.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from raytrain_platform.errors import DataError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

__all__ = ["default_text_root", "filesystem", "uris_under", "split_mask", "VAL_SPLIT", "split_key", "split_keys",
           "glob_match", "text_files", "rebatch"]


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


def uris_under(path: str, root: str, found: list[str]) -> list[str]:
    """`found` (paths in `path`'s filesystem, under `root`, as `filesystem` made it) as
    paths any process can open again: absolute local paths as they are, or URIs rebuilt
    from `path`'s (host, port, bucket, and the query, which follows each file's path).

    >>> uris_under("s3://b/d?region=x", "b/d", ["b/d/a.jsonl"])
    ['s3://b/d/a.jsonl?region=x']
    """
    if "://" not in path:
        return found
    base, query_mark, query = path.partition("?")
    base, root = base.rstrip("/"), root.rstrip("/")
    return [base + f[len(root):] + query_mark + query for f in found]


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


def text_files(path: str | None, glob: str, max_files: int | None = None) -> list[tuple[str, int]]:
    """(path, size) of the files under the folder `path` (default: the standard
    library's sources) that match `glob`, sorted, the first `max_files`;
    site-packages are never part of a corpus."""
    root = Path(path or default_text_root())
    if not root.is_dir():
        raise DataError(f"data.path = {str(root)!r}: expected an existing folder of text files")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages",
                                                               "__pycache__"))
        for name in filenames:
            full = os.path.join(dirpath, name)
            if glob_match(Path(os.path.relpath(full, root)).parts, glob):
                found.append(full)
    found.sort()
    if max_files is not None:
        found = found[: max_files]
    try:
        files = [(p, os.path.getsize(p)) for p in found]
    except OSError as exc:  # a dangling symlink, a file removed meanwhile, no permission
        raise DataError(f"data.path = {str(root)!r}: {exc.filename}: cannot be read ({exc.strerror})") from None
    if not files:
        raise DataError(f"data.path = {str(root)!r}: no files match data.glob = {glob!r}")
    return files


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


