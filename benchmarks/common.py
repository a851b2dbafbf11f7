"""What the benchmark modules share: interleaved repeats, medians, a local Ray, the
training data. Benchmarks time things; tests only run their ``--smoke`` mode."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
ROW_GROUP_ROWS = 4096  # rows per Parquet row group in the benchmarks' tabular data
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T = TypeVar("T")

__all__ = ["ROOT", "in_temp_folder", "interleaved", "load_avg", "local_ray", "median", "stamp", "tabular_data",
           "write_result"]


def interleaved(sides: dict[str, Callable[[int], T]], repeats: int, *, label: str = "") -> dict[str, list[T]]:
    """Each side once per repeat, in turn (A, B, C, A, B, C, ...): all sides see the
    same drift of a shared machine. Side functions take the repeat index."""
    out: dict[str, list[T]] = {name: [] for name in sides}
    for i in range(repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            out[name].append(fn(i))
            print(f"{label}repeat {i + 1}/{repeats} {name}: {_short(out[name][-1])} "
                  f"({time.perf_counter() - t0:.1f}s, load {load_avg():.1f})", flush=True)
    return out


def _short(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v:,.3g}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in value.items() if not isinstance(v, (dict, list)))
    return str(value)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def load_avg() -> float:
    """1-minute load average: how busy the machine was (other jobs share it)."""
    return os.getloadavg()[0]


def stamp() -> dict:
    """When and under what load a figure was measured, stored beside it."""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_1m": round(load_avg(), 1)}


def write_result(result: dict, out: Path | None) -> None:
    """A benchmark's JSON result to `out` (none: a smoke run without ``--out``)."""
    if out:
        import json

        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


def in_temp_folder(script: str, argv: Sequence[str] | None, measure: Callable[[Path], dict]) -> dict:
    """`measure(folder)` in a fresh temporary folder, removed after; its result stamped with
    the command that ran it (``python benchmarks/SCRIPT ARGS``) and the seconds it took."""
    import tempfile

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"rtp-{Path(script).stem.replace('_', '-')}-") as tmp:
        result = measure(Path(tmp))
    args = sys.argv[1:] if argv is None else list(argv)
    return {**result, "command": " ".join([f"python benchmarks/{script}", *args]),
            "seconds": round(time.perf_counter() - t0, 1)}


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (torchrun rendezvous, Serve's HTTP proxy)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steady(rows: list[dict], warmup: int = 5) -> dict:
    """Median per-step samples/s and data-wait fraction of a run's metrics rows after
    `warmup` steps (the last row alone when the run was no longer than that)."""
    rows = rows[warmup:] if len(rows) > warmup else rows[-1:]
    return {"samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
            "data_wait_frac": statistics.median(r["data_wait_frac"] for r in rows),
            "steps": len(rows)}


def torchrun_core(nproc: int, config: Path, overrides: Sequence[str] = (), *, label: str,
                  timeout: float = 900) -> None:
    """Train `config` on the Ray-free core: ``torchrun --nproc-per-node N -m
    raytrain_platform.core --config CONFIG [--set K=V ...]`` on 127.0.0.1, one torch
    thread per rank; raises with the stderr tail (and `label`) when it fails."""
    import subprocess

    proc = subprocess.run(torchrun_command(nproc, config, overrides), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"{label}: torchrun core failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def torchrun_command(nproc: int, config: Path, overrides: Sequence[str] = ()) -> list[str]:
    """The command `torchrun_core` runs (127.0.0.1, a free port); run it with
    ``OMP_NUM_THREADS=1`` in the environment."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "raytrain_platform.core", "--config", str(config)]
    for kv in overrides:
        cmd += ["--set", kv]
    return cmd


def local_ray(num_cpus: int = 2) -> None:
    """A fresh embedded Ray with this machine's CPUs, quiet, as `rtp train` starts one
    (the platform's `train` then reuses it: `init_ray` is a no-op when connected)."""
    import ray

    from raytrain_platform.launch.trainer import DRIVER_ENV, JOB_ENV

    for k, v in DRIVER_ENV.items():
        os.environ.setdefault(k, v)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", runtime_env={"env_vars": dict(JOB_ENV)})


def tabular_data(folder: Path, rows: int, *, features: int = 64, classes: int = 8,
                 row_group_rows: int = ROW_GROUP_ROWS) -> Path:
    """Synthetic classification rows as 4 Parquet files (the platform's own writer)."""
    from raytrain_platform.data.generate import write_tabular_parquet

    if not any(folder.glob("*.parquet")):
        write_tabular_parquet(folder, rows=rows, features=features, classes=classes, files=4,
                              row_group_rows=row_group_rows)
    return folder


def rotated(sides: dict, repeats: int, settle_s: float,
            after_repeat: Callable[[dict[str, list[dict]], int], None], *, label: str) -> dict[str, list[dict]]:
    """`interleaved` repeats, the order turned by one side each repeat (so no side always
    runs right after a Ray run's teardown), with `settle_s` seconds before each side for
    the last one's processes to exit; `after_repeat(runs, done)` after each repeat."""
    names = list(sides)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(repeats):
        order = names[i % len(names):] + names[:i % len(names)]
        got = interleaved({name: lambda _, name=name, i=i: _settled(sides[name], i, settle_s) for name in order}, 1,
                          label=f"{label} repeat {i + 1}/{repeats}: ")
        for name in names:
            runs[name] += got[name]
        after_repeat(runs, i + 1)
    return runs


def _settled(side: Callable[[str], dict], i: int, settle_s: float) -> dict:
    """One run of `side` after `settle_s` seconds; a failed run is tried once more, under a
    new run name (the same name would resume from the failed run's checkpoint)."""
    for attempt in (1, 2):
        time.sleep(settle_s)
        try:
            # The machine's load as the run ended: other jobs share it. wall_s: the whole
            # run as a user waits for it (start-up, loading, every step, shutdown).
            t0 = time.perf_counter()
            got = side(f"{i}_{attempt}")
            return {**got, "wall_s": round(time.perf_counter() - t0, 1), "attempts": attempt,
                    "load_avg_1m": round(load_avg(), 1)}
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            if attempt == 2:
                raise
            print(f"run failed, trying once more: {str(exc)[-1500:]}", flush=True)
    raise AssertionError("unreachable")
