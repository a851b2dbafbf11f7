"""`data.window_cache` side by side on `vs_accelerate.py`'s fine-tune: the 2-process Ray
run (``rtp train``) with the windows the driver's count pass keeps, and without them
(Ray Data's read task tokenizes the JSONL again during the steps), interleaved.

    python benchmarks/window_cache.py            # 3 pairs, ~5 min on 2 CPU cores; writes benchmarks/window_cache.json
    python benchmarks/window_cache.py --smoke    # the smoke model, 1 pair (nothing written unless --out)

The job is `vs_accelerate.py`'s (tiny_llm's Llama, 4 layers x d 256, 512-token BPE, chat
JSONL of 2,000 records, 256-token windows, micro-batch 8, 2 DDP workers with 1 torch
thread each, 40 steps; tokens/s of the median step after the first 3), its token cache
in a temporary folder: the first run's count pass writes the windows, and each run
with ``data.window_cache: false`` neither reads nor writes them. The pairs alternate
which side runs first; the result holds every run, each side's median and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import in_temp_folder, load_avg, stamp, write_result  # noqa: E402
import vs_accelerate as va  # noqa: E402

BENCH = Path(__file__).resolve().parent


def run(llm: Path, size: dict, storage: Path, name: str, *, window_cache: bool) -> dict:
    """One `rtp train` run of vs_accelerate's config at 2 processes, the window cache on or off."""
    config = va.platform_config(llm, 2, size, storage, name)
    config["data"]["window_cache"] = window_cache
    path = storage / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    import yaml

    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "train", str(path)], cwd=va.ROOT,
                          env={**os.environ, **va.OFFLINE_ENV}, capture_output=True, text=True, timeout=900,
                          check=False)
    if proc.returncode:
        raise RuntimeError(f"{name}: rtp train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    from raytrain_platform.core.rundir import read_metrics

    figures = va._platform_figures(read_metrics(storage / name), 2, size)
    return {k: figures[k] for k in ("tokens_per_s", "step_s", "data_wait_frac", "losses")} | {"load_avg_1m": load_avg()}


def measure(work: Path, *, smoke: bool, pairs: int) -> dict:
    size = {**va.SIZES["smoke" if smoke else "full"], "vocab": 512}
    os.environ.update(va.OFFLINE_ENV)
    os.environ["RTP_CACHE_DIR"] = str(work / "token-cache")
    llm = va.make_llm(work / "tiny-llm", size)
    runs: dict[str, list[dict]] = {"kept": [], "tokenized": []}
    for i in range(pairs):
        order = ("kept", "tokenized") if i % 2 == 0 else ("tokenized", "kept")
        for side in order:
            r = run(llm, size, work / "runs", f"{side}_{i}", window_cache=side == "kept")
            runs[side].append(r)
            print(f"pair {i + 1}/{pairs} {side}: {r}", flush=True)
            time.sleep(size["settle_s"])
    med = {side: statistics.median(r["tokens_per_s"] for r in rs) for side, rs in runs.items()}
    return {**stamp(), "job": "vs_accelerate.py's fine-tune at 2 processes through Ray (512-token BPE)",
            "pairs": pairs, "runs": runs,
            "tokens_per_s_median": {k: round(v, 1) for k, v in med.items()},
            "ratio_kept_over_tokenized": round(med["kept"] / med["tokenized"], 3),
            "pair_ratios": [round(a["tokens_per_s"] / b["tokens_per_s"], 3)
                            for a, b in zip(runs["kept"], runs["tokenized"])],
            # The same windows either way: every step's loss, every run, the same.
            "loss_max_abs_diff": max(abs(x - y) for r in runs["kept"] + runs["tokenized"]
                                     for x, y in zip(r["losses"], runs["kept"][0]["losses"]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the smoke model, 1 pair (checks it runs)")
    p.add_argument("--pairs", type=int, default=None, help="pairs of runs (default 3; smoke 1)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON result (default benchmarks/window_cache.json; with --smoke: none)")
    args = p.parse_args(argv)
    result = in_temp_folder("window_cache.py", argv, lambda folder: measure(
        folder, smoke=args.smoke, pairs=args.pairs or (1 if args.smoke else 3)))
    print(json.dumps({k: result[k] for k in ("tokens_per_s_median", "ratio_kept_over_tokenized", "pair_ratios",
                                             "loss_max_abs_diff")}))
    out = args.out or (None if args.smoke else BENCH / "window_cache.json")
    write_result(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
