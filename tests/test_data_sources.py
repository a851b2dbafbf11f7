"""Which rows and files the sources read (`data/sources.py`, `data/parquet.py`): Parquet
with a separate ``data.val_path``, and ``data.glob``. Tiny real files, no Ray: the Ray
Data read task (`ray_data._ParquetChunks`) is called as Ray would call it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from raytrain_platform.data import ray_data, sources
from raytrain_platform.data.parquet import split_chunks
from raytrain_platform.data.sources import SourceSpec
from raytrain_platform.errors import DataError


def _parquet(folder: Path, rows: int, classes: int, name: str = "part-0.parquet", first: int = 0) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(exist_ok=True)
    x = np.arange(first, first + rows, dtype=np.float64)
    pq.write_table(pa.table({"f0": x, "label": np.arange(rows) % classes}), folder / name,
                   row_group_size=256)
    return str(folder)


def _ray_task_rows(spec: SourceSpec, split: str, features: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The rows `ray_data.parquet_dataset`'s read tasks give, without Ray: its chunks,
    as the batches it hands each task."""
    root, chunks = split_chunks(spec, split)
    items = [dataclasses.asdict(c) for c in chunks]  # as parquet_dataset's from_items gets them
    batch = {k: np.array([item[k] for item in items]) for k in items[0]}
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
    files = sources.text_files(str(tmp_path), glob)
    assert [p for p, _ in files] == sorted(str(tmp_path / n) for n in expected)


def _splits(spec: SourceSpec, features: tuple[str, ...]) -> dict[str, list]:
    """Each split's samples as values (byte windows, or Parquet rows' f0), in order;
    checked against `describe`'s counts and Ray Data's Parquet read tasks."""
    info = sources.describe(spec)
    out = {}
    for split, count in (("train", info.num_train), ("val", info.num_val)):
        batches = list(sources.iter_source(spec, split, features))
        key = "x" if spec.kind == "parquet" else "tokens"
        out[split] = [bytes(row) if key == "tokens" else float(row[0]) for b in batches for row in b[key]]
        assert len(out[split]) == count, split
        if spec.kind == "parquet":
            np.testing.assert_array_equal(_ray_task_rows(spec, split, features)["x"][:, 0], out[split])
    return out


@pytest.mark.parametrize("kind", ["text", "parquet"])
@pytest.mark.parametrize("folder", ["data", "run?1"])  # a local path's "?" is no URI query
def test_a_sample_keeps_its_split_when_files_are_added_beside_its_own(tmp_path, kind, folder):
    """The split hashed a sample's place across the sorted files: a file added ahead of
    another moved that file's samples between train and validation (validation then
    held samples an earlier run trained on). Now it hashes the file's name and the
    sample's place in it."""
    root = tmp_path / folder
    if kind == "text":
        root.mkdir()
        text = Path(sources.default_text_root(), "argparse.py").read_bytes()[:60_000]
        (root / "b.txt").write_bytes(text)
        spec = SourceSpec(kind="text", task="lm", val_fraction=0.2, seq_len=65, path=str(root), glob="**/*.txt")
        features: tuple[str, ...] = ()
    else:
        _parquet(root, 1000, 3, "b.parquet", first=10_000)
        spec = SourceSpec(kind="parquet", task="regression", val_fraction=0.2, path=str(root))
        features = ("f0",)
    before = _splits(spec, features)
    assert before["val"] and before["train"]
    if kind == "text":
        (root / "a.txt").write_bytes(Path(sources.default_text_root(), "glob.py").read_bytes())
        (root / "sub").mkdir()
        (root / "sub" / "c.txt").write_bytes(Path(sources.default_text_root(), "shlex.py").read_bytes())
    else:
        _parquet(root, 300, 3, "a.parquet")
        _parquet(root / "sub", 200, 3, "c.parquet", first=20_000)
    after = _splits(spec, features)
    for split in ("train", "val"):
        own = set(before[split])  # b's samples (a's and c's differ from them)
        assert [v for v in after[split] if v in own] == before[split], split
        assert len(after[split]) > len(before[split])


def test_files_of_another_schema_are_named_with_their_column_types(tmp_path):
    """The message showed the same column names twice when only a type differed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _parquet(tmp_path / "d", 10, 3, "a.parquet")
    pq.write_table(pa.table({"f0": np.arange(10, dtype=np.int32), "label": np.arange(10) % 3}),
                   tmp_path / "d" / "b.parquet")
    spec = SourceSpec(kind="parquet", task="regression", val_fraction=0.2, path=str(tmp_path / "d"))
    with pytest.raises(DataError, match=r"has columns \(f0: int32, label: int64\) but the first file "
                                                r"has \(f0: double, label: int64\)"):
        sources.describe(spec)
