"""The driver's count pass (`data/pieces.py`, `data/pool.py`): how fast it tokenizes a
JSONL file, with records tokenized 64 at a time in the driver's process, and on one
worker process per core (``data.tokenize_processes``); with ``--baseline REV``, also
the code of git revision REV (before this was built: one tokenizer call per record).

    python benchmarks/count_pass.py --baseline abdb3c5   # 3 interleaved repeats, ~6 min on 2 CPU cores; writes benchmarks/count_pass.json
    python benchmarks/count_pass.py --smoke              # small files, 1 repeat (nothing written unless --out)

The data is tiny_llm's: its byte-level BPE tokenizer (512 tokens) with its chat template,
and its three JSONL files of 5,000 standard-library docstring records (chat,
prompt_completion, text), each repeated `--copies` times (20: 20, 15 and 8 MB).
Each run is a fresh process that loads the tokenizer, then counts one file with a
fresh token cache (`RTP_CACHE_DIR`), as a first run over new data does: it tokenizes
every record, packs the windows (256 tokens + 1) and writes them; the time is the
count's. The sides alternate within each repeat; every side's counts and kept
windows must be the same, bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, interleaved, stamp, write_result  # noqa: E402

BENCH = Path(__file__).resolve().parent
FORMATS = ("chat", "prompt_completion", "text")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def make_data(work: Path, samples: int, copies: int) -> tuple[Path, dict[str, Path]]:
    """tiny_llm's tokenizer, and each format's JSONL repeated `copies` times."""
    from raytrain_platform.tools import tiny_llm

    made = tiny_llm.make_all(work / "tiny-llm", samples=samples)
    files = {}
    for fmt in FORMATS:
        text = made[fmt].read_text()
        files[fmt] = work / f"{fmt}.jsonl"
        files[fmt].write_text(text * copies)
    return made["tokenizer"], files


def _entries_digest(cache: Path) -> str:
    """The kept windows' bytes, each entry's files in turn, the entries ordered by
    split and their files (not by folder name: a name hashes the code that wrote it)."""
    entries = []
    for entry in (cache / "token-windows").iterdir():
        if entry.is_dir():
            key = json.loads((entry / "meta.json").read_text())["key"]
            data = b"".join(f.name.encode() + f.read_bytes() for f in sorted(entry.iterdir()) if f.name != "meta.json")
            entries.append((key["split"], json.dumps(key["files"]), data))
    return hashlib.sha256(b"".join(e[2] for e in sorted(entries))).hexdigest()[:16]


# One run, in a fresh process whose `raytrain_platform` is the tree on PYTHONPATH
# (argv: format, file, tokenizer, cache folder, processes; prints its figures as JSON).
_ONE = """
import dataclasses, json, os, sys, time
fmt, path, tokenizer, cache, processes = sys.argv[1:]
os.environ["RTP_CACHE_DIR"] = cache
from raytrain_platform.data import jsonl
kw = dict(path=path, format=fmt, tokenizer=tokenizer, seq_len=257, val_fraction=0.05)
if "tokenize_processes" in {f.name for f in dataclasses.fields(jsonl.JsonlSpec)}:
    kw["tokenize_processes"] = int(processes)
spec = jsonl.JsonlSpec(**kw)
jsonl.load_tokenizer(tokenizer, need_chat_template=True)
t0 = time.perf_counter()
counts = getattr(jsonl, "count_windows", None) or __import__("raytrain_platform.data.pieces", fromlist=["x"]).count_windows
counts = counts(spec)
print(json.dumps({"s": time.perf_counter() - t0, "counts": list(counts), "code": jsonl.__file__}))
"""


def count_once(tree: Path, tokenizer: Path, path: Path, fmt: str, cache: Path, processes: int) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", _ONE, fmt, str(path), str(tokenizer), str(cache), str(processes)],
                          env=env, capture_output=True, text=True, timeout=900, check=False, cwd=tree)
    if proc.returncode:
        raise RuntimeError(f"{fmt} ({tree}, {processes} processes) failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["code"]).resolve().is_relative_to(tree.resolve()), (got["code"], tree)
    seconds, size = got["s"], path.stat().st_size
    records = path.read_bytes().count(b"\n")
    return {"s": round(seconds, 2), "MB_per_s": round(size / seconds / 1e6, 2),
            "records_per_s": round(records / seconds), "counts": got["counts"], "windows": _entries_digest(cache)}


def measure(work: Path, *, samples: int, copies: int, repeats: int, processes: int,
            baseline: Path | None) -> dict:
    os.environ.update(OFFLINE_ENV)
    tokenizer, files = make_data(work, samples, copies)
    sides = {"batched": (ROOT, 1), f"{processes}_processes": (ROOT, processes)}
    if baseline is not None:
        sides = {"baseline": (baseline, 1), **sides}
    result: dict = {}
    for fmt in FORMATS:
        runs = interleaved({name: (lambda i, tree=tree, n=n: count_once(tree, tokenizer, files[fmt], fmt,
                                                                         work / "cache", n))
                            for name, (tree, n) in sides.items()}, repeats, label=f"{fmt}: ")
        seen = {(tuple(r["counts"]), r["windows"]) for rs in runs.values() for r in rs}
        assert len(seen) == 1, f"{fmt}: the sides disagree: {seen}"
        med = {name: statistics.median(r["s"] for r in rs) for name, rs in runs.items()}
        size = files[fmt].stat().st_size
        result[fmt] = {"bytes": size, "records": samples * copies, "windows": runs["batched"][0]["counts"],
                       "runs": runs, "median_s": med,
                       "median_MB_per_s": {k: round(size / v / 1e6, 2) for k, v in med.items()},
                       "speedup_processes_over_batched": round(med["batched"] / med[f"{processes}_processes"], 2)}
        if baseline is not None:
            result[fmt]["speedup_batched_over_baseline"] = round(med["baseline"] / med["batched"], 2)
            result[fmt]["speedup_processes_over_baseline"] = round(med["baseline"] / med[f"{processes}_processes"], 2)
    return {**stamp(), "cores": os.cpu_count(), "processes": processes, "copies": copies,
            "repeats": repeats, "formats": result}


def main(argv: list[str] | None = None) -> int:
    from raytrain_platform.data.pool import usable_cores

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small files, 1 repeat (checks it runs)")
    p.add_argument("--copies", type=int, default=None, help="each file repeated N times (default 20; smoke 1)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; smoke 1)")
    p.add_argument("--processes", type=int, default=None,
                   help="the worker processes of the last side (default: one per usable core, at least 2)")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also run the count of this git revision (checked out in a temporary worktree)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON result (default benchmarks/count_pass.json; with --smoke: none)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rtp-count-pass-") as tmp:
        baseline = None
        if args.baseline:
            baseline = Path(tmp) / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(baseline), args.baseline],
                           cwd=ROOT, check=True)
        try:
            result = measure(Path(tmp), samples=500 if args.smoke else 5000,
                             copies=args.copies or (1 if args.smoke else 20),
                             repeats=args.repeats or (1 if args.smoke else 3),
                             processes=args.processes or max(2, usable_cores()), baseline=baseline)
        finally:
            if baseline is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=False)
    if args.baseline:
        result["baseline"] = args.baseline
    result.update(command=" ".join(["python benchmarks/count_pass.py", *(sys.argv[1:] if argv is None else argv)]),
                  seconds=round(time.perf_counter() - t0, 1))
    keys = ("median_MB_per_s", "speedup_processes_over_batched", "speedup_batched_over_baseline",
            "speedup_processes_over_baseline")
    print(json.dumps({fmt: {k: r[k] for k in keys if k in r} for fmt, r in result["formats"].items()}, indent=1))
    out = args.out or (None if args.smoke else BENCH / "count_pass.json")
    write_result(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
