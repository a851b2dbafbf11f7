#!/usr/bin/env python3
"""A Ray cluster of several nodes on one machine: a head and N worker nodes, all on
127.0.0.1, each a separate `ray start --block` with its own CPUs, its own custom
resource (``node_1``, ``node_2``, ...) and its own temp dir. For trying multi-node
placement, checkpoints on shared storage and node failures without a cloud.

    python cluster/local_cluster.py up --dir /tmp/rtpc --workers 2 --cpus 2   # prints the addresses
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:<dashboard> --working-dir . \\
        -- python pipelines/train.py --config CONFIG --set scaling.placement_strategy=SPREAD
    python cluster/local_cluster.py remove-node --dir /tmp/rtpc 2    # SIGKILL node 2 (a lost node)
    python cluster/local_cluster.py down --dir /tmp/rtpc             # stop every node by its pid

Each node runs in its own session (process group); `down` and `remove-node` signal
exactly those groups, recorded in DIR/cluster.json, and never touch other Ray
processes on the machine (unlike `ray stop`). The head offers no CPUs by default, so
training workers and Ray Data tasks run on the worker nodes. Keep DIR short: Ray's
socket paths live under it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from raytrain_platform.errors import OneLineParser  # argument errors: one line, exit 2

STATE = "cluster.json"
_PROCS: dict[int, subprocess.Popen] = {}  # nodes this process started: exit codes without zombies
# Notice a lost node in ~3 s rather than Ray's default ~30 s.
SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                 "health_check_initial_delay_ms": 1000, "health_check_timeout_ms": 1000}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    here = Path(sys.executable).parent / "ray"
    return str(here) if here.exists() else (shutil.which("ray") or "ray")


def _env() -> dict:
    # The job's `python` is looked up on the node's PATH: this environment's first.
    # Token authentication (Ray 2.60): every node and client presents ~/.ray/auth_token,
    # which `ensure_token` makes before the head starts (`ray start` never makes one).
    return {**os.environ, "RAY_ADDRESS": "", "RAY_AUTH_MODE": "token",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def ensure_token() -> Path:
    """~/.ray/auth_token, made if there is none yet (`ray get-auth-token --generate`):
    `ray start` with RAY_AUTH_MODE=token refuses to start without one."""
    proc = subprocess.run([_ray_bin(), "get-auth-token", "--generate"], env=_env(), capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"error: ray get-auth-token --generate failed: "
                         f"{(proc.stderr.strip().splitlines() or ['exit ' + str(proc.returncode)])[-1]}")
    return Path.home() / ".ray" / "auth_token"


def _node_ports(index: int) -> list[str]:
    """Ports Ray would otherwise take at fixed defaults (or from one shared range, for
    worker processes): two nodes on one host would collide. Node `index` gets worker
    ports 20000 + 500 x index and up, below Linux's ephemeral range."""
    low = 20000 + 500 * index
    return [f"--min-worker-port={low}", f"--max-worker-port={low + 499}",f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
            f"--node-manager-port={_free_port()}", f"--object-manager-port={_free_port()}"]


def _spawn(name: str, args: list[str], root: Path) -> dict:
    log = open(root / f"{name}.log", "w")
    proc = subprocess.Popen([_ray_bin(), "start", "--block", "--disable-usage-stats",
                             "--node-ip-address=127.0.0.1", f"--temp-dir={root / name}", *args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=_env())
    _PROCS[proc.pid] = proc
    return {"name": name, "pid": proc.pid, "log": str(root / f"{name}.log")}


def _alive(pid: int) -> bool:
    """Whether anything of the node's process group still runs."""
    if pid in _PROCS and _PROCS[pid].poll() is not None and not _group_has_others(pid):
        return False
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_has_others(pgid: int) -> bool:
    try:
        out = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True, text=True).stdout
    except OSError:
        return True
    return any(int(x) != pgid for x in out.split())


def _stop(node: dict, sig: int, grace_s: float) -> None:
    """Signal the node's process group, then SIGKILL what is left after `grace_s`."""
    for s, wait in ((sig, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(node["pid"], s)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline and _alive(node["pid"]):
            try:
                os.waitpid(node["pid"], os.WNOHANG)  # reap it if it is our child
            except ChildProcessError:
                pass
            time.sleep(0.1)
        if not _alive(node["pid"]):
            return


def _wait_ready(state: dict, timeout_s: float) -> None:
    """Until every node has joined and the head's job server answers."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray 2.60 clusters from `ray start`
    import ray
    from ray.job_submission import JobSubmissionClient

    deadline = time.time() + timeout_s
    want = 1 + len(state["workers"])
    ray.init(address=state["address"], logging_level="ERROR", log_to_driver=False)
    try:
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if len(alive) >= want:
                break
            for node in [state["head"], *state["workers"]]:
                if node["pid"] in _PROCS and _PROCS[node["pid"]].poll() is not None:
                    raise SystemExit(f"error: node {node['name']} exited; see {node['log']}")
            if time.time() > deadline:
                raise SystemExit(f"error: {len(alive)} of {want} nodes joined in {timeout_s:.0f}s; "
                                 f"logs in {Path(state['head']['log']).parent}")
            time.sleep(0.5)
    finally:
        ray.shutdown()
    while True:
        try:
            JobSubmissionClient(state["dashboard"]).list_jobs()
            return
        except Exception as exc:  # the dashboard starts a little after the GCS
            if time.time() > deadline:
                raise SystemExit(f"error: the head's job server did not answer at "
                                 f"{state['dashboard']} ({exc})") from None
            time.sleep(0.5)


def up(root: Path, workers: int, cpus: int, head_cpus: int, timeout_s: float = 180) -> dict:
    root = root.resolve()
    if (root / STATE).exists():
        old = json.loads((root / STATE).read_text())
        if any(_alive(n["pid"]) for n in [old["head"], *old["workers"]]):
            raise SystemExit(f"error: a cluster from {root / STATE} is still running; "
                             f"`down --dir {root}` first")
    root.mkdir(parents=True, exist_ok=True)
    ensure_token()
    port, dash = _free_port(), _free_port()
    head = _spawn("head", ["--head", f"--port={port}", f"--num-cpus={head_cpus}",
                           "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                           f"--dashboard-port={dash}", f"--system-config={json.dumps(SYSTEM_CONFIG)}",
                           "--resources", json.dumps({"head": 1}), *_node_ports(0)], root)
    state = {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}",
             "head": head, "workers": []}
    (root / STATE).write_text(json.dumps(state, indent=2))
    try:
        time.sleep(2.0)  # the GCS must listen before workers join
        for k in range(1, workers + 1):
            state["workers"].append(_spawn(f"node{k}", [
                f"--address=127.0.0.1:{port}", f"--num-cpus={cpus}",
                "--resources", json.dumps({f"node_{k}": 1}), *_node_ports(k)], root))
            (root / STATE).write_text(json.dumps(state, indent=2))
        _wait_ready(state, timeout_s)
    except BaseException:
        down(root)
        raise
    return state


def down(root: Path) -> None:
    path = root.resolve() / STATE
    if not path.exists():
        return
    state = json.loads(path.read_text())
    nodes = [*state["workers"], state["head"]]
    for node in nodes:  # all at once, then whatever outlives the grace period is killed
        try:
            os.killpg(node["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    for node in nodes:  # Ray's processes drain for up to 30 s on SIGTERM: not worth waiting
        _stop(node, signal.SIGTERM, grace_s=2.0)
    path.unlink()
    for node in [state["head"], *state["workers"]]:
        shutil.rmtree(root.resolve() / node["name"], ignore_errors=True)


def remove_node(root: Path, index: int, graceful: bool = False) -> dict:
    state = json.loads((root.resolve() / STATE).read_text())
    matches = [n for n in state["workers"] if n["name"] == f"node{index}"]
    if not matches:
        raise SystemExit(f"error: no worker node {index}; nodes are 1..{len(state['workers'])}")
    _stop(matches[0], signal.SIGTERM if graceful else signal.SIGKILL, grace_s=5.0)
    return matches[0]


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="cluster/local_cluster.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start a head and N worker nodes on 127.0.0.1")
    p_up.add_argument("--dir", required=True, type=Path, help="state, logs and each node's temp dir (short path)")
    p_up.add_argument("--workers", type=int, default=2, help="worker nodes (default 2; 0: a head alone, "
                                                             "with --head-cpus)")
    p_up.add_argument("--cpus", type=int, default=2, help="CPUs each worker node offers (default 2)")
    p_up.add_argument("--head-cpus", type=int, default=0, help="CPUs the head offers (default 0)")
    p_down = sub.add_parser("down", help="stop every node of the cluster by its process group")
    p_down.add_argument("--dir", required=True, type=Path)
    p_rm = sub.add_parser("remove-node", help="kill one worker node (SIGKILL: a lost machine)")
    p_rm.add_argument("--dir", required=True, type=Path)
    p_rm.add_argument("node", type=int, help="worker node number, 1..N")
    p_rm.add_argument("--graceful", action="store_true", help="SIGTERM instead (a drained node)")
    args = ap.parse_args(argv)
    if args.cmd == "up":
        if args.workers < 0 or args.cpus < 1 or args.head_cpus < 0 or args.workers + args.head_cpus < 1:
            ap.error("--workers and --head-cpus must be >= 0 (not both 0), --cpus >= 1")
        state = up(args.dir, args.workers, args.cpus, args.head_cpus)
        print(json.dumps({"address": state["address"], "dashboard": state["dashboard"],
                          "nodes": 1 + len(state["workers"])}))
    elif args.cmd == "down":
        down(args.dir)
    else:
        node = remove_node(args.dir, args.node, args.graceful)
        print(f"removed {node['name']} (pid {node['pid']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
