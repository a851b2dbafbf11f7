"""Ray Data pipelines for the sources: read -> cut/tokenize/generate -> split -> shard.

Tokenized sources (jsonl, text with a tokenizer) are read from the dataset the
tokenizing pass wrote (`tokenize_pass.py`): Ray Data's read tasks stream its Parquet
windows a chunk at a time, and the training loop only receives int32 token windows and
their loss masks. There is one task per piece (a .jsonl file, or a group of text
files), except for a train split dealt to several workers: there one task reads the
pieces in order and yields one micro-batch per block. Their validation split is only
what evaluation reads (its first `run.eval_batches` micro-batches per rank), read on
the driver into one in-memory block.

Ordering is part of the contract. With ``preserve_order`` the pipeline yields
samples in source order; for several workers it is cut into blocks of exactly one
micro-batch, and Ray Train's streaming split deals equal blocks to the workers in
turn (it hands each block to the worker that has received the fewest rows). So
micro-batch ``j`` of an epoch goes to rank ``j % world``, and the union of one
optimizer step's micro-batches is the same set of samples at any world size:
1 worker x batch 2B, 2 workers x B and 1 worker x B x accumulation 2 train on the
same data at every step (the equivalence tests rely on it; the torchrun reader in
`local.py` implements the same rule without Ray).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterator

import numpy as np

from raytrain_platform.compat.ray_private import limit_streaming_blocks
from raytrain_platform.data import parquet, raw, sources
from raytrain_platform.data.packing import joined
from raytrain_platform.data.sources import DataInfo, SourceSpec
from raytrain_platform.parallel.dims import ParallelDims

if TYPE_CHECKING:
    import ray.data

    from raytrain_platform.config import JobConfig

__all__ = ["STREAM_TOKENS", "build_datasets", "ingest_options", "parquet_dataset"]

_ROWS_PER_READ = 16_384  # rows of Parquet one read task turns into one block
# Windows per block a tokenized source's read task yields: about this many tokens, so
# the first batch waits for one small read.
STREAM_TOKENS = 1 << 13
# Blocks a tokenized source's task may produce ahead of the consumer. Ray Data's
# default (a private DataContext setting) lets a streaming task run only 2 blocks
# ahead, and a dealt train split's blocks are single micro-batches: every micro-batch
# then waited for an executor round trip (benchmarks/results/hf-data-2026-12-05.md).
_TOKEN_BLOCKS_AHEAD = 64


class _TextWindows:
    def __init__(self, spec: SourceSpec, split: str):
        self.spec, self.split = spec, split

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        parts = [raw.text_windows(int(i), str(p), self.spec, self.split)
                 for i, p in zip(batch["file_index"], batch["path"])]
        return {k: np.concatenate([p[k] for p in parts]) for k in ("tokens", "sample_id")}


class _TokenWindows:
    """A read task over one or more pieces of the tokenized dataset in order: their
    windows, yielded in chunks of exactly `rows` windows (the last may hold fewer),
    across piece ends."""

    def __init__(self, spec: SourceSpec, split: str, rows: int):
        self.spec, self.split, self.rows = spec, split, rows

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        chunks = (chunk for i in batch["index"]
                  for chunk in sources.token_windows(int(i), self.spec, self.split, rows=self.rows))
        yield from sources.rebatch(chunks, self.rows, tail=True)


class _Synthetic:
    def __init__(self, spec: SourceSpec):
        self.spec = spec

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return sources.synthetic_rows(batch["id"], self.spec)


class _ParquetChunks:
    def __init__(self, spec: SourceSpec, features: tuple[str, ...], split: str, root: str):
        self.spec, self.features, self.split, self.root = spec, features, split, root

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        columns = ("path", "row_group", "first_id", "num_rows", "file_row", "key")
        parts = [parquet.read_parquet_chunk(
            parquet.ParquetChunk(str(p), int(rg), int(first), int(n), int(row), int(key)), self.spec,
            self.features, self.split, self.root)
            for p, rg, first, n, row, key in zip(*(batch[c] for c in columns))]
        return {k: np.concatenate([p[k] for p in parts]) for k in ("x", "y", "sample_id")}


def _chunk_bytes(rows: int, seq_len: int, packing: str = "concat", *, pairs: bool = False) -> int:
    """Bytes of the block Ray Data makes of `rows` windows, or preference pairs' rows
    (its own conversion): a pair's row holds two sides, so a window's size would cut
    a dealt micro-batch of pairs in two."""
    from ray.data.block import BlockAccessor

    batch = joined([], seq_len, packing, pairs=pairs)
    batch = {k: np.zeros((rows, *v.shape[1:]), v.dtype) for k, v in batch.items()}
    return BlockAccessor.for_block(BlockAccessor.batch_to_block(batch)).size_bytes()


def _source_dataset(spec: SourceSpec, split: str, features: tuple[str, ...], *,
                    rows: int | None = None, one_task: bool = False) -> "ray.data.Dataset":
    """The source's `split`, in source order. A tokenized source streams: its read tasks
    (one per piece, or with `one_task` a single one over all pieces in order) yield
    blocks of exactly `rows` windows (default about `STREAM_TOKENS` tokens; each
    task's last block may hold fewer) as they read."""
    import ray.data

    if spec.tokenized:
        pieces = sources.token_pieces(spec, split)
        rows = rows or max(1, STREAM_TOKENS // spec.seq_len)
        tasks = 1 if one_task else len(pieces)
        indices = ray.data.from_items([{"index": i} for i in pieces], override_num_blocks=tasks)
        ds = indices.map_batches(_TokenWindows(spec, split, rows), batch_size=None if one_task else 1,
                                 batch_format="numpy")
        # Each chunk a task yields becomes a block at once, so a consumer waits for one
        # chunk, not a whole file. Ray Data's output buffer (a public setting) cuts a
        # block once it holds more than this many bytes and slices any of 1.5x or more:
        # a chunk is 1.25x it.
        ds.context.target_max_block_size = _chunk_bytes(rows, spec.seq_len, spec.window_packing,
                                                        pairs=spec.pairs) * 4 // 5
        limit_streaming_blocks(ds.context, _TOKEN_BLOCKS_AHEAD)
        return ds
    if spec.kind == "text":
        files = sources.text_files(spec.path, spec.glob, spec.max_files)
        items = [{"file_index": i, "path": p} for i, (p, _) in enumerate(files)]
        ds = ray.data.from_items(items, override_num_blocks=min(len(items), 64))
        return ds.map_batches(_TextWindows(spec, split), batch_size=16, batch_format="numpy")
    if spec.kind == "synthetic":
        ids = raw.synthetic_ids(spec, split)
        rate = spec.max_read_rows_per_s
        if not rate:
            ds = ray.data.from_numpy(ids).rename_columns({"data": "id"})
            return ds.map_batches(_Synthetic(spec), batch_size=4096, batch_format="numpy")
        # Throttled: tasks of a tenth of a second each, so rows stream at the rate rather
        # than all at once at the end of one long task.
        piece = max(16, int(rate // 10))
        ds = ray.data.from_items([{"id": int(i)} for i in ids], override_num_blocks=-(-ids.size // piece))
        return ds.map_batches(_Synthetic(spec), batch_size=piece, batch_format="numpy")
    return parquet_dataset(spec, split, features)


def parquet_dataset(spec: SourceSpec, split: str, features: tuple[str, ...], *,
                    rows_per_read: int = _ROWS_PER_READ) -> "ray.data.Dataset":
    """The Parquet source's `split`: row groups read several to a task, into one block
    of about `rows_per_read` rows (at least one row group). Each block costs the
    training process a fixed fetch, so fewer, larger blocks stream faster
    (benchmarks/ingest.py: 1.3x rows/s at 16,384 rows vs one 4,096-row row group per
    block). Row order is unchanged."""
    import ray.data

    root, chunks = parquet.split_chunks(spec, split)
    items = [dataclasses.asdict(c) for c in chunks]
    per_read = max(1, rows_per_read // max(1, max(c.num_rows for c in chunks)))
    ds = ray.data.from_items(items, override_num_blocks=min(-(-len(items) // per_read), 64))
    return ds.map_batches(_ParquetChunks(spec, features, split, root), batch_size=per_read,
                          batch_format="numpy")


def _eval_dataset(spec: SourceSpec, cfg: "JobConfig", info: DataInfo) -> "ray.data.Dataset":
    """A tokenized validation split as evaluation reads it, once per attempt: its first
    `run.eval_batches` micro-batches per data-parallel rank, read here on the driver
    from the tokenized dataset into one in-memory block. That covers any
    worker count an elastic run gets (at most `scaling.num_workers`). Not a read task: the train split's task keeps its
    CPU while it streams the epoch, and a validation task that needs one more CPU than
    is free waits for that task to end, with training stopped at its first evaluation
    (benchmarks/results/hf-data-2026-12-05.md)."""
    import ray.data
    from ray.data.block import BlockAccessor

    most_read = cfg.run.eval_batches * cfg.data.micro_batch * ParallelDims.from_config(cfg).dp
    rows = sources.head(spec, "val", min(info.num_val, most_read))
    assert rows is not None, "build_datasets reads a validation split only when it has rows"
    return ray.data.from_arrow(BlockAccessor.batch_to_block(rows))


def build_datasets(cfg: "JobConfig", info: DataInfo) -> dict[str, "ray.data.Dataset"]:
    """{"train": ..., "val": ...} Ray Datasets for the config; val only if it has rows."""
    spec = SourceSpec.from_config(cfg, prepared=info.prepared)
    world, batch = cfg.scaling.num_workers, cfg.data.micro_batch
    out = {}
    for split, rows in (("train", info.num_train), ("val", info.num_val)):
        if rows == 0:
            continue
        dealt = world > 1 and split == "train" and cfg.data.split_across_workers and \
            not ParallelDims.from_config(cfg).model_parallel
        if split == "val" and spec.tokenized:
            ds = _eval_dataset(spec, cfg, info)
        elif dealt and spec.tokenized:
            # Exactly one micro-batch per block (see the module docstring), cut as one
            # task tokenizes the pieces in order. Not Ray's strict repartition: as a
            # separate operator it received a running task's blocks only when the task
            # ended (Ray 2.60: a new execution's resource limits read zero for its first
            # second), so every epoch's first batch waited for the first file to be
            # tokenized whole (benchmarks/results/hf-data-2026-12-05.md).
            ds = _source_dataset(spec, split, info.feature_columns, rows=batch, one_task=True)
        else:
            ds = _source_dataset(spec, split, info.feature_columns)
            if dealt:
                # Exactly one micro-batch per block: the streaming split then deals
                # micro-batches round-robin (see the module docstring).
                ds = ds.repartition(target_num_rows_per_block=batch, strict=True)
        out[split] = ds
    return out


def ingest_options():
    """Execution options for the training shards: deterministic order, quiet progress."""
    from ray.data import ExecutionOptions

    options = ExecutionOptions()
    options.preserve_order = True
    options.locality_with_output = False
    return options
