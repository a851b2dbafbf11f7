"""``data.format: preference`` read from JSONL files through today's path: issue 49's
hook, until the tokenizing pass of issue 48 takes it over (numpy only: no Ray, no torch).

`sources.token_windows` and `sources.describe` send a preference source here instead
of to the packed windows of `pieces.py`: pairs are rows, never packed, and are not kept
in the token cache, so the driver's count and every read task tokenize them (one
process each). The rules are jsonl's: a record goes to train or val by a hash of its
file's name under ``data.path`` and its line index (`sources.split_keys`), and the
``i``-th pair of a file's split gets ``sample_id = file_index << 32 | i`` (bit 31 set
for val, `jsonl._first_id`). Issue 48's pass only needs to call
`preference.encode_pairs` with the same ids and splits.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from raytrain_platform.data import pool
from raytrain_platform.data.encode import _batches, load_tokenizer
from raytrain_platform.data.jsonl import JsonlSpec, _check_split, _file_blocks, _first_id, _records, jsonl_files, stream_rows
from raytrain_platform.data.preference import empty_pairs, encode_pairs
from raytrain_platform.data.sources import rebatch, split_key, split_keys, split_mask
from raytrain_platform.errors import DataError

__all__ = ["stream_pair_rows", "pair_rows", "count_pairs"]


def _pair_batches(file_index: int, path: str, spec: JsonlSpec,
                  splits: tuple[str, ...]) -> Iterator[tuple[str, dict[str, np.ndarray], int]]:
    """(split, pair rows, pairs truncated) of the file's records in `splits`, a
    tokenizer batch at a time, in line order. The first bad line is the one named,
    whatever the batch or split."""
    tok = load_tokenizer(spec.tokenizer, need_chat_template=False)  # chat pairs check it themselves
    pair_spec, key = spec.pair_spec(), split_key(path, spec.path)
    records = (record for first, data in _file_blocks(path, pool.BLOCK_BYTES)
               for record in _records(path, data, spec, first))
    done = {"train": 0, "val": 0}  # pairs of each split so far: the next one's index
    for batch in _batches(records, lambda item: item[2]):
        keys = split_keys(key, np.array([line for line, _, _ in batch], dtype=np.int64))
        names = ["val" if v else "train" for v in split_mask(keys, spec.val_fraction, "val").tolist()]
        keep = [(name, line, record) for name, (line, record, _) in zip(names, batch) if name in splits]
        ids = []
        for name, _, _ in keep:
            ids.append(_first_id(file_index, name) | done[name])
            done[name] += 1
        rows, cut = encode_pairs(tok, [r for _, _, r in keep], pair_spec, np.array(ids, dtype=np.int64),
                                 where=lambda k: f"{path}:{keep[k][1] + 1}: ")
        for split in splits:
            at = np.array([name == split for name, _, _ in keep], dtype=bool)
            yield split, {k: v[at] for k, v in rows.items()}, int(cut[at].sum())


def stream_pair_rows(file_index: int, path: str, spec: JsonlSpec, split: str, *,
                     rows: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """One file's `split` pairs, `rows` at a time (default `jsonl.stream_rows`; the last
    chunk may hold fewer), as they are tokenized: `preference.PAIR_ARRAYS`, each pair
    one row of ``seq_len`` tokens per side."""
    _check_split(split)
    rows = rows or stream_rows(spec.seq_len)
    return rebatch((part for _, part, _ in _pair_batches(file_index, path, spec, (split,))), rows, tail=True)


def pair_rows(file_index: int, path: str, spec: JsonlSpec, split: str) -> dict[str, np.ndarray]:
    """`stream_pair_rows` of one file joined (empty arrays of the right shapes if none)."""
    parts = list(stream_pair_rows(file_index, path, spec, split))
    if not parts:
        return empty_pairs(0, spec.seq_len)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def count_pairs(spec: JsonlSpec) -> tuple[int, int, int]:
    """(train, val, truncated) pairs over all files, every record checked and tokenized
    (a bad one is a DataError naming its ``path:line``); DataError when there is no
    training pair."""
    counts = {"train": 0, "val": 0}
    truncated = 0
    for file_index, path in enumerate(jsonl_files(spec)):
        for split, part, cut in _pair_batches(file_index, path, spec, ("train", "val")):
            counts[split] += len(part["sample_id"])
            truncated += cut
    if counts["train"] == 0:
        raise DataError(f"data.path = {spec.path!r}: no training pair (data.format preference)")
    return counts["train"], counts["val"], truncated
