"""Start-up: seconds from `rtp train` to the first optimizer step, vs a bare Ray Train
script (a tiny `TorchTrainer`) doing the same, each a fresh process with a fresh Ray.

    python benchmarks/startup.py            # 3 interleaved repeats, ~3 min on 2 CPU cores
    python benchmarks/startup.py --smoke    # one of each, 1 worker, at once, joining one Ray (not timed)

The job (both sides): the quickstart's model (byte-level gpt, 2 blocks, d 128, context
64) on its data (the first 400 files of Python's standard library, cut into 65-byte
windows by a Ray Data map), 2 DDP workers at 0.5 CPU with 1 torch thread, micro-batch
16, AdamW, one optimizer step.

- ``rtp``: ``rtp train pipelines/configs/quickstart.yaml --set train.max_steps=1 ...`` as a
  subprocess. The platform's metrics rows carry no wall-clock time, so the first step's
  time is the modification time of the run's ``metrics.jsonl``: with one step it is
  written once, by rank 0, right after that step's optimizer update (and the one small
  all-reduce of its metrics). ``data.val_fraction=0``: the bare side has no validation
  split, and a one-step run evaluates at its last (first) step before that write.
- ``bare``: this file with ``--bare``: what a user writes with Ray Train alone
  (`ray.init`, a Ray Data map over the same files, `TorchTrainer`, `prepare_model`,
  `iter_torch_batches`); rank 0 writes ``time.time()`` to a file right after its first
  ``optimizer.step()``.

Both are measured from just before the subprocess is spawned (interpreter start-up and
imports included) to that timestamp; the process's whole wall time (to exit) is recorded
too. The platform does more before its first step (validation, a look at the data's
size, the run directory) and after it (checkpoint, summary, plot).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, harness_parser, interleaved, out_path, result_meta, stamp, write_result

QUICKSTART = ROOT / "pipelines/configs/quickstart.yaml"
MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64}
MAX_FILES, BATCH, WORKERS = 400, 16, 2


def _rtp_command() -> list[str]:
    rtp = Path(sys.executable).with_name("rtp")  # the console script next to this Python
    return [str(rtp)] if rtp.exists() else [sys.executable, "-m", "raytrain_platform"]


def _spawn(cmd: list[str], timeout: float, address: str | None) -> tuple[float, float]:
    """(spawn time, seconds to exit); raises with the output's tail on failure. `address`:
    a running Ray to join (smoke runs), else each process starts its own."""
    t0 = time.time()
    env = {**os.environ, "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
    env.pop("RAY_ADDRESS", None)
    if address:
        env["RAY_ADDRESS"] = address
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return t0, time.time() - t0


def rtp_side(work: Path, name: str, *, workers: int = WORKERS, address: str | None = None,
             timeout: float = 300) -> dict:
    storage = work / "rtp"
    t0, wall = _spawn([*_rtp_command(), "train", str(QUICKSTART), "--set", "train.max_steps=1",
                       "--set", f"scaling.num_workers={workers}",
                       "--set", f"run.storage_path={storage}", "--set", f"run.name={name}",
                       "--set", "data.val_fraction=0", "--set", "run.eval_every=0",
                       "--set", "run.log_every=1"], timeout, address)
    metrics = storage / name / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["step"] == 1, rows
    first_step = metrics.stat().st_mtime - t0
    shutil.rmtree(storage / name, ignore_errors=True)
    return {"first_step_s": first_step, "wall_s": wall}


def bare_side(work: Path, name: str, *, workers: int = WORKERS, address: str | None = None,
              timeout: float = 300) -> dict:
    stamp_file = work / f"{name}.stamp"
    t0, wall = _spawn([sys.executable, str(Path(__file__).resolve()), "--bare", str(stamp_file),
                       "--storage", str(work / "bare"), "--workers", str(workers)], timeout, address)
    return {"first_step_s": float(stamp_file.read_text()) - t0, "wall_s": wall}


# ---------------------------------------------------------------- the bare script


def _windows(batch: dict) -> dict:
    """Ray Data map: files -> 65-byte windows (64 inputs + 1 target shift), uint8."""
    import numpy as np

    seq = MODEL["block_size"] + 1
    parts = []
    for path in batch["path"]:
        raw = np.fromfile(str(path), dtype=np.uint8)
        n = raw.size // seq
        parts.append(raw[: n * seq].reshape(n, seq))
    return {"tokens": np.concatenate(parts)}


def _bare_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    from raytrain_platform.models.gpt import GPT
    from raytrain_platform.models.specs import GPTSpec

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(GPT(GPTSpec(**MODEL)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    shard = ray.train.get_dataset_shard("train")
    for batch in shard.iter_torch_batches(batch_size=BATCH, drop_last=True):
        tokens = batch["tokens"].long()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        if ray.train.get_context().get_world_rank() == 0:
            Path(config["stamp"]).write_text(repr(time.time()))
        break
    ray.train.report({"loss": float(loss)})


def bare_main(stamp_file: str, storage: str, workers: int) -> int:
    import sysconfig

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if os.environ.get("RAY_ADDRESS"):  # smoke runs join the test's Ray
        ray.init(log_to_driver=False, logging_level="WARNING")
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in root.rglob("*.py") if "site-packages" not in p.parts)[:MAX_FILES]
    ds = ray.data.from_items([{"path": p} for p in files]).map_batches(_windows, batch_size=16)
    trainer = TorchTrainer(
        _bare_loop, train_loop_config={"stamp": stamp_file},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=storage, name=f"bare-{os.getpid()}"),
        datasets={"train": ds})
    trainer.fit()
    return 0


# ---------------------------------------------------------------- the comparison


def measure(work: Path, *, smoke: bool, repeats: int | None = None) -> dict:
    repeats = repeats or (1 if smoke else 3)
    address, workers = None, WORKERS
    if smoke:  # not timed: 1 worker each, joining this process's Ray instead of starting their own
        workers = 1
        import ray
        from common import local_ray

        local_ray()
        address = ray.get_runtime_context().gcs_address
    sides = {"rtp": lambda i: rtp_side(work, f"startup{i}", workers=workers, address=address),
             "bare": lambda i: bare_side(work, f"bare{i}", workers=workers, address=address)}
    if smoke:  # both at once (0.5 CPU each leaves one for Ray Data); only that they run matters
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            futures = {side: pool.submit(fn, 0) for side, fn in sides.items()}
            runs = {side: [f.result()] for side, f in futures.items()}
    else:
        runs = interleaved(sides, repeats, label="startup ")
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("first_step_s", "wall_s")}
           for side, rs in runs.items()}
    return {"startup": {
        **stamp(), "repeats": repeats,
        "job": f"quickstart gpt, {workers} DDP worker(s) x 0.5 CPU, stdlib text via Ray Data, 1 optimizer step",
        "rtp_first_step_s": round(med["rtp"]["first_step_s"], 2),
        "bare_first_step_s": round(med["bare"]["first_step_s"], 2),
        "ratio": round(med["rtp"]["first_step_s"] / med["bare"]["first_step_s"], 3),
        "rtp_wall_s": round(med["rtp"]["wall_s"], 2), "bare_wall_s": round(med["bare"]["wall_s"], 2),
        "all_first_step_s": {side: [round(r["first_step_s"], 2) for r in rs] for side, rs in runs.items()}}}


def table_rows(results: dict) -> list[str]:
    e = results.get("startup")
    if not e:
        return []
    return [f"| start-up: `rtp train` to the first optimizer step vs a bare TorchTrainer script, "
            f"seconds (process start included; whole run to exit: {e['rtp_wall_s']:.1f} vs "
            f"{e['bare_wall_s']:.1f}) | {e['rtp_first_step_s']:.1f} | {e['bare_first_step_s']:.1f} | "
            f"{e['ratio']:.2f} | <= 1.15 |"]


def main(argv: list[str] | None = None) -> int:
    p = harness_parser(__doc__)  # a section of run.py, which renders the table and the results page
    p.add_argument("--bare", metavar="STAMP_FILE", help="(internal) run the bare Ray Train script")
    p.add_argument("--storage", default=None)
    p.add_argument("--workers", type=int, default=WORKERS)
    args = p.parse_args(argv)
    if args.bare:
        return bare_main(args.bare, args.storage or tempfile.mkdtemp(), args.workers)
    with tempfile.TemporaryDirectory(prefix="rtp-startup-") as tmp:
        result = measure(Path(tmp), smoke=args.smoke, repeats=args.repeats)
    print(json.dumps(result, indent=2))
    write_result({"_meta": result_meta(__file__, argv), **result}, out_path(args))
    print("\n".join(table_rows(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
