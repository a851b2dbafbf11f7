"""Reference log-probs kept with a tokenized preference dataset
(``train.dpo.precompute_reference``; TRL's ``precompute_ref_log_probs``).

A DPO run that precomputes its reference scores every pair of the dataset once, before
training (core/preference.py), and keeps the two numbers per pair beside the pairs::

    <dataset>/reference/<key>.parquet   sample_id int64, ref_chosen_logps, ref_rejected_logps float32

sorted by sample id, both splits in one table (their ids differ: `sources`). `key` is
a hash of what the numbers depend on besides the pairs (the reference's weights,
precision; core/preference.py `reference_key`): a rerun, a resume at any world size,
and every sweep trial with the same reference find the table and hold no reference
model; another reference writes its own. The file is moved into place whole, so a
table that exists is complete.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from raytrain_platform.data.prepared import iter_range, join, load_manifest
from raytrain_platform.data.splits import filesystem, rebatch
from raytrain_platform.errors import DataError

__all__ = ["REF_COLUMNS", "reference_file", "pair_count", "pair_chunks", "write_reference", "ReferenceLogps"]

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # models/preference.py REF_KEYS


def reference_file(prepared: str, key: str) -> str:
    """Where the reference log-probs of `key` are kept in the dataset `prepared`."""
    return join(prepared, "reference", f"{key}.parquet")


def pair_count(prepared: str, split: str) -> int:
    """The pairs of the dataset's `split`."""
    return int(load_manifest(prepared).windows[split])


def pair_chunks(prepared: str, split: str, start: int, stop: int, rows: int) -> Iterator[dict[str, np.ndarray]]:
    """Pairs ``start`` to ``stop`` (exclusive) of `split` in dataset order, `rows` at a
    time (the last may hold fewer): the pair rows as the dataset holds them."""
    if stop > start:
        yield from rebatch(iter_range(load_manifest(prepared), split, start, stop - start), rows, tail=True)


def write_reference(prepared: str, key: str, sample_id: np.ndarray, chosen: np.ndarray,
                    rejected: np.ndarray) -> str:
    """Writes the table of `key` (sorted by sample id; one row per pair), moved into
    place whole; returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    order = np.argsort(sample_id, kind="stable")
    table = pa.table({"sample_id": pa.array(sample_id[order].astype(np.int64)),
                      REF_COLUMNS[0]: pa.array(chosen[order].astype(np.float32)),
                      REF_COLUMNS[1]: pa.array(rejected[order].astype(np.float32))})
    path = reference_file(prepared, key)
    fs, local = filesystem(path)
    fs.create_dir(local.rsplit("/", 1)[0], recursive=True)
    tmp = local + f".tmp-{uuid.uuid4().hex}"
    with fs.open_output_stream(tmp) as sink:
        pq.write_table(table, sink)
    fs.move(tmp, local)
    return path


@dataclass(frozen=True)
class ReferenceLogps:
    """A written table: each pair's reference log-probs by sample id."""

    path: str
    sample_id: np.ndarray  # sorted
    chosen: np.ndarray
    rejected: np.ndarray

    @classmethod
    def find(cls, prepared: str, key: str) -> "ReferenceLogps | None":
        """The table of `key` in the dataset `prepared`, or None where none was written."""
        import pyarrow.parquet as pq

        path = reference_file(prepared, key)
        fs, local = filesystem(path)
        try:
            with fs.open_input_file(local) as f:
                table = pq.read_table(f)
        except (OSError, ValueError):  # not written (pyarrow: FileNotFoundError), or not a table
            return None
        try:
            columns = [table.column(c).to_numpy() for c in ("sample_id", *REF_COLUMNS)]
        except KeyError:
            raise DataError(f"{path}: not a table of reference log-probs (it needs the columns sample_id, "
                            f"{', '.join(REF_COLUMNS)}); delete it to compute them again") from None
        return cls(path, *columns)

    def __len__(self) -> int:
        return len(self.sample_id)

    def lookup(self, sample_id: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chosen and rejected responses' reference log-probs of the pairs `sample_id`."""
        at = np.minimum(np.searchsorted(self.sample_id, sample_id), max(len(self) - 1, 0))
        found = self.sample_id[at] == sample_id if len(self) else np.zeros(len(sample_id), dtype=bool)
        if not found.all():
            raise DataError(f"{self.path}: no reference log-probs for pair {int(sample_id[~found][0])} (the table "
                            "was written for other data); delete it to compute them again")
        return self.chosen[at], self.rejected[at]
