"""Which rows and files the sources read (`data/sources.py`, `data/parquet.py`): Parquet
with a separate ``data.val_path``, and ``data.glob``. Tiny real files, no Ray: the Ray
Data read task (`ray_data._ParquetChunks`) is called as Ray would call it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raytrain_platform.data import ray_data, sources
from raytrain_platform.data.parquet import split_chunks
from raytrain_platform.data.sources import SourceSpec


def _parquet(folder: Path, rows: int, classes: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    x = np.arange(rows, dtype=np.float64)
    pq.write_table(pa.table({"f0": x, "label": np.arange(rows) % classes}), folder / "part-0.parquet",
                   row_group_size=256)
    return str(folder)


def _ray_task_rows(spec: SourceSpec, split: str, features: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The rows `ray_data.parquet_dataset`'s read tasks give, without Ray: its chunks,
    as the batches it hands each task."""
    root, chunks = split_chunks(spec, split)
    batch = {"path": np.array([c.path for c in chunks]), "row_group": np.array([c.row_group for c in chunks]),
             "first_id": np.array([c.first_id for c in chunks]), "num_rows": np.array([c.num_rows for c in chunks])}
    return ray_data._ParquetChunks(spec, features, split, root)(batch)


def test_parquet_val_path_is_the_whole_val_split_and_train_keeps_every_row(tmp_path):
    """With data.val_path, validation read 0 rows and training dropped val_fraction of
    data.path, while the step counts assumed all of both (1000 / 200 counted, 944 / 0 read)."""
    spec = SourceSpec(kind="parquet", task="classification", val_fraction=0.05,
                      path=_parquet(tmp_path / "train", 1000, 3), val_path=_parquet(tmp_path / "val", 200, 5))
    info = sources.describe(spec)
    assert (info.num_train, info.num_val) == (1000, 200)
    assert info.num_classes == 5  # a class only the validation files hold still gets an output
    read = {split: {k: np.concatenate([b[k] for b in sources.iter_source(spec, split, info.feature_columns)])
                    for k in ("x", "sample_id")} for split in ("train", "val")}
    assert len(read["train"]["sample_id"]) == info.num_train
    assert len(read["val"]["sample_id"]) == info.num_val
    np.testing.assert_array_equal(read["train"]["x"][:, 0], np.arange(1000))  # every row, in order
    np.testing.assert_array_equal(read["val"]["x"][:, 0], np.arange(200))
    assert not set(read["train"]["sample_id"].tolist()) & set(read["val"]["sample_id"].tolist())
    for split in ("train", "val"):  # Ray Data's read tasks read the same rows
        rows = _ray_task_rows(spec, split, info.feature_columns)
        np.testing.assert_array_equal(rows["sample_id"], read[split]["sample_id"])


def test_parquet_without_val_path_still_holds_out_val_fraction(tmp_path):
    spec = SourceSpec(kind="parquet", task="regression", val_fraction=0.2, path=_parquet(tmp_path / "d", 500, 3))
    info = sources.describe(spec)
    ids = {split: np.concatenate([b["sample_id"] for b in sources.iter_source(spec, split, ("f0",))])
           for split in ("train", "val")}
    assert (len(ids["train"]), len(ids["val"])) == (info.num_train, info.num_val)
    assert info.num_train + info.num_val == 500 and 0 < info.num_val < 500
    assert sorted([*ids["train"], *ids["val"]]) == list(range(500))


@pytest.mark.parametrize("glob,expected", [
    ("**/*.txt", ["a.txt", "sub/b.txt", "sub/deep/c.txt", "other/d.txt"]),
    ("*.txt", ["a.txt"]),
    ("sub/*.txt", ["sub/b.txt"]),
    ("sub/**", ["sub/b.txt", "sub/deep/c.txt", "sub/e.md"]),
    ("sub/**/*.txt", ["sub/b.txt", "sub/deep/c.txt"]),
    ("**/deep/*", ["sub/deep/c.txt"]),
])
def test_glob_matches_the_folders_of_the_pattern(tmp_path, glob, expected):
    """`sub/*.txt` took every .txt anywhere, and `sub/**` every file: the folder part
    of the pattern was dropped."""
    for name in ["a.txt", "sub/b.txt", "sub/deep/c.txt", "other/d.txt", "sub/e.md"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("some text\n")
    files = sources.text_files(SourceSpec(kind="text", task="lm", val_fraction=0.0, path=str(tmp_path), glob=glob))
    assert [p for p, _ in files] == sorted(str(tmp_path / n) for n in expected)
