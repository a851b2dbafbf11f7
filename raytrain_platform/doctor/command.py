"""`rtp doctor CONFIG [--set ...] [--workers 1,2] [--steps N] [--warmup N] [--out DIR] [--json]`."""

from __future__ import annotations

import argparse
import json
import re

from raytrain_platform.config import add_set_flag
from raytrain_platform.errors import ConfigError

__all__ = ["add_doctor_arguments", "run_doctor"]


def _counts(text: str) -> list[int]:
    if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text) or any(int(x) < 1 for x in text.split(",")):
        raise ConfigError("--workers", text, "a comma-separated list of worker counts >= 1, like 1,2")
    return [int(x) for x in text.split(",")]


def add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path to the job's YAML config")
    add_set_flag(p)
    p.add_argument("--workers", default=None,
                   help="worker counts to measure, e.g. 1,2 (default: 1, 2 and more while the "
                        "cluster has room, up to max(2, scaling.num_workers))")
    p.add_argument("--steps", type=int, default=10,
                   help="measured steps per run, twice: normal, then with the all-reduce timed apart")
    p.add_argument("--warmup", type=int, default=5, help="steps before measuring")
    p.add_argument("--out", default=None, help="output folder (default: <storage>/<run.name>-doctor)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else "
                                                   "an embedded local Ray)")
    p.add_argument("--min-efficiency", type=float, default=0.75,
                   help="flag scaling below this fraction of linear (default 0.75)")
    p.add_argument("--json", action="store_true", help="print doctor.json instead of the table")


def run_doctor(args: argparse.Namespace) -> int:
    from raytrain_platform.doctor import doctor, format_report

    workers = _counts(args.workers) if args.workers is not None else None
    report = doctor(args.config, args.overrides, workers=workers, steps=args.steps,
                    warmup=args.warmup, out=args.out, address=args.address,
                    min_efficiency=args.min_efficiency,
                    emit=(lambda line: None) if args.json else print)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0
