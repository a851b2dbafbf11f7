"""Platform training vs a hand-written PyTorch loop, and the quickstart's data wait.

    python benchmarks/train_vs_loop.py             # full: ~6 min on 2 CPU cores
    python benchmarks/train_vs_loop.py --smoke     # a few steps, checks it still runs

1. Throughput: `rtp train` on 1 worker (Ray Train + Ray Data reading Parquet) vs a
   plain loop over the same rows already in memory as tensors: same MLP, optimizer,
   batch and torch thread count (1). A third side runs the same engine without Ray
   (the torchrun core's reader), to tell the engine's cost from Ray's. Repeats are
   interleaved (platform, engine, loop, platform, ...) so all see the same machine;
   each figure is the median per-step samples/s after warm-up, ratios are of medians.
2. Data wait on the quickstart config: the fraction of each step spent waiting for
   the next batch (the engine's `data_wait_frac`), median and worst steps.

Writes benchmarks/results.json (merged by key) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raytrain_platform.data.generate import write_tabular_parquet  # noqa: E402

FEATURES, CLASSES, LR = 64, 8, 1e-3
# (name, hidden sizes, batch): a small model whose step (~8 ms) shows the per-step
# overhead plainly, and a medium one (~2.2M parameters) with a more typical step.
MODELS = [("small", [512, 512], 256), ("medium", [1024, 1024, 1024], 512)]


def _config(data_dir: Path, storage: Path, name: str, steps: int, hidden: list[int],
            batch: int) -> dict:
    return {
        "model": {"name": "mlp", "kwargs": {"hidden_sizes": hidden}},
        "data": {"source": "parquet", "path": str(data_dir), "batch_size": batch,
                 "val_fraction": 0.0, "prefetch_batches": 4},
        "train": {"max_steps": steps, "lr": LR, "lr_schedule": "constant", "grad_clip": 1.0},
        "parallel": {"strategy": "none"},
        "scaling": {"num_workers": 1, "cpus_per_worker": 1, "torch_threads": 1},
        "run": {"name": name, "storage_path": str(storage), "checkpoint_every": 0,
                "eval_every": 0, "log_every": 1},
    }


def _steady(rows: list[dict]) -> dict:
    rows = rows[5:]  # the first steps include warm-up
    return {"samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
            "data_wait_frac": statistics.median(r["data_wait_frac"] for r in rows)}


def platform_run(data_dir: Path, storage: Path, name: str, steps: int, hidden: list[int],
                 batch: int) -> dict:
    """`rtp train`'s path: Ray Train worker, Ray Data streaming the Parquet files."""
    from raytrain_platform.launch.trainer import train

    return _steady(train(_config(data_dir, storage, name, steps, hidden, batch),
                         progress=False).metrics)


def engine_run(data_dir: Path, storage: Path, name: str, steps: int, hidden: list[int],
               batch: int) -> dict:
    """The same engine without Ray (what `torchrun -m raytrain_platform.core` runs), in
    this process: it separates the engine's own cost from Ray's."""
    import yaml

    from raytrain_platform.core.__main__ import main as core_main
    from raytrain_platform.rundir import read_metrics

    path = storage / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_config(data_dir, storage, name, steps, hidden, batch)))
    core_main(["--config", str(path)])
    return _steady(read_metrics(storage / name))


def hand_loop(data_dir: Path, steps: int, hidden: list[int], batch: int) -> dict:
    """What a user would write without the platform: tensors in memory, a for loop."""
    import pyarrow.parquet as pq

    from raytrain_platform.models.mlp import MLP
    from raytrain_platform.models.specs import MLPSpec

    table = pq.read_table(data_dir)
    x = torch.from_numpy(np.stack([table.column(f"f{j}").to_numpy() for j in range(FEATURES)], 1))
    y = torch.from_numpy(table.column("label").to_numpy())
    torch.manual_seed(0)
    model = MLP(MLPSpec(input_dim=FEATURES, hidden_sizes=hidden, num_outputs=CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        lo = (step * batch) % (x.shape[0] - batch)
        loss = torch.nn.functional.cross_entropy(model(x[lo:lo + batch]), y[lo:lo + batch])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"samples_per_s": batch / statistics.median(times[5:])}


def quickstart_wait(storage: Path, steps: int) -> dict:
    from raytrain_platform.launch.trainer import train

    result = train(ROOT / "pipelines/configs/quickstart.yaml", [
        f"run.storage_path={storage}", f"train.max_steps={steps}", "run.eval_every=0",
        "run.checkpoint_every=0", "run.log_every=1"], progress=False)
    waits = sorted(r["data_wait_frac"] for r in result.metrics[2:])
    return {"steps": len(waits), "median_data_wait_frac": statistics.median(waits),
            "p90_data_wait_frac": waits[int(0.9 * (len(waits) - 1))],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in result.metrics[2:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--quickstart-steps", type=int, default=60)
    p.add_argument("--smoke", action="store_true", help="a few steps, one repeat; no results file")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps, args.quickstart_steps = 1, 12, 8
    torch.set_num_threads(1)
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    work = Path(tempfile.mkdtemp(prefix="rtp-bench-"))
    data = work / "tabular"
    rows = max(max(b for _, _, b in MODELS) * (args.steps + 8), 20_000)
    write_tabular_parquet(data, rows=rows, features=FEATURES, classes=CLASSES, files=4,
                          row_group_rows=4096)
    result: dict = {}
    table = ["| benchmark | platform | baseline | ratio |", "|---|---|---|---|"]
    for label, hidden, batch in (MODELS[:1] if args.smoke else MODELS):  # smoke: the small one
        plat, core, loop = [], [], []
        for i in range(args.repeats):  # interleaved: all sides see the same machine
            plat.append(platform_run(data, work / "runs", f"{label}{i}", args.steps, hidden, batch))
            core.append(engine_run(data, work / "core", f"{label}{i}", args.steps, hidden, batch))
            loop.append(hand_loop(data, args.steps, hidden, batch))
            print(f"{label} repeat {i + 1}/{args.repeats}: platform {plat[-1]['samples_per_s']:,.0f} "
                  f"samples/s (data wait {100 * plat[-1]['data_wait_frac']:.1f}%), engine without Ray "
                  f"{core[-1]['samples_per_s']:,.0f}, hand loop {loop[-1]['samples_per_s']:,.0f}",
                  flush=True)
        p_med = statistics.median(r["samples_per_s"] for r in plat)
        c_med = statistics.median(r["samples_per_s"] for r in core)
        l_med = statistics.median(r["samples_per_s"] for r in loop)
        overhead_ms = 1000 * batch * (1 / p_med - 1 / l_med)
        result[f"train_vs_loop_{label}"] = {
            "model": f"mlp {FEATURES}-{'-'.join(map(str, hidden))}-{CLASSES}, batch {batch}, "
                     "AdamW, 1 worker, 1 torch thread",
            "repeats": args.repeats, "steps": args.steps,
            "platform_samples_per_s": round(p_med, 1), "hand_loop_samples_per_s": round(l_med, 1),
            "ratio": round(p_med / l_med, 3), "overhead_ms_per_step": round(overhead_ms, 2),
            "engine_without_ray_samples_per_s": round(c_med, 1),
            "engine_without_ray_ratio": round(c_med / l_med, 3),
            "platform_data_wait_frac": round(statistics.median(r["data_wait_frac"] for r in plat), 4)}
        table.append(f"| 1-worker training ({label} mlp, batch {batch}), Ray Data from Parquet vs "
                     f"in-memory loop, samples/s | {p_med:,.0f} | {l_med:,.0f} | {p_med / l_med:.3f} "
                     f"({overhead_ms:+.1f} ms/step) |")
        table.append(f"| the same engine without Ray (torchrun core reading the Parquet files) vs "
                     f"in-memory loop | {c_med:,.0f} | {l_med:,.0f} | {c_med / l_med:.3f} |")
    quick = quickstart_wait(work / "runs", args.quickstart_steps)
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    result["quickstart_data_wait"] = {k: round(v, 4) if isinstance(v, float) else v
                                      for k, v in quick.items()}
    table.append(f"| quickstart data wait, median / p90 of step time | "
                 f"{100 * quick['median_data_wait_frac']:.1f}% / {100 * quick['p90_data_wait_frac']:.1f}% | | |")
    table = "\n".join(table)
    print(table)
    if not args.smoke:
        out = ROOT / "benchmarks" / "results.json"
        merged = json.loads(out.read_text()) if out.exists() else {}
        merged.update(result)  # results.md is rendered from results.json by benchmarks/run.py
        merged["_meta"] = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/train_vs_loop.py",
                           "machine": "2 CPU cores, no GPU", "torch": torch.__version__, "ray": ray.__version__}
        out.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
