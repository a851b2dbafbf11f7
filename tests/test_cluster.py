"""Multi-node runs and failures on a real Ray cluster of three nodes on this machine
(cluster/local_cluster.py: a head with no CPUs and two worker nodes, each its own
`ray start`), with storage at a path every node sees. Each failure is a real SIGKILL
of a real process: a training worker while it writes a checkpoint, and a whole worker
node under an elastic run. A tensor-parallel run keeps each TP group on one node where
Ray's PACK alone would split one. The driver-kill case is tests/test_e2e.py."""

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, mlp_config, stop_group, torchrun_metrics, wait_for
from test_fsdp import gpt_config
from raytrain_platform.core.rundir import latest_checkpoint, list_checkpoints

# Outside the default run (about 7 minutes here, plus ~2 for the TP placement run; the CI suite
# keeps under 20): run with
# `pytest -m extended tests`.
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(420)]
BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parent
SCRIPT = ROOT / "cluster" / "local_cluster.py"
CPUS_PER_NODE = 3


def _script(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    # The nodes' workers inherit this environment: tests/ on the path for the user model.
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=_client_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


_NODE_IDS = """
import json, ray
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
print(json.dumps({{k: n["NodeID"] for n in ray.nodes() if n["Alive"] for k in n["Resources"]
                  if k in ("head", "node_1", "node_2")}}))
"""


def _client_env() -> dict:
    # Ray 2.60 clusters from `ray start` take clients with the token (~/.ray/auth_token);
    # tests/ on the path for the user model.
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": "",
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}


@pytest.fixture(scope="module")
def cluster():
    """Head (0 CPUs) + 2 worker nodes (3 CPUs each); stopped by its own pids at the end."""
    root = Path("/tmp") / f"rtpc-{uuid.uuid4().hex[:6]}"  # short: Ray's socket paths live under it
    try:
        out = _script("up", "--dir", str(root), "--workers", "2", "--cpus", str(CPUS_PER_NODE))
        state = {**json.loads(out.stdout.strip().splitlines()[-1]), "dir": root}
        ids = subprocess.run([sys.executable, "-c", _NODE_IDS.format(address=state["address"])],
                             capture_output=True, text=True, env=_client_env(), timeout=120)
        assert ids.returncode == 0, ids.stderr[-2000:]
        state["node_ids"] = json.loads(ids.stdout.strip().splitlines()[-1])
        yield state
    finally:
        _script("down", "--dir", str(root), timeout=120)
        shutil.rmtree(root, ignore_errors=True)  # the nodes' logs


def _rtp_train(cfg: dict, path: Path, address: str) -> subprocess.Popen:
    """`rtp train CONFIG --address ...`: a driver attached to the cluster, as a user runs it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.Popen([sys.executable, "-m", "raytrain_platform", "train", str(path), "--address", address],
                            cwd=ROOT, env=_client_env(), stdout=open(path.with_suffix(".log"), "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path, timeout: int = 300) -> None:
    try:
        assert proc.wait(timeout=timeout) == 0, log.read_text()[-4000:]
    finally:
        stop_group(proc)


def _attempts(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "workers.json").read_text())["attempts"]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def _assert_same_losses(got: list[tuple[int, float]], want: list[tuple[int, float]], rtol: float) -> None:
    assert [s for s, _ in got] == [s for s, _ in want], (got, want)
    for (step, a), (_, b) in zip(got, want):
        assert abs(a - b) <= rtol * abs(b) + 1e-6, (step, a, b)


def test_ray_job_submit_trains_across_two_nodes(cluster, tmp_path):
    """`ray job submit` of the quickstart pipeline; SPREAD puts its two workers on the
    two worker nodes (the node ids they report), checkpoints land in shared storage. The
    job's own runtime_env sets variables the driver's would too (Ray refused the merge)."""
    storage, job_id = tmp_path / "runs", f"rtp-nodes-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": cluster["dashboard"]}
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", cluster["dashboard"], "--submission-id", job_id,
         "--working-dir", str(ROOT), "--runtime-env-json",
         json.dumps({"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}}),
         "--", "python", "pipelines/train.py", "--config", "pipelines/configs/quickstart.yaml",
         "--set", f"run.storage_path={storage}", "--set", "train.max_steps=6",
         "--set", "run.eval_every=3", "--set", "run.checkpoint_every=3", "--set", "data.max_files=40",
         "--set", "scaling.placement_strategy=SPREAD"],
        env=env, capture_output=True, text=True, timeout=360)
    status = subprocess.run([str(BIN / "ray"), "job", "status", "--address", cluster["dashboard"], job_id],
                            env=env, capture_output=True, text=True, timeout=60)
    assert "succeeded" in status.stdout, (submit.stdout[-3000:], submit.stderr[-2000:], status.stdout)
    assert "done: 6 steps" in submit.stdout
    run_dir = storage / "quickstart"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and "val_perplexity" in rows[-1]
    assert (run_dir / "checkpoint_000006" / "model.safetensors").exists()
    [attempt] = _attempts(run_dir)
    nodes = sorted(w["node_id"] for w in attempt["workers"])
    assert nodes == sorted([cluster["node_ids"]["node_1"], cluster["node_ids"]["node_2"]]), attempt


def test_ray_job_submit_runs_a_sweep(cluster, tmp_path):
    """pipelines/sweep.py as a `ray job submit` job: a 2-trial grid whose trials train on
    the worker nodes; results.csv and the best config land in shared storage."""
    base = mlp_config(tmp_path, "base", train={"max_steps": 6}, run={"eval_every": 3, "checkpoint_every": 6})
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump({"name": "lr", "base": base, "space": {"train.lr": [0.05, 0.02]},
                                          "storage_path": str(tmp_path / "sweeps")}))
    job_id = f"rtp-sweep-{uuid.uuid4().hex[:8]}"
    env = {**_client_env(), "RAY_ADDRESS": cluster["dashboard"]}
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", cluster["dashboard"], "--submission-id", job_id,
         "--working-dir", str(ROOT), "--", "python", "pipelines/sweep.py", "--sweep", str(sweep_file)],
        env=env, capture_output=True, text=True, timeout=360)
    assert submit.returncode == 0 and "best: trial_0" in submit.stdout, (submit.stdout[-3000:],
                                                                         submit.stderr[-2000:])
    out = tmp_path / "sweeps" / "lr"
    lines = (out / "results.csv").read_text().splitlines()
    assert len(lines) == 3 and all(",done," in line for line in lines[1:]), lines
    assert yaml.safe_load((out / "best_config.yaml").read_text())["train"]["lr"] in (0.05, 0.02)
    workers = {node: cluster["node_ids"][node] for node in ("node_1", "node_2")}
    for trial in ("trial_000", "trial_001"):
        [attempt] = _attempts(out / "runs" / trial)
        assert attempt["workers"][0]["node_id"] in workers.values(), attempt


def _big_mlp_config(tmp: Path, name: str, **scaling) -> dict:
    # ~34M parameters with AdamW: a 400 MB checkpoint, whose copy to storage takes long
    # enough (tenths of a second) for a watcher to catch it half-written.
    cfg = mlp_config(tmp, name, data={"batch_size": 8, "num_samples": 2048, "val_fraction": 0.0},
                     train={"max_steps": 20, "optimizer": "adamw", "lr": 1e-4},
                     parallel={"strategy": "ddp"},
                     scaling={"num_workers": 2, "cpus_per_worker": 1, "placement_strategy": "SPREAD",
                              **scaling},
                     run={"checkpoint_every": 5, "eval_every": 0, "max_failures": 1, "keep_checkpoints": 3})
    cfg["model"]["kwargs"] = {"hidden_sizes": [4096, 4096, 4096]}
    return cfg


def _sizes(ckpt: Path) -> dict[str, int]:
    """Sizes of the weights and optimizer files (the same at every step of one run)."""
    return {p.name: p.stat().st_size for p in ckpt.iterdir() if p.name in ("model.safetensors", "optimizer.pt")}


def test_worker_killed_while_writing_a_checkpoint(cluster, tmp_path):
    """SIGKILL rank 0 while its checkpoint is being copied to storage: the half-written
    checkpoint is never taken as the latest; with run.max_failures 1 the run restarts
    from the last whole one and ends with exactly max_steps steps and the losses of an
    uninterrupted run with the same checkpoint schedule."""
    cfg = _big_mlp_config(tmp_path / "ray", "ckpt-kill")
    run_dir = tmp_path / "ray" / "ckpt-kill"
    seen: dict = {}

    def watch():
        first = None
        while "error" not in seen and "killed" not in seen:
            done = list_checkpoints(run_dir)
            if first is None and done:
                first = done[0]
                seen["whole"] = _sizes(first)
            for step in (10, 15):
                ckpt = run_dir / f"checkpoint_{step:06d}"
                if first is None or not ckpt.is_dir():
                    continue
                sizes = _sizes(ckpt)
                if sizes != seen["whole"]:  # files missing or cut short: being written now
                    pid = _attempts(run_dir)[0]["workers"][0]["pid"]
                    os.kill(pid, signal.SIGKILL)
                    seen.update(killed=step, pid=pid, partial=sizes)
                    time.sleep(0.5)  # the copy has stopped with its writer
                    seen["latest_after_kill"] = latest_checkpoint(run_dir)
                    seen["partial_after_kill"] = _sizes(ckpt) != seen["whole"]
                    return
                seen.setdefault("missed", []).append(step)  # whole before we looked
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _finish(_rtp_train(cfg, tmp_path / "ckpt-kill.yaml", cluster["address"]), tmp_path / "ckpt-kill.log")
    finally:
        seen.setdefault("error", "stop")
        watcher.join(timeout=10)
    assert "killed" in seen, f"no checkpoint was caught half-written: {seen}"
    killed = seen["killed"]
    # Straight after the kill: the partial checkpoint is there but never the latest.
    assert seen["partial_after_kill"], seen
    assert seen["latest_after_kill"].name == f"checkpoint_{killed - 5:06d}", seen

    attempts = _attempts(run_dir)
    assert len(attempts) == 2 and seen["pid"] not in [w["pid"] for w in attempts[1]["workers"]]
    assert [s for s, _ in _losses(run_dir)] == list(range(1, 21))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 20
    state = json.loads((run_dir / "checkpoint_000020" / "trainer_state.json").read_text())
    assert state["state"]["step"] == 20
    assert all(_sizes(c) == seen["whole"] for c in list_checkpoints(run_dir))

    ref_cfg = _big_mlp_config(tmp_path / "ref", "ckpt-kill")
    torchrun_metrics(ref_cfg, tmp_path / "ref" / "c.yaml", 2)
    _assert_same_losses(_losses(run_dir), _losses(tmp_path / "ref" / "ckpt-kill"), rtol=1e-5)


_PACK_ALONE = """
import collections, json, ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
pg = placement_group([{{"CPU": 1}}] * 4, strategy="PACK")
ray.get(pg.ready(), timeout=60)
per_node = collections.Counter(placement_group_table(pg)["bundles_to_node_id"].values())
print(json.dumps(sorted(per_node.values())))
remove_placement_group(pg)
"""


def test_tp_groups_stay_on_one_node(cluster, tmp_path):
    """tp 2 x fsdp 2 on 4 one-CPU workers over the two 3-CPU worker nodes. Ray's PACK
    alone, checked first with a bare placement group of the same bundles, puts 3 workers
    on one node and 1 on the other: a TP group would span the nodes. The run's placement
    pins 2 + 2 (launch/placement.py), and each TP group's ranks report one node."""
    pack = subprocess.run([sys.executable, "-c", _PACK_ALONE.format(address=cluster["address"])],
                          capture_output=True, text=True, env=_client_env(), timeout=120)
    assert pack.returncode == 0, pack.stderr[-2000:]
    assert json.loads(pack.stdout.strip().splitlines()[-1]) == [1, 3]

    cfg = gpt_config(tmp_path, "tp-nodes", parallel={"tp_size": 2, "strategy": "fsdp"},
                     data={"batch_size": 4}, train={"max_steps": 3},
                     scaling={"num_workers": 4, "cpus_per_worker": 1, "torch_threads": 1},
                     run={"checkpoint_every": 0, "eval_every": 0})
    log = tmp_path / "tp-nodes.log"
    _finish(_rtp_train(cfg, tmp_path / "tp-nodes.yaml", cluster["address"]), log)
    assert "placement: 2 tensor-parallel groups of 2 workers, each group on one node: 1 on node" \
        in log.read_text(), log.read_text()[-3000:]
    [attempt] = _attempts(tmp_path / "tp-nodes")
    node_of = {w["rank"]: w["node_id"] for w in attempt["workers"]}
    assert node_of[0] == node_of[1] and node_of[2] == node_of[3], node_of
    workers_per_node = collections.Counter(node_of.values())
    assert workers_per_node == {cluster["node_ids"]["node_1"]: 2, cluster["node_ids"]["node_2"]: 2}
    assert [s for s, _ in _losses(tmp_path / "tp-nodes")] == [1, 2, 3]


# Last in this module: it removes a worker node, which the tests above need.
def test_elastic_run_goes_on_when_a_node_is_lost(cluster, tmp_path):
    """num_workers {min: 1, max: 2}, one worker per node: SIGKILL worker node 2 after the
    step-10 checkpoint. The run restarts on the one node left with one worker and
    accumulation 2 (the same global batch), and ends with the uninterrupted losses."""
    cfg = mlp_config(tmp_path, "elastic", data={"batch_size": 8, "num_samples": 4096},
                     train={"max_steps": 40, "lr": 0.05},
                     parallel={"strategy": "ddp"},
                     scaling={"num_workers": {"min": 1, "max": 2}, "cpus_per_worker": CPUS_PER_NODE - 1,
                              "placement_strategy": "SPREAD"},
                     run={"checkpoint_every": 10, "eval_every": 0, "max_failures": 2})
    cfg["model"] = {"name": "user_models:slow_mlp", "task": "classification",
                    "kwargs": {"input_dim": 16, "num_outputs": 4, "delay_s": 0.2}}
    run_dir = tmp_path / "elastic"
    removed: dict = {}

    def remove_node_2():
        try:
            wait_for(lambda: (run_dir / "checkpoint_000010" / "trainer_state.json").exists(), 300,
                     "the step-10 checkpoint")
            removed["at_step"] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
            removed["out"] = _script("remove-node", "--dir", str(cluster["dir"]), "2").stdout
        except BaseException as exc:  # reported by the main thread
            removed["error"] = repr(exc)

    killer = threading.Thread(target=remove_node_2, daemon=True)
    killer.start()
    _finish(_rtp_train(cfg, tmp_path / "elastic.yaml", cluster["address"]), tmp_path / "elastic.log")
    killer.join(timeout=30)
    assert "out" in removed, removed
    assert removed["at_step"] < 40, "the run ended before the node was removed: nothing was tested"

    first, *rest = _attempts(run_dir)
    assert first["world_size"] == 2 and first["grad_accum_steps"] == 1
    assert sorted(w["node_id"] for w in first["workers"]) == sorted(
        [cluster["node_ids"]["node_1"], cluster["node_ids"]["node_2"]])
    last = rest[-1]
    assert last["world_size"] == 1 and last["grad_accum_steps"] == 2, rest
    assert last["workers"][0]["node_id"] == cluster["node_ids"]["node_1"]
    assert [s for s, _ in _losses(run_dir)] == list(range(1, 41))

    # Uninterrupted, fixed at two workers: the same losses (accumulation keeps the batch).
    ref = json.loads(json.dumps(cfg))
    ref["scaling"] = {"num_workers": 2, "cpus_per_worker": 0.5, "torch_threads": 1}
    ref["run"]["storage_path"] = str(tmp_path / "ref")
    torchrun_metrics(ref, tmp_path / "ref" / "c.yaml", 2, env={"PYTHONPATH": str(TESTS)})
    _assert_same_losses(_losses(run_dir), _losses(tmp_path / "ref" / "elastic"), rtol=1e-5)


_TOKENIZE = """
import collections, json, time, tracemalloc
import ray
from ray.util.state import list_tasks
from raytrain_platform.data import jsonl
from raytrain_platform.data.sources import SourceSpec, describe

jsonl.BLOCK_BYTES = 64 << 10  # ranges the driver cuts: many tasks per file
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
out = {{}}
for name, path in (("warm", "{small}"), ("large", "{large}")):  # warm: imports and Ray Data's first run
    spec = SourceSpec(kind="jsonl", task="lm", val_fraction=0.1, seq_len=129, path=path, format="chat",
                      tokenizer="{tok}", packing="documents", cache_root="{cache}")
    tracemalloc.start()
    info = describe(spec)
    out[name] = {{"peak": tracemalloc.get_traced_memory()[1], "windows": info.num_train + info.num_val,
                  "prepared": info.prepared}}
    tracemalloc.stop()
time.sleep(3)  # task events reach the dashboard a moment after the tasks end
tasks = list_tasks(address="{dashboard}", filters=[("name", "=", "MapBatches(tokenize_blocks)")], limit=10000,
                   raise_on_missing_output=False)
out["tokenize_tasks_per_node"] = collections.Counter(t.node_id for t in tasks)
print(json.dumps(out))
"""

_COUNT = """
import collections, json
import ray
from ray.util.state import list_tasks
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
tasks = list_tasks(address="{dashboard}", filters=[("name", "=", "MapBatches(tokenize_blocks)")], limit=10000,
                   raise_on_missing_output=False)
print(json.dumps(collections.Counter(t.node_id for t in tasks)))
"""


def test_the_tokenizing_pass_runs_on_every_node_once(cluster, tmp_path):
    """The tokenizing pass of a JSONL cut into many byte ranges runs its tasks on both
    worker nodes (Ray's own task records); the driver holds no window (its traced peak,
    for 48x the records, is a small part of their windows); a training run on that data
    reads the written windows: no tokenizing task runs again."""
    from raytrain_platform.tools import tiny_llm

    tiny = tiny_llm.make_all(tmp_path / "tiny", samples=600)
    small = tiny["chat"]
    large = tmp_path / "large.jsonl"
    large.write_text(small.read_text() * 48)
    script = _TOKENIZE.format(address=cluster["address"], dashboard=cluster["dashboard"], small=small, large=large,
                              tok=tiny["tokenizer"], cache=tmp_path / "datasets")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_client_env(),
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    per_node = found["tokenize_tasks_per_node"]
    workers = {cluster["node_ids"]["node_1"], cluster["node_ids"]["node_2"]}
    window_bytes = found["large"]["windows"] * 129 * 9  # int32 tokens and positions, a uint8 mask
    print(f"tokenizing tasks per node: {per_node}; the driver's traced peak for the large corpus "
          f"{found['large']['peak']:,} B, its windows {window_bytes:,} B ({found['large']['windows']:,})")
    assert set(per_node) == workers and min(per_node.values()) >= 10, per_node  # the head has no CPU
    assert found["large"]["windows"] > 45 * found["warm"]["windows"]
    assert found["large"]["peak"] < window_bytes / 8, found  # rows per range and per file, no window
    # Training on the large corpus, on the cluster: the dataset is read, never tokenized again.
    cfg = {"model": {"name": "hf", "kwargs": {"path": str(tiny["model"])}},
           "data": {"source": "jsonl", "path": str(large), "format": "chat", "batch_size": 4, "seq_len": 128,
                    "val_fraction": 0.1, "cache_path": str(tmp_path / "datasets")},
           "scaling": {"num_workers": 2, "cpus_per_worker": 1}, "parallel": {"strategy": "ddp"},
           "train": {"max_steps": 3, "lr": 1e-3},
           "run": {"name": "read", "storage_path": str(tmp_path / "runs"), "eval_every": 3, "checkpoint_every": 3}}
    train = _rtp_train(cfg, tmp_path / "read.yaml", cluster["address"])
    _finish(train, tmp_path / "read.log")
    assert "written before" in (tmp_path / "read.log").read_text()
    count = _COUNT.format(address=cluster["address"], dashboard=cluster["dashboard"])
    after = subprocess.run([sys.executable, "-c", count], capture_output=True, text=True, env=_client_env(),
                           timeout=120, cwd=ROOT)
    assert after.returncode == 0, after.stderr[-3000:]
    assert json.loads(after.stdout.strip().splitlines()[-1]) == per_node  # no tokenizing task since
