"""Platform training vs a hand-written PyTorch loop, and the quickstart's data wait:
the functions behind `run.py`'s ``train_vs_loop`` section.

    python benchmarks/run.py --sections train_vs_loop   # ~4 min on 2 quiet CPU cores
    python benchmarks/train_vs_loop.py --smoke          # a few steps, checks it still runs

1. Throughput: `rtp train` on 1 worker (Ray Train + Ray Data reading Parquet) vs a
   plain loop over the same rows already in memory as tensors: same MLP, batch and
   torch thread count (1). The loop is run twice: with AdamW as a user constructs it
   (the default implementation) and with the fused AdamW the platform uses, so the
   second ratio is the platform's overhead alone. A further side runs the same engine
   without Ray (the torchrun core's reader), to tell the engine's cost from Ray's.
   Repeats are interleaved so all sides see the same machine; each figure is the median
   per-step samples/s after warm-up, ratios are of medians.
2. Data wait on the quickstart config: the fraction of each step spent waiting for
   the next batch (the engine's `data_wait_frac`), median and worst steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import steady  # noqa: E402

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


def platform_run(data_dir: Path, storage: Path, name: str, steps: int, hidden: list[int],
                 batch: int) -> dict:
    """`rtp train`'s path: Ray Train worker, Ray Data streaming the Parquet files."""
    from raytrain_platform.launch.trainer import train

    return steady(train(_config(data_dir, storage, name, steps, hidden, batch),
                         progress=False).metrics)


def engine_run(data_dir: Path, storage: Path, name: str, steps: int, hidden: list[int],
               batch: int) -> dict:
    """The same engine without Ray (what `torchrun -m raytrain_platform.core` runs), in
    this process: it separates the engine's own cost from Ray's."""
    import yaml

    from raytrain_platform.core.__main__ import main as core_main
    from raytrain_platform.core.rundir import read_metrics

    path = storage / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_config(data_dir, storage, name, steps, hidden, batch)))
    core_main(["--config", str(path)])
    return steady(read_metrics(storage / name))


def hand_loop(data_dir: Path, steps: int, hidden: list[int], batch: int, *, fused: bool = False) -> dict:
    """What a user would write without the platform: tensors in memory, a for loop, and
    AdamW as constructed by default (`fused`: the single-kernel AdamW the platform uses)."""
    import pyarrow.parquet as pq

    from raytrain_platform.models.mlp import MLP
    from raytrain_platform.models.specs import MLPSpec

    table = pq.read_table(data_dir)
    x = torch.from_numpy(np.stack([table.column(f"f{j}").to_numpy() for j in range(FEATURES)], 1))
    y = torch.from_numpy(table.column("label").to_numpy())
    torch.manual_seed(0)
    model = MLP(MLPSpec(input_dim=FEATURES, hidden_sizes=hidden, num_outputs=CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=fused or None)
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
    """The ``train_vs_loop`` section of `run.py` (which owns the repeats, the medians,
    results.json and the table): ``--smoke`` runs it at tiny sizes and writes nothing."""
    import run

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few steps, one repeat; no results file")
    args = p.parse_args(argv)
    return run.main(["--sections", "train_vs_loop", *(["--smoke"] if args.smoke else [])])


if __name__ == "__main__":
    raise SystemExit(main())
