"""The data's front door: what a source holds (`describe`) and its samples in order
(`iter_source`), for every kind of source. Ray Data pipelines (`ray_data.py`) and the
Ray-free torchrun reader (`local.py`) both read through here, so the two paths see the
same samples in the same order.

Every sample has a stable 64-bit ``sample_id``: text windows are
``file_index << 32 | window_index``, synthetic rows are their index (`raw.py`), Parquet
rows their position across the sorted files (`parquet.py`). A tokenized source (jsonl,
text with a tokenizer) is tokenized once, by the tokenizing pass (`tokenize_pass.py`),
into a dataset of windows (`prepared.py`): a piece's windows are ``piece_index << 32 |
window_index`` (jsonl's validation windows also set bit 31). A ``preference`` jsonl
source's pass writes pair rows instead of windows (`preference.py`), never packed: the
``i``-th pair of a file's split is ``piece_index << 32 | i``, by the same rule. The
validation split's rules are `splits.py`'s.

The modules below, in order: `splits` (file systems, the split's rules), `specs`,
`encode` and `packing` (tokenizing and packing), the readers (`jsonl`, `text_groups`,
`parquet`, `raw`) behind `pieces`, the pass (`prepared`, `tokenize_pass`), then this.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from raytrain_platform.data.mixed import is_mixture, mixture_pieces, mixture_windows, prepare_mixture
from raytrain_platform.data.packing import joined
from raytrain_platform.data.prepared import Manifest, load_manifest, read_windows
from raytrain_platform.data.raw import synthetic_ids, synthetic_rows, text_split, text_windows
from raytrain_platform.data.specs import DataInfo, SourceSpec, split_by_file
from raytrain_platform.data.splits import (VAL_SPLIT, default_text_root, filesystem, rebatch, split_key, split_keys,
                                           split_mask, text_files)
from raytrain_platform.data.tokenize_pass import prepare, say

__all__ = [
    # re-exported: what readers of a source use
    "SourceSpec", "DataInfo", "VAL_SPLIT", "default_text_root", "filesystem", "split_mask", "split_key",
    "split_keys", "split_by_file", "rebatch", "synthetic_rows", "text_windows", "text_files",
    # the front door
    "describe", "prepared", "token_pieces", "token_windows", "iter_source", "head", "local_windows",
]


def prepared(spec: SourceSpec) -> Manifest:
    """The tokenized dataset `spec.prepared` names (`describe` wrote or found it)."""
    if not spec.prepared:
        raise ValueError("a tokenized source is read from its dataset: SourceSpec.from_config(..., prepared=...)")
    return load_manifest(spec.prepared)


def describe(spec: SourceSpec, *, on_ray: bool | None = None) -> DataInfo:
    """Exact train/val sizes and tabular shape, from file sizes and metadata only. A
    tokenized source's are its dataset's, written by the tokenizing pass first if no
    pass has (on Ray where `on_ray`, default: where this process is connected)."""
    if spec.tokenized:
        manifest = (prepare_mixture(spec, on_ray=on_ray, say=say) if spec.kind == "mixture" else
                    prepare(spec, on_ray=on_ray))
        return DataInfo(num_train=manifest.windows["train"], num_val=manifest.windows["val"],
                        truncated=manifest.content["truncated"], prepared=manifest.dir)
    if spec.kind == "text":
        val = np.concatenate([text_split(path, size, spec, "val")
                              for path, size in text_files(spec.path, spec.glob, spec.max_files)])
        return DataInfo(num_train=int((~val).sum()), num_val=int(val.sum()))
    if spec.kind == "synthetic":
        ids = np.arange(spec.num_samples, dtype=np.int64)
        classes = spec.num_classes if spec.task == "classification" else 0
        is_val = split_mask(ids, spec.val_fraction, "val")
        return DataInfo(num_train=int((~is_val).sum()), num_val=int(is_val.sum()),
                        num_features=spec.num_features if spec.task != "lm" else 0, num_classes=classes)
    from raytrain_platform.data import parquet

    return parquet.describe_parquet(spec)


def token_pieces(spec: SourceSpec, split: str) -> list[int]:
    """The pieces of a tokenized source's dataset with `split` windows, in order (a
    mixture's: its training epoch's groups of chunks, its sources' validation splits)."""
    manifest = prepared(spec)
    return mixture_pieces(manifest, split) if is_mixture(manifest) else manifest.pieces(split)


def token_windows(piece: int, spec: SourceSpec, split: str, *, rows: int) -> Iterator[dict[str, np.ndarray]]:
    """A piece's `split` windows from the tokenized dataset, `rows` at a time:
    tokens int32 and loss_mask uint8 (n, seq_len), sample_id (n,), with ``data.packing:
    documents`` position_ids int32 (n, seq_len)."""
    manifest = prepared(spec)
    chunks = (mixture_windows(manifest, piece, split, rows) if is_mixture(manifest) else
              read_windows(manifest, piece, split, rows))
    for chunk in chunks:
        yield spec.throttle(chunk)


_READ_ROWS = 1024  # windows per chunk where the reader does not say


def iter_source(spec: SourceSpec, split: str, features: tuple[str, ...] = ()) -> Iterator[dict[str, np.ndarray]]:
    """The whole split in source order, one piece (file, chunk) at a time: the order the
    Ray Data pipeline produces with ``preserve_order``."""
    if spec.tokenized:
        for piece in token_pieces(spec, split):
            yield from token_windows(piece, spec, split, rows=_READ_ROWS)
    elif spec.kind == "text":
        for i, (path, _) in enumerate(text_files(spec.path, spec.glob, spec.max_files)):
            yield text_windows(i, path, spec, split)
    elif spec.kind == "synthetic":
        ids = synthetic_ids(spec, split)
        for start in range(0, ids.size, 4096):
            yield synthetic_rows(ids[start:start + 4096], spec)
    else:
        from raytrain_platform.data import parquet

        root, chunks = parquet.split_chunks(spec, split)
        for chunk in chunks:
            yield parquet.read_parquet_chunk(chunk, spec, features, split, root)


def head(spec: SourceSpec, split: str, rows: int,
         features: tuple[str, ...] = ()) -> dict[str, np.ndarray] | None:
    """The first `rows` rows of `split` in source order (all of them if it has fewer;
    None if none), read only as far as they go."""
    return next(rebatch(iter_source(spec, split, features), rows, tail=True), None)


def local_windows(spec: SourceSpec, split: str) -> dict[str, np.ndarray]:
    """A tokenized source's whole `split` as one batch, its dataset written in this
    process where no pass has (benchmarks and notebooks that want the arrays)."""
    spec = dataclasses.replace(spec, prepared=describe(spec, on_ray=False).prepared)
    return joined(iter_source(spec, split), spec.seq_len, spec.packing, pairs=spec.pairs)
