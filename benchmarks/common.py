"""The benchmark harness: what every lasting benchmark shares.

- `interleaved` / `rotated`: each side once per repeat, in turn, so every side sees the
  same drift of a shared machine; `median` and `compare`: medians, and each side's ratio
  to a baseline measured in the same run (of the medians, and repeat by repeat).
- `harness_parser`: ``--smoke`` (tiny sizes, one repeat: what tests/test_benchmarks.py
  runs), ``--repeats``, ``--out`` (the JSON result) and ``--page``.
- `finish`: prints the table, writes the JSON result, and with ``--page`` the dated
  results page ``benchmarks/results/<name>-<date>.md`` (`write_page`: date, exact
  command and machine: CPU model, cores, GPU, Python, torch, Ray and transformers).
- `local_ray`, `tabular_data`, `torchrun_core`, `steady`: a local Ray, the training
  data, the Ray-free core under torchrun, a run's steady-state figures.

Benchmarks time things; tests only run their ``--smoke`` mode."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROW_GROUP_ROWS = 4096  # rows per Parquet row group in the benchmarks' tabular data
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T = TypeVar("T")

__all__ = ["RESULTS", "ROOT", "add_page_arg", "command_line", "compare", "finish", "free_port",
           "harness_parser", "interleaved", "load_avg", "local_ray", "machine", "machine_line", "median",
           "out_path", "result_meta", "rotated", "stamp", "steady", "tabular_data", "torchrun_core",
           "write_page", "write_result"]


# ---------------------------------------------------------------- command line and results


def harness_parser(doc: str | None, *, out: Path | None = None, page: str | None = None,
                   repeats: bool = True) -> argparse.ArgumentParser:
    """A benchmark's parser with the harness's flags: ``--smoke``, ``--repeats`` (unless
    `repeats` is false), ``--out`` (default `out`; with ``--smoke`` none) and, when the
    script has a results page (`page`: its name), ``--page``. Scripts add their own flags."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, one repeat: checks the script runs; writes only to --out")
    if repeats:
        p.add_argument("--repeats", type=int, default=None, help="interleaved repeats of every side")
    p.add_argument("--out", type=Path, default=None,
                   help=f"the JSON result (default {_rel(out) if out else 'none'}; with --smoke: none)")
    p.set_defaults(default_out=out, page_name=page)
    if page:
        add_page_arg(p, page)
    return p


def add_page_arg(p: argparse.ArgumentParser, name: str) -> None:
    """``--page``: also write the dated results page ``benchmarks/results/NAME-DATE.md``."""
    p.add_argument("--page", action="store_true",
                   help=f"also write the dated results page benchmarks/results/{name}-DATE.md")


def out_path(args: argparse.Namespace) -> Path | None:
    """Where the JSON result goes: ``--out``, else the script's default unless ``--smoke``."""
    return args.out or (None if args.smoke else getattr(args, "default_out", None))


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The exact command that ran: ``python benchmarks/SCRIPT ARGS``."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join([f"python benchmarks/{Path(script).name}", *args])


def finish(args: argparse.Namespace, result: dict, *, script: str, argv: Sequence[str] | None,
           title: str, table: str) -> None:
    """Print `table`; write `result` (with date, command and machine) to `out_path(args)`;
    with ``--page`` (and without ``--smoke``), the dated results page `title` holding `table`."""
    print(table)
    meta = result_meta(script, argv)
    write_result({"_meta": meta, **result}, out_path(args))
    if getattr(args, "page", False) and args.smoke:
        print("--page: not written for a --smoke run (tiny sizes measure nothing)")
    elif getattr(args, "page", False):
        write_page(args.page_name, title, table, command=meta["command"])


def result_meta(script: str, argv: Sequence[str] | None = None) -> dict:
    """What a JSON result carries about its run: date, exact command, machine."""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "command": command_line(script, argv), "machine": machine()}


def machine() -> dict:
    """What ran the benchmark: CPU model, cores, GPU, and the versions that matter."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = None
    if shutil.which("nvidia-smi"):  # not through torch: the driver process keeps CUDA uninitialised
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=False)
        names = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        gpu = f"{len(names)} x {names[0]}" if names else None
    out = {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)), "gpu": gpu,
           "python": platform.python_version()}
    for package in ("torch", "ray", "transformers"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def machine_line(m: dict | None = None) -> str:
    """`machine()` in one line, as a results page states it."""
    m = m or machine()
    cores = f"{m['cores']} cores" + (f" ({m['usable_cores']} usable)" if m["usable_cores"] != m["cores"] else "")
    versions = ", ".join(f"{k} {m[k]}" for k in ("python", "torch", "ray", "transformers") if m.get(k))
    return f"{m['cpu']}, {cores}, {m['gpu'] or 'no GPU'}; {versions}"


def write_page(name: str, title: str, body: str, *, command: str, results_dir: Path | None = None,
               date: str | None = None) -> Path:
    """The dated results page ``RESULTS_DIR/NAME-DATE.md``: `title`, the date, the exact
    command and the machine, then `body` (tables; conclusions are written by hand below).
    A page of the same name and date gets the new run appended, never overwritten."""
    date = date or time.strftime("%Y-%m-%d")
    path = (results_dir or RESULTS) / f"{name}-{date}.md"
    header = f"Date: {date} {time.strftime('%H:%M')}. Command: `{command}`. Machine: {machine_line()}."
    if path.exists():
        text = path.read_text().rstrip("\n") + f"\n\n---\n\n{header}\n\n{body.strip()}\n"
    else:
        text = f"# {title}\n\n{header}\n\n{body.strip()}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {_rel(path)}")
    return path


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------- repeats and medians


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
    """The median of `key` over a side's repeats."""
    return statistics.median(r[key] for r in rows)


def compare(runs: dict[str, list[dict]], key: str, baseline: str) -> dict:
    """Side by side, from one run's interleaved repeats: each side's median of `key`, its
    ratio to `baseline`'s median, and its ratio repeat by repeat (each repeat against the
    baseline run beside it, which saw the same minute of the machine)."""
    med = {side: median(rows, key) for side, rows in runs.items()}
    return {"median": med, "ratio": {side: v / med[baseline] for side, v in med.items()},
            "per_repeat": {side: [r[key] / b[key] for r, b in zip(rows, runs[baseline])]
                           for side, rows in runs.items()}}


def load_avg() -> float:
    """1-minute load average: how busy the machine was (other jobs share it)."""
    return os.getloadavg()[0]


def stamp() -> dict:
    """When and under what load a figure was measured, stored beside it."""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_1m": round(load_avg(), 1)}


def write_result(result: dict, out: Path | None) -> None:
    """A benchmark's JSON result to `out` (none: a smoke run without ``--out``)."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {_rel(out)}")


# ---------------------------------------------------------------- what the benchmarks run


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

    from raytrain_platform.launch.session import DRIVER_ENV, JOB_ENV

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
