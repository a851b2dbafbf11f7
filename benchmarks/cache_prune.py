"""What keeping the token cache within `RTP_CACHE_MAX_SIZE` costs (`data/window_cache.py`):
the driver looks over the cache after every count pass, and every read of an entry now
takes a shared lock and marks the entry used.

    python benchmarks/cache_prune.py            # 5,000 entries, 5 repeats, ~1 min; writes benchmarks/cache_prune.json
    python benchmarks/cache_prune.py --smoke    # 200 entries, 1 repeat (nothing written unless --out)

A cache of `--entries` entries (8 windows of 257 tokens each, last used over the past
ten days) in a temporary folder on this machine's disk. Timed, medians of the repeats:
- `entries`: listing the cache (one stat per file of every entry);
- `prune` with the cache under its limit: what every count pass adds when nothing goes;
- `prune` removing the oldest tenth: per entry removed (an exclusive lock, a rename,
  the files deleted);
- reading one entry 1,000 times through `read` (the shared lock, the map, the mark)
  and through `_arrays` (the map alone, as before eviction).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import stamp, write_result  # noqa: E402

from raytrain_platform.data import window_cache  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROWS, SEQ_LEN = 8, 257


def make_cache(folder: Path, n: int) -> int:
    """`n` entries through `window_cache.Writer`, last used over the past ten days; their bytes."""
    chunk = {"tokens": np.ones((ROWS, SEQ_LEN), np.int32), "loss_mask": np.ones((ROWS, SEQ_LEN), np.uint8),
             "sample_id": np.arange(ROWS, dtype=np.int64)}
    now = time.time()
    real_fsync = os.fsync
    os.fsync = lambda fd: None  # building the fixture, not timed: no need to reach the platter
    try:
        for i in range(n):
            writer = window_cache.Writer(folder / f"{i:08d}", {"i": i}, SEQ_LEN)
            writer.add(chunk)
            writer.commit()
            when = now - 10 * 86400 * (n - i) / n
            os.utime(folder / f"{i:08d}" / "meta.json", (when, when))
    finally:
        os.fsync = real_fsync
    return sum(e.bytes for e in window_cache.entries(folder))


def one_repeat(work: Path, n: int, reads: int) -> dict:
    folder = work / f"cache-{time.monotonic_ns()}"
    total = make_cache(folder, n)
    t0 = time.perf_counter()
    found = window_cache.entries(folder)
    listing = time.perf_counter() - t0
    t0 = time.perf_counter()
    under = window_cache.prune(folder, total)
    under_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tenth = window_cache.prune(folder, total - sum(e.bytes for e in found[: n // 10]))
    tenth_s = time.perf_counter() - t0
    if under.removed or tenth.removed != n // 10:
        raise RuntimeError(f"prune removed {under.removed} under the limit and {tenth.removed} of the "
                           f"oldest {n // 10}")
    entry = found[-1].path
    t0 = time.perf_counter()
    for _ in range(reads):
        window_cache.read(entry, {"i": n - 1}, SEQ_LEN).close()
    read_s = (time.perf_counter() - t0) / reads
    t0 = time.perf_counter()
    for _ in range(reads):
        window_cache._arrays(entry, {"i": n - 1}, SEQ_LEN)
    arrays_s = (time.perf_counter() - t0) / reads
    return {"entries_s": listing, "prune_under_limit_s": under_s, "prune_tenth_s": tenth_s,
            "remove_per_entry_ms": 1e3 * tenth_s / tenth.removed, "read_us": 1e6 * read_s,
            "map_only_us": 1e6 * arrays_s, "cache_bytes": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="200 entries, 1 repeat (checks it runs)")
    p.add_argument("--entries", type=int, default=None, help="entries in the cache (default 5,000; smoke 200)")
    p.add_argument("--repeats", type=int, default=None, help="default 5; smoke 1")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON result (default benchmarks/cache_prune.json; with --smoke: none)")
    args = p.parse_args(argv)
    n = args.entries or (200 if args.smoke else 5000)
    repeats = args.repeats or (1 if args.smoke else 5)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rtp-cache-prune-") as tmp:
        runs = []
        for i in range(repeats):
            runs.append(one_repeat(Path(tmp), n, 100 if args.smoke else 1000))
            print(f"repeat {i + 1}/{repeats}: " + ", ".join(f"{k} {v:.4g}" for k, v in runs[-1].items()), flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result = {**stamp(), "entries": n, "repeats": repeats, "runs": runs,
              "median": {k: round(v, 6) for k, v in med.items()},
              "command": " ".join(["python benchmarks/cache_prune.py", *(sys.argv[1:] if argv is None else argv)]),
              "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result["median"]))
    write_result(result, args.out or (None if args.smoke else BENCH / "cache_prune.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
