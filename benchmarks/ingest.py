"""Ray Data ingest as the platform uses it vs `torch.utils.data.DataLoader` over the
same Parquet files, and the ingest settings tried on top of the platform's.

    python benchmarks/ingest.py            # ~1 min on 2 quiet CPU cores
    python benchmarks/ingest.py --smoke    # a tiny file set, one repeat

Data: 4 Parquet files of synthetic rows (64 float32 features, an int64 label), row
groups of 4,096 rows, written by the platform's own `write_tabular_parquet`. Each side
yields the same batches, ``{"x": (256, 64) float32, "y": (256,), "sample_id": (256,)}``
torch tensors, in the training process; the consumer touches every batch (a sum over
``x``) and does nothing else, so rows/s is the pipeline's own rate (start-up included:
from the iterator's creation to its last batch).

- ``ray_data``: the platform's path, unchanged: `build_datasets` (read tasks of 16,384
  rows: 4 row groups each, one block per task), the shard a 1-worker `TorchTrainer` gets (`DataConfig.configure` with the
  platform's `ingest_options`, so a streaming split of 1 with order preserved), then
  `iter_batches(..., batch_format="numpy")` wrapped zero-copy by the worker's `as_tensors`,
  with the config's default prefetch (2 batches).
- ``dataloader``: what a PyTorch user writes: an `IterableDataset` that reads one row group
  at a time with pyarrow and slices it into batches, `DataLoader(batch_size=None,
  num_workers=1)` (the reader in its own process, as Ray Data's are); ``num_workers=0``
  too. (A map-style dataset with per-row ``__getitem__`` and default collate is far
  slower; this is the strong baseline.)
- Variants of the Ray path (one change each): Ray's own `iter_torch_batches` (the
  collate the platform replaced by zero-copy numpy), prefetch 8, and one row group
  (4,096 rows) per read task and block, the platform's earlier reads (the "before" of
  the tuning row).
- ``ray_data_2w``: the platform's pipeline for a 2-worker job, which cuts the data into
  blocks of exactly one micro-batch (a strict streaming repartition) so that the
  streaming split deals micro-batches round-robin; both shards consumed here.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from common import (ROW_GROUP_ROWS, harness_parser, interleaved, local_ray, out_path, result_meta,
                    stamp, tabular_data, write_result)

BATCH, FEATURES = 256, 64


def _config(data: Path, prefetch: int) -> dict:
    return {"model": {"name": "mlp", "kwargs": {"hidden_sizes": [64]}},
            "data": {"source": "parquet", "path": str(data), "batch_size": BATCH,
                     "val_fraction": 0.0, "prefetch_batches": prefetch},
            "train": {"max_steps": 1}, "parallel": {"strategy": "none"},
            "scaling": {"num_workers": 1, "cpus_per_worker": 1, "torch_threads": 1},
            "run": {"name": "ingest", "storage_path": str(data.parent / "runs")}}


def _consume(batches) -> dict:
    """Rows/s of an iterator of torch batches, from its creation to its last batch."""
    t0 = time.perf_counter()
    rows, first, checksum = 0, None, 0.0
    for b in batches:
        checksum += float(b["x"].sum())
        rows += b["x"].shape[0]
        if first is None:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    first = first or 0.0
    # Steady: after the first batch (Ray's streaming executor starts its tasks first).
    steady = (rows - BATCH) / (total - first) if total > first and rows > BATCH else 0.0
    return {"rows": rows, "rows_per_s": rows / total, "steady_rows_per_s": steady,
            "first_batch_s": first, "seconds": total}


def _shards(data: Path, *, prefetch: int = 2, rows_per_read: int | None = None, world: int = 1):
    """The iterators the workers of a `world`-worker TorchTrainer get, built as the
    platform builds them (for several workers: blocks of exactly one micro-batch);
    `rows_per_read`: the platform's Parquet reads with another block size."""
    from ray.train import DataConfig

    from raytrain_platform.data import sources
    from raytrain_platform.data.ray_data import build_datasets, ingest_options, parquet_dataset
    from raytrain_platform.launch.trainer import prepare

    cfg = _config(data, prefetch)
    cfg["scaling"]["num_workers"] = world
    cfg["parallel"]["strategy"] = "ddp" if world > 1 else "none"
    job = prepare(cfg)
    if rows_per_read is None:
        ds = build_datasets(job.config, job.data)["train"]
    else:
        ds = parquet_dataset(sources.SourceSpec.from_config(job.config), "train", job.data.feature_columns,
                             rows_per_read=rows_per_read)
    ds.context.enable_progress_bars = False
    config = DataConfig(datasets_to_split=["train"], execution_options=ingest_options())
    return [split["train"] for split in config.configure(
        {"train": ds}, world_size=world, worker_handles=None, worker_node_ids=None)]


def ray_side(data: Path, *, prefetch: int = 2, rows_per_read: int | None = None,
             torch_batches: bool = False) -> dict:
    from raytrain_platform.launch.worker import as_tensors

    it, = _shards(data, prefetch=prefetch, rows_per_read=rows_per_read)
    if torch_batches:
        return _consume(it.iter_torch_batches(batch_size=BATCH, drop_last=True, prefetch_batches=prefetch))
    return _consume(map(as_tensors, it.iter_batches(batch_size=BATCH, batch_format="numpy",
                                                     drop_last=True, prefetch_batches=prefetch)))


def ray_two_workers(data: Path) -> dict:
    """Both shards of a 2-worker job (one consumer thread each, in this process): rows/s of
    the two together, from the iterators' creation to the last batch of the slower."""
    from concurrent.futures import ThreadPoolExecutor

    from raytrain_platform.launch.worker import as_tensors

    shards = _shards(data, world=2)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(lambda it: _consume(map(as_tensors, it.iter_batches(
            batch_size=BATCH, batch_format="numpy", drop_last=True, prefetch_batches=2))), shards))
    total = time.perf_counter() - t0
    rows = sum(p["rows"] for p in parts)
    first = max(p["first_batch_s"] for p in parts)
    return {"rows": rows, "rows_per_s": rows / total, "first_batch_s": first,
            "steady_rows_per_s": (rows - 2 * BATCH) / (total - first) if total > first else 0.0,
            "seconds": total}


class ParquetBatches(torch.utils.data.IterableDataset):
    """Row groups in file order, read with pyarrow, sliced into batches of `batch` rows."""

    def __init__(self, folder: Path, batch: int):
        self.files, self.batch = sorted(str(p) for p in folder.glob("*.parquet")), batch

    def __iter__(self):
        import pyarrow.parquet as pq

        info = torch.utils.data.get_worker_info()
        groups = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).num_row_groups)]
        if info is not None:  # each DataLoader worker its own row groups
            groups = groups[info.id::info.num_workers]
        first_id = 0
        carry: list[np.ndarray] | None = None
        for path, group in groups:
            table = pq.ParquetFile(path).read_row_group(group)
            x = np.stack([table.column(f"f{j}").to_numpy() for j in range(FEATURES)], axis=1)
            y = table.column("label").to_numpy()
            ids = np.arange(first_id, first_id + len(y), dtype=np.int64)
            first_id += len(y)
            if carry is not None:  # rows left over from the previous row group
                x, y, ids = (np.concatenate([c, a]) for c, a in zip(carry, (x, y, ids)))
            whole = len(y) // self.batch * self.batch
            for lo in range(0, whole, self.batch):
                yield {"x": torch.from_numpy(x[lo:lo + self.batch]),
                       "y": torch.from_numpy(y[lo:lo + self.batch]),
                       "sample_id": torch.from_numpy(ids[lo:lo + self.batch])}
            carry = [x[whole:], y[whole:], ids[whole:]] if whole < len(y) else None


def dataloader_side(data: Path, workers: int) -> dict:
    loader = torch.utils.data.DataLoader(ParquetBatches(data, BATCH), batch_size=None,
                                         num_workers=workers, prefetch_factor=4 if workers else None)
    return _consume(loader)


VARIANTS = {  # name -> (what it is, function of the data folder)
    "ray_data": ("platform as it is: Ray Data shard, numpy batches wrapped zero-copy, prefetch 2",
                 lambda d: ray_side(d)),
    "dataloader": ("torch DataLoader, 1 worker process, IterableDataset over row groups",
                   lambda d: dataloader_side(d, 1)),
    "dataloader_inproc": ("torch DataLoader, num_workers=0 (reads in the training process)",
                          lambda d: dataloader_side(d, 0)),
    "ray_torch_batches": ("Ray Data iter_torch_batches (Ray's collate; the platform's earlier path)",
                          lambda d: ray_side(d, torch_batches=True)),
    "ray_prefetch8": ("platform path, prefetch 8 batches", lambda d: ray_side(d, prefetch=8)),
    "ray_rowgroup_blocks": ("platform path with one row group (4,096 rows) per read task and block "
                            "(its reads before this tuning)", lambda d: ray_side(d, rows_per_read=ROW_GROUP_ROWS)),
    "ray_data_2w": ("platform path for 2 workers (blocks of one micro-batch, streaming split of 2), "
                    "both shards read by 2 threads here", ray_two_workers),
}

SMOKE_VARIANTS = ("ray_data", "dataloader", "ray_rowgroup_blocks", "ray_data_2w")


def measure(work: Path, *, smoke: bool, repeats: int | None = None) -> dict:
    """{"ingest": {...}}: rows/s medians of interleaved repeats per variant, ratios to the
    DataLoader and to the platform's current path."""
    rows = 16_384 if smoke else 131_072
    repeats = repeats or (1 if smoke else 2)
    data = tabular_data(work / "ingest-data", rows, features=FEATURES)
    local_ray()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not smoke:
            ray_side(data)  # warm-up, not counted: Ray's worker processes start on first use
        variants = {k: VARIANTS[k] for k in SMOKE_VARIANTS} if smoke else VARIANTS
        runs = interleaved({name: (lambda i, fn=fn: fn(data)) for name, (_, fn) in variants.items()},
                           repeats, label="ingest ")
    per = {name: {"what": VARIANTS[name][0],
                  "rows_per_s": round(statistics.median(r["rows_per_s"] for r in rs), 1),
                  "steady_rows_per_s": round(statistics.median(r["steady_rows_per_s"] for r in rs), 1),
                  "first_batch_s": round(statistics.median(r["first_batch_s"] for r in rs), 3),
                  "rows": rs[0]["rows"]} for name, rs in runs.items()}
    base, platform = per["dataloader"]["rows_per_s"], per["ray_data"]["rows_per_s"]
    for entry in per.values():
        entry["vs_dataloader"] = round(entry["rows_per_s"] / base, 3)
        entry["vs_platform"] = round(entry["rows_per_s"] / platform, 3)
    return {"ingest": {**stamp(), "repeats": repeats, "rows": rows, "batch": BATCH,
                       "features": FEATURES, "variants": per}}


def table_rows(results: dict) -> list[str]:
    e = results.get("ingest")
    if not e:
        return []
    v = e["variants"]
    dl, inproc, plat = v["dataloader"], v.get("dataloader_inproc"), v["ray_data"]
    rows = [f"| Ray Data ingest as the platform uses it (1 worker) vs torch DataLoader (1 worker process) "
            f"over the same Parquet files, rows/s, start-up included (after the first batch: "
            f"{plat['steady_rows_per_s']:,.0f} vs {dl['steady_rows_per_s']:,.0f}) | {plat['rows_per_s']:,.0f} | "
            f"{dl['rows_per_s']:,.0f} | {plat['vs_dataloader']:.2f} | |"]
    if inproc:
        rows.append(f"| the same vs DataLoader with num_workers=0 (reading in the training process) | "
                    f"{plat['rows_per_s']:,.0f} | {inproc['rows_per_s']:,.0f} | "
                    f"{plat['rows_per_s'] / inproc['rows_per_s']:.2f} | |")
    before = v.get("ray_rowgroup_blocks")
    if before:
        rows.append(f"| ingest tuning, after vs before: read tasks of 16,384 rows vs one 4,096-row row "
                    f"group each, rows/s (after the first batch: {plat['steady_rows_per_s']:,.0f} vs "
                    f"{before['steady_rows_per_s']:,.0f}) | {plat['rows_per_s']:,.0f} | "
                    f"{before['rows_per_s']:,.0f} | {plat['rows_per_s'] / before['rows_per_s']:.2f} | |")
    if "ray_data_2w" in v:
        w2 = v["ray_data_2w"]
        rows.append(f"| the platform's 2-worker ingest (blocks of one micro-batch) vs its 1-worker "
                    f"ingest, rows/s | {w2['rows_per_s']:,.0f} | {plat['rows_per_s']:,.0f} | "
                    f"{w2['vs_platform']:.2f} | |")
    return rows


def detail(results: dict) -> str:
    e = results.get("ingest")
    if not e:
        return ""
    lines = [f"Ingest variants ({e['rows']:,} rows x {e['features']} float32 features, batch "
             f"{e['batch']}, median of {e['repeats']} interleaved repeats, {e['date']}, load "
             f"{e['load_avg_1m']}):", "",
             "| variant | rows/s | after first batch | first batch s | vs DataLoader | vs platform now |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, v in e["variants"].items():
        lines.append(f"| {name}: {v['what']} | {v['rows_per_s']:,.0f} | {v['steady_rows_per_s']:,.0f} | "
                     f"{v['first_batch_s']:.2f} | "
                     f"{v['vs_dataloader']:.2f} | {v['vs_platform']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = harness_parser(__doc__)  # a section of run.py, which renders the table and the results page
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rtp-ingest-") as tmp:
        result = measure(Path(tmp), smoke=args.smoke, repeats=args.repeats)
    print(json.dumps(result, indent=2))
    write_result({"_meta": result_meta(__file__, argv), **result}, out_path(args))
    print(detail(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
