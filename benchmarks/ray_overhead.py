"""Where a 2-process run's time goes on a small machine: the fine-tune of
`vs_accelerate.py` through Ray (``rtp train``) and on the Ray-free core (torchrun), read
from Linux's per-thread scheduler statistics while it trains (Linux only).

    python benchmarks/ray_overhead.py            # ~5 min on 2 CPU cores
    python benchmarks/ray_overhead.py --smoke    # tiny, 1 repeat, writes nothing (a test)

Why it exists: on a 2-core machine a 2-process DDP run through Ray trains slower than
the same engine under torchrun (`vs_accelerate.json`), and the CPU the training threads
use per step is the same on both. The difference is time a training thread is *not* on a
core. For each training thread (the busiest thread of each training process) it reports,
over the steady steps of a run, the share of wall time

- ``on_cpu``: running (``/proc/PID/task/TID/schedstat``, field 1);
- ``runq_wait``: runnable but waiting for a core (field 2): another thread had it;
- ``off_cpu``: the rest, asleep: waiting at an all-reduce for the other rank, or a lock;

and ``preempted_per_s`` (``nonvoluntary_ctxt_switches``). Beside it: the CPU (cores) and
wake-ups per second of every other process on the machine, Ray's own grouped by name
(each Ray worker process wakes every 10 ms to check for signals, ``CoreWorker.CheckSignal``
in Ray's core worker), and how busy the machine was (``/proc/stat``).

``--sched-idle`` (the default as root; it needs root) adds one Ray run whose steady steps alternate
in phases between the default scheduling and every non-training Ray process (raylet, GCS,
dashboard, Train's controller and helper actors, Ray Data's coordinator; all their
threads) moved to ``SCHED_IDLE``, which never preempts a training thread on wake-up: the
median step time of each kind of phase, side by side in one run. It says how much of the
gap Ray's other processes' CPU and wake-ups explain. Results go to
``benchmarks/ray_overhead.json`` with the date and load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, in_temp_folder, load_avg, stamp, torchrun_command, write_result  # noqa: E402
import vs_accelerate as va  # noqa: E402

BENCH = ROOT / "benchmarks"
HZ = os.sysconf("SC_CLK_TCK")
SIZES: dict[str, dict[str, Any]] = {
    # window: metrics rows [first, last) whose wall time is sampled (after start-up and
    # the first steps); phases: the --sched-idle run's alternating phases of `phase` steps.
    # samples: enough chat records that every window stays inside the first epoch (5000:
    # about 110 steps of 16 windows). A Ray run's next epoch restarts its Ray Data
    # pipeline, a ~1.4 s wait for data here that is not the steady state measured
    # (vs_accelerate's 2000 records hold 44 such steps; its 40 steps never cross).
    "full": {**va.SIZES["full"], "samples": 5000, "steps": 60, "window": (10, 55), "repeats": 2,
             "phases": 6, "phase": 12},
    "smoke": {**va.SIZES["smoke"], "steps": 24, "window": (6, 22), "repeats": 1, "phases": 2, "phase": 6},
}
RAY_DAEMONS = ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def descendants(root: int) -> set[int]:
    """`root` and every process below it (the run's: a Ray run's raylet, GCS and
    workers are children of the ``rtp train`` process that started them)."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid_s in os.listdir("/proc"):
        if pid_s.isdigit():
            try:
                stat = _read(f"/proc/{pid_s}/stat")
                children[int(stat[stat.rindex(")") + 2:].split()[1])].append(int(pid_s))
            except (OSError, ValueError, IndexError):
                continue
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def sample(root: int) -> tuple[dict[tuple[int, int], dict], list[int]]:
    """Every thread of the run (`root` and its descendants): its process's command
    line, thread name, CPU seconds, scheduler nanoseconds (on a core, waiting for one),
    context switches and when it was read; and the machine's /proc/stat CPU line."""
    threads: dict[tuple[int, int], dict] = {}
    for pid in sorted(descendants(root)):
        pid_s = str(pid)
        try:
            cmd = _read(f"/proc/{pid_s}/cmdline").replace("\0", " ").strip()
            for tid_s in os.listdir(f"/proc/{pid_s}/task"):
                base = f"/proc/{pid_s}/task/{tid_s}"
                stat = _read(f"{base}/stat")
                fields = stat[stat.rindex(")") + 2:].split()
                run_ns, wait_ns, _ = (int(x) for x in _read(f"{base}/schedstat").split())
                switches = {k: int(v) for k, v in (line.split(":") for line in _read(f"{base}/status").splitlines()
                                                    if "ctxt_switches" in line)}
                threads[(int(pid_s), int(tid_s))] = {
                    "cmd": cmd or f"[{stat[stat.index('(') + 1:stat.rindex(')')]}]",
                    "name": stat[stat.index("(") + 1:stat.rindex(")")],
                    "cpu_s": (int(fields[11]) + int(fields[12])) / HZ, "run_ns": run_ns, "wait_ns": wait_ns,
                    "voluntary": switches.get("voluntary_ctxt_switches", 0),
                    "preempted": switches.get("nonvoluntary_ctxt_switches", 0),
                    "t": time.monotonic()}  # a scan of hundreds of threads takes a while: per thread
        except (OSError, ValueError):  # a thread that ended between listing and reading
            continue
    machine = [int(x) for x in _read("/proc/stat").splitlines()[0].split()[1:]]
    return threads, machine


def _process_name(cmd: str) -> str:
    """A short name: Ray's worker processes name themselves ``ray::Actor``; daemons by binary."""
    if cmd.startswith("ray::"):
        return cmd.split()[0].split(".")[0]
    for daemon in RAY_DAEMONS:
        if daemon in cmd:
            return f"ray {daemon}"
    if "raytrain_platform train" in cmd:
        return "rtp train (Ray driver)"
    return Path(cmd.split()[0]).name if cmd else "?"


def is_training(side: str, cmd: str) -> bool:
    if side == "ray":
        return cmd.startswith("ray::RayTrainWorker")
    return "raytrain_platform.core" in cmd and "torch.distributed.run" not in cmd


def is_ray_helper(cmd: str) -> bool:
    return ((cmd.startswith("ray::") and not cmd.startswith("ray::RayTrainWorker"))
            or any(d in cmd and "/ray/" in cmd for d in RAY_DAEMONS) or "raytrain_platform train" in cmd)


def breakdown(side: str, a: tuple, b: tuple, dt: float) -> dict:
    """The training threads' shares of wall time, and everyone else's CPU and wake-ups,
    between samples `a` and `b` taken `dt` seconds apart."""
    (ta, ma), (tb, mb) = a, b
    delta = {k: {f: tb[k][f] - ta[k][f] for f in ("cpu_s", "run_ns", "wait_ns", "voluntary", "preempted")}
             for k in tb if k in ta}
    training_pids = {pid for (pid, _), v in tb.items() if is_training(side, v["cmd"])}
    train_threads = {}
    for pid in training_pids:
        mine = [(d["run_ns"], k) for k, d in delta.items() if k[0] == pid]
        if mine:
            train_threads[pid] = max(mine)[1]
    if len(train_threads) != 2:
        raise RuntimeError(f"{side}: expected 2 training processes, found {len(train_threads)}")
    threads = []
    for k in train_threads.values():
        d, own_dt = delta[k], tb[k]["t"] - ta[k]["t"]
        on, wait = d["run_ns"] / 1e9 / own_dt, d["wait_ns"] / 1e9 / own_dt
        threads.append({"on_cpu": round(on, 3), "runq_wait": round(wait, 3),
                        "off_cpu": round(max(0.0, 1 - on - wait), 3),
                        "preempted_per_s": round(d["preempted"] / dt), "sleeps_per_s": round(d["voluntary"] / dt)})
    groups: dict[str, dict] = defaultdict(lambda: {"cores": 0.0, "wakeups_per_s": 0.0, "processes": set()})
    inside: dict[str, dict] = defaultdict(lambda: {"cores": 0.0, "wakeups_per_s": 0.0, "threads": 0})
    for k, d in delta.items():
        if k in train_threads.values():
            continue
        if k[0] in training_pids:  # the training processes' other threads, by thread name
            t = inside[tb[k]["name"]]
            t["cores"] += d["cpu_s"] / dt
            t["wakeups_per_s"] += (d["voluntary"] + d["preempted"]) / dt
            t["threads"] += 1
        name = ("training processes' other threads" if k[0] in training_pids
                else _process_name(tb[k]["cmd"]))
        g = groups[name]
        g["cores"] += d["cpu_s"] / dt
        g["wakeups_per_s"] += (d["voluntary"] + d["preempted"]) / dt
        g["processes"].add(k[0])
    others = sorted(({"name": n, "cores": round(g["cores"], 3), "wakeups_per_s": round(g["wakeups_per_s"]),
                      "processes": len(g["processes"])} for n, g in groups.items()), key=lambda g: -g["cores"])
    ray_names = {_process_name(v["cmd"]) for v in tb.values() if is_ray_helper(v["cmd"])}
    ray_groups = [g for g in others if g["name"] in ray_names]
    names = "user nice system idle iowait irq softirq steal".split()
    stat = {n: (y - x) / HZ / dt for n, x, y in zip(names, ma, mb)}
    return {
        "training_threads": threads,
        "ray_processes": {"count": sum(g["processes"] for g in ray_groups),
                          "cores": round(sum(g["cores"] for g in ray_groups), 3),
                          "wakeups_per_s": round(sum(g["wakeups_per_s"] for g in ray_groups))},
        "others_top": [g for g in others if g["cores"] >= 0.002][:12],
        "training_processes_other_threads": sorted(
            ({"name": n, "cores": round(t["cores"], 3), "wakeups_per_s": round(t["wakeups_per_s"]),
              "threads": t["threads"]} for n, t in inside.items() if t["wakeups_per_s"] >= 5),
            key=lambda t: -t["wakeups_per_s"])[:12],
        "machine_busy_cores": round(sum(v for n, v in stat.items() if n not in ("idle", "iowait", "steal")), 3),
        "steal_cores": round(stat["steal"], 3),
    }


class Run:
    """One training run in the background (``rtp train``, or torchrun), its process
    tree rooted at `pid`, with its metrics rows."""

    def __init__(self, side: str, llm: Path, size: dict, storage: Path, name: str):
        self.side, self.dir = side, storage / name
        config = va._write_config(llm, 2, size, storage, name)
        if side == "ray":
            cmd, env = [sys.executable, "-m", "raytrain_platform", "train", str(config)], va.OFFLINE_ENV
        else:
            cmd, env = torchrun_command(2, config), {"OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def rows(self) -> list[dict]:
        from raytrain_platform.core.rundir import read_metrics

        return read_metrics(self.dir) if (self.dir / "metrics.jsonl").exists() else []

    def wait_rows(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while len(self.rows()) < n:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.finish()
                raise RuntimeError(f"{self.side}: run ended or stalled before step {n}")
            time.sleep(0.05)

    def finish(self) -> None:
        try:
            _, err = self.proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise RuntimeError(f"{self.side}: the run did not end") from None
        if self.proc.returncode:
            raise RuntimeError(f"{self.side} run failed ({self.proc.returncode}):\n{err[-3000:]}")


def one_epoch(rows: list[dict], first: int, last: int, what: str) -> None:
    """Raise unless the steps from row `first` - 1 to `last` are all of one epoch: the
    first step of an epoch includes the wait for its data, which would count as time
    asleep (and did, before `samples` was raised)."""
    epochs = sorted({r["epoch"] for r in rows[max(0, first - 1):last]})
    if len(epochs) > 1:
        raise RuntimeError(f"{what}: steps {first}-{last} cross an epoch boundary (epochs {epochs}); "
                           "use more data (a fresh --llm-dir) or fewer steps")


def _steps(rows: list[dict], first: int, last: int) -> dict:
    window = rows[first:last]
    step = statistics.median(r["step_time_s"] for r in window)
    return {"step_s": round(step, 4), "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in window), 1)}


def measured_run(side: str, llm: Path, size: dict, storage: Path, name: str) -> dict:
    first, last = size["window"]
    run = Run(side, llm, size, storage, name)
    run.wait_rows(first)
    a, t0 = sample(run.pid), time.monotonic()
    run.wait_rows(last)
    b, t1 = sample(run.pid), time.monotonic()
    run.finish()
    one_epoch(run.rows(), first, last, f"{side} run {name}")
    return {**_steps(run.rows(), first, last), **breakdown(side, a, b, t1 - t0)}


class HelperPolicy:
    """Ray's non-training processes of one run (its tree) to SCHED_IDLE and back to
    what each thread had. SCHED_RESET_ON_FORK: a process they start gets the default."""

    def __init__(self, root: int):
        self.root = root
        self.saved: dict[int, tuple[int, int]] = {}

    def idle(self) -> int:
        threads, _ = sample(self.root)
        for (_, tid), v in threads.items():
            if is_ray_helper(v["cmd"]) and tid not in self.saved:
                try:
                    self.saved[tid] = (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority)
                    os.sched_setscheduler(tid, os.SCHED_IDLE | os.SCHED_RESET_ON_FORK, os.sched_param(0))
                except OSError:  # ended meanwhile
                    self.saved.pop(tid, None)
        return len(self.saved)

    def restore(self) -> None:
        for tid, (policy, priority) in self.saved.items():
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(priority))
            except OSError:
                pass
        self.saved.clear()


def sched_idle_run(llm: Path, size: dict, storage: Path, name: str) -> dict:
    """One Ray run, its steady steps in phases: default scheduling, then Ray's other
    processes at SCHED_IDLE, alternating. Median step time of each kind of phase."""
    warm, phase, phases = size["window"][0], size["phase"], size["phases"]
    run = Run("ray", llm, {**size, "steps": warm + phase * phases + 2}, storage, name)
    policy = HelperPolicy(run.pid)
    kinds: dict[str, list[float]] = {"default": [], "sched_idle": []}
    helpers = 0
    try:
        for i in range(phases):
            kind = "sched_idle" if i % 2 else "default"
            run.wait_rows(warm + i * phase)
            if kind == "sched_idle":
                helpers = max(helpers, policy.idle())
            else:
                policy.restore()
            run.wait_rows(warm + (i + 1) * phase)
            # the phase's first step straddles the switch: left out
            kinds[kind] += [r["step_time_s"] for r in run.rows()[warm + i * phase + 1:warm + (i + 1) * phase]]
    finally:
        policy.restore()
        run.finish()
    one_epoch(run.rows(), warm, warm + phase * phases, f"the SCHED_IDLE run {name}")
    med = {k: round(statistics.median(v), 4) for k, v in kinds.items()}
    return {"phases": phases, "steps_per_phase": phase, "helper_threads_set": helpers,
            "default_step_s": med["default"], "sched_idle_step_s": med["sched_idle"],
            "sched_idle_speedup": round(med["default"] / med["sched_idle"], 3)}


def measure(work: Path, *, smoke: bool, repeats: int | None, sched_idle: bool,
            llm_dir: Path | None, log: Callable[[str], None] = print) -> dict:
    size = SIZES["smoke" if smoke else "full"]
    repeats = repeats or size["repeats"]
    os.environ.update(va.OFFLINE_ENV)
    os.environ["RTP_CACHE_DIR"] = str(work / "token-cache")  # as vs_accelerate.py
    llm = va.make_llm(llm_dir or work / "tiny-llm", size)
    runs: dict[str, list[dict]] = {"ray": [], "torchrun": []}
    for i in range(repeats):
        for side in (("ray", "torchrun") if i % 2 == 0 else ("torchrun", "ray")):
            time.sleep(size["settle_s"])
            runs[side].append(measured_run(side, llm, size, work / "runs", f"{side}_{i}"))
            t = runs[side][-1]["training_threads"]
            log(f"repeat {i + 1}/{repeats} {side}: step {runs[side][-1]['step_s']:.3f}s, on cpu "
                f"{[x['on_cpu'] for x in t]}, run-queue wait {[x['runq_wait'] for x in t]} (load {load_avg():.1f})")
    result: dict = {**stamp(), "repeats": repeats, "steps": size["steps"], "window": list(size["window"]),
                    "job": "vs_accelerate.py's fine-tune at 2 processes (DDP, gloo), one torch thread each",
                    "cores": os.cpu_count(), "runs": runs}
    for side, rs in runs.items():
        th = [t for r in rs for t in r["training_threads"]]
        result[side] = {"step_s": statistics.median(r["step_s"] for r in rs),
                        **{k: round(statistics.median(t[k] for t in th), 3)
                           for k in ("on_cpu", "runq_wait", "off_cpu", "preempted_per_s")},
                        "cpu_s_per_step": round(statistics.median(t["on_cpu"] for t in th)
                                                * statistics.median(r["step_s"] for r in rs), 4),
                        "ray_processes": {k: statistics.median(r["ray_processes"][k] for r in rs)
                                          for k in ("count", "cores", "wakeups_per_s")},
                        "machine_busy_cores": statistics.median(r["machine_busy_cores"] for r in rs)}
    result["ray_over_torchrun_step"] = round(result["ray"]["step_s"] / result["torchrun"]["step_s"], 3)
    if sched_idle:
        result["sched_idle"] = sched_idle_run(llm, size, work / "runs", "ray_sched_idle")
        log(f"SCHED_IDLE phases: {result['sched_idle']}")
    return result


def table(result: dict) -> str:
    lines = ["| 2 processes | step s | training thread: on a core | waiting for a core | asleep | "
             "preempted /s | CPU s per step | Ray's other processes: count, cores, wake-ups /s | machine busy (cores) |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for side in ("ray", "torchrun"):
        e = result[side]
        rp = e["ray_processes"]
        lines.append(f"| {side} | {e['step_s']:.3f} | {e['on_cpu']:.3f} | {e['runq_wait']:.3f} | {e['off_cpu']:.3f} | "
                     f"{e['preempted_per_s']:.0f} | {e['cpu_s_per_step']:.3f} | "
                     f"{rp['count']:.0f}, {rp['cores']:.3f}, {rp['wakeups_per_s']:,.0f} | {e['machine_busy_cores']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, a few steps, 1 repeat; writes only to --out")
    p.add_argument("--repeats", type=int, help="interleaved repeats of each side (default 2; smoke 1)")
    p.add_argument("--sched-idle", action=argparse.BooleanOptionalAction, default=None,
                   help="also the Ray run with its other processes at SCHED_IDLE in alternate phases "
                        "(needs root; default: on as root)")
    p.add_argument("--out", type=Path, help="the JSON result (default benchmarks/ray_overhead.json; with --smoke, none)")
    p.add_argument("--llm-dir", type=Path, help="reuse (or keep) the tiny model and data here")
    args = p.parse_args(argv)
    if not Path("/proc/self/schedstat").exists():
        p.error("needs Linux's per-thread scheduler statistics (/proc/PID/schedstat)")
    if args.sched_idle is None:  # default: on where it can run
        args.sched_idle = os.geteuid() == 0
        if not args.sched_idle:
            print("not root: no SCHED_IDLE phases (an unprivileged thread cannot be set back from SCHED_IDLE)")
    elif args.sched_idle and os.geteuid() != 0:
        p.error("--sched-idle needs root (an unprivileged thread cannot be set back from SCHED_IDLE); "
                "run as root or pass --no-sched-idle")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats: a positive integer, got {args.repeats}")
    out = args.out or (None if args.smoke else BENCH / "ray_overhead.json")
    result = in_temp_folder("ray_overhead.py", argv, lambda folder: measure(
        folder, smoke=args.smoke, repeats=args.repeats, sched_idle=args.sched_idle, llm_dir=args.llm_dir))
    print(table(result))
    print(f"Ray / torchrun step time: {result['ray_over_torchrun_step']:.3f}; {result['seconds']:.0f}s")
    write_result(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
