"""Write a synthetic tabular dataset as Parquet, for `pipelines/configs/tabular.yaml`
and the benchmarks (no download needed).

    rtp make-data data/tabular --rows 20000 --features 16 --classes 4

Rows come from the same deterministic generator as ``data.source: synthetic``
(`sources.synthetic_rows`), so a Parquet run and a synthetic run of the same
seed see the same numbers. No torch, no Ray.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from raytrain_platform.data.sources import SourceSpec, synthetic_rows
from raytrain_platform.errors import ConfigError

__all__ = ["write_tabular_parquet"]


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

    for name, value, low in (("--rows", rows, 1), ("--features", features, 1),
                             ("--classes", classes, 2), ("--files", files, 1),
                             ("--row-group-rows", row_group_rows, 1)):
        if not (isinstance(value, int) and value >= low):
            raise ConfigError(name, value, f"an integer >= {low}")
    if files > rows:
        raise ConfigError("--files", files, f"at most --rows ({rows})")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ConfigError("out", str(folder), "a folder (a file of that name exists)")
    if folder.exists() and any(folder.glob("*.parquet")):
        raise ConfigError("out", str(folder), "an empty or new folder (it already holds .parquet files)")
    folder.mkdir(parents=True, exist_ok=True)
    spec = SourceSpec(kind="synthetic", task="classification", val_fraction=0.0, num_samples=rows,
                      num_features=features, num_classes=classes, seed=seed)
    written = []
    for i, ids in enumerate(np.array_split(np.arange(rows), files)):  # exactly `files` files
        part = synthetic_rows(ids, spec)
        table = pa.table({**{f"f{j}": part["x"][:, j] for j in range(features)},
                          "label": part["y"].astype(np.int64)})
        path = folder / f"part-{i:04d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_rows)
        written.append(path)
    return written
