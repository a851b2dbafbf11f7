"""Write a synthetic tabular dataset as Parquet, for `pipelines/configs/tabular.yaml`
and the benchmarks (no download needed).

    rtp make-data data/tabular --rows 20000 --features 16 --classes 4

Rows come from the same deterministic generator as ``data.source: synthetic``
(`raw.synthetic_rows`), so a Parquet run and a synthetic run of the same
seed see the same numbers. No torch, no Ray.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from raytrain_platform.config.fields import MAX_SYNTHETIC, SEED_ALLOWED, SEED_LIMIT
from raytrain_platform.data.raw import synthetic_rows
from raytrain_platform.data.specs import SourceSpec
from raytrain_platform.errors import PATH_ERRNOS, ConfigError, folder_problem

__all__ = ["write_tabular_parquet"]

# Beyond these the Parquet is no use: one column per feature (a wide table reads slowly),
# a features x classes weight matrix in memory, and part-NNNN names that sort in order.
MAX_FEATURES = 10_000
MAX_CLASSES = 10_000
MAX_FILES = 10_000


def write_tabular_parquet(out: str | Path, *, rows: int = 20_000, features: int = 16,
                          classes: int = 4, files: int = 4, row_group_rows: int = 1024,
                          seed: int = 0) -> list[Path]:
    """Write `rows` rows as `files` Parquet files (columns ``f0..f{n-1}`` float32 and an
    int64 ``label``) into folder `out`; returns the files written.

    >>> import tempfile
    >>> paths = write_tabular_parquet(tempfile.mkdtemp(), rows=100, files=2)
    >>> len(paths)
    2
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(out)
    _check_args(folder, rows=rows, features=features, classes=classes, files=files,
                row_group_rows=row_group_rows, seed=seed)
    spec = SourceSpec(kind="synthetic", task="classification", val_fraction=0.0, num_samples=rows,
                      num_features=features, num_classes=classes, seed=seed)
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # removed again on failure
    written: list[Path] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for i, ids in enumerate(np.array_split(np.arange(rows), files)):  # exactly `files` files
            part = synthetic_rows(ids, spec)
            table = pa.table({**{f"f{j}": part["x"][:, j] for j in range(features)},
                              "label": part["y"].astype(np.int64)})
            path = folder / f"part-{i:04d}.parquet"
            written.append(path)
            pq.write_table(table, path, row_group_size=row_group_rows)
    except BaseException as exc:  # nothing half-written: take back what this call made
        for path in written:
            path.unlink(missing_ok=True)
        for path in made:  # innermost first
            try:
                path.rmdir()
            except OSError:
                break
        if isinstance(exc, OSError) and exc.errno in PATH_ERRNOS:  # the user's folder: bad input
            raise ConfigError("out", str(folder), f"a folder this user may write ({exc.strerror}"
                              f"{': ' + str(exc.filename) if exc.filename else ''})") from None
        raise  # anything else (a full disk): the CLI's one line, exit 1
    return written


def _check_args(folder: Path, *, rows: int, features: int, classes: int, files: int,
                row_group_rows: int, seed: int) -> None:
    """ConfigError, naming the `rtp make-data` flag, for the first bad argument; before
    anything is written."""
    for name, value, low, high in (
            ("--rows", rows, 1, MAX_SYNTHETIC),
            ("--features", features, 1, MAX_FEATURES),
            ("--classes", classes, 2, MAX_CLASSES),
            ("--files", files, 1, MAX_FILES),
            ("--row-group-rows", row_group_rows, 1, MAX_SYNTHETIC),
            ("--seed", seed, 0, SEED_LIMIT - 1)):
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            allowed = SEED_ALLOWED if name == "--seed" else f"an integer from {low} to {high:,}"
            raise ConfigError(name, value, allowed)
    if files > rows:
        raise ConfigError("--files", files, f"at most --rows ({rows})")
    problem = folder_problem(folder.absolute())
    if problem is not None:
        raise ConfigError("out", str(folder), f"a folder that can be created and written ({problem})")
    if any(folder.glob("*.parquet")):
        raise ConfigError("out", str(folder), "an empty or new folder (it already holds .parquet files)")
