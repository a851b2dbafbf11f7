"""Throughput and per-rank memory of every parallel layout on one gpt config, on CPU.

    python benchmarks/strategies.py             # full: ~10 min on 2 CPU cores
    python benchmarks/strategies.py --smoke     # 3 steps of 3 layouts, checks it still runs

Each layout trains the same model on the same global batch (32 sequences of 64 bytes
per optimizer step) with the Ray-free core under torchrun (gloo, 1 torch thread per
rank). Throughput is the median of per-step samples/s after 3 warm-up steps, over
interleaved repeats (layout A, B, ..., A, B, ...); memory is rank 0's bytes of
parameters + gradients + optimizer state (the engine's exact per-rank count; for PP,
rank 0 is the first stage, which holds the embeddings).

On a CPU box with fewer cores than ranks, the ranks time-share cores: throughput
then shows the communication and bubble overheads of each layout, not the speed-up
more devices would give. Writes benchmarks/strategies.json (``--out``) and prints a
markdown table; ``--page`` also writes it to benchmarks/results/strategies-DATE.md.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
from pathlib import Path

import yaml
from common import finish, harness_parser, torchrun_core

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"name": "gpt", "kwargs": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64}}
GLOBAL_BATCH = 32
# name -> (ranks, parallel section); data-parallel size = ranks / (tp x pp)
LAYOUTS = {
    "none": (1, {"strategy": "none"}),
    "ddp x2": (2, {"strategy": "ddp"}),
    "fsdp x2": (2, {"strategy": "fsdp"}),
    "tp2": (2, {"tp_size": 2}),
    "tp2 + sequence parallel": (2, {"tp_size": 2, "sequence_parallel": True}),
    "pp2 gpipe": (2, {"pp_size": 2, "pp_schedule": "gpipe", "pp_microbatches": 4}),
    "pp2 1f1b": (2, {"pp_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 4}),
    "pp2 interleaved 1f1b": (2, {"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 4}),
    "tp2 x fsdp2": (4, {"tp_size": 2, "strategy": "fsdp"}),
    "pp2 x ddp2": (4, {"pp_size": 2, "strategy": "ddp", "pp_microbatches": 4}),
}


def _config(storage: Path, name: str, ranks: int, parallel: dict, steps: int) -> dict:
    dp = ranks // (parallel.get("tp_size", 1) * parallel.get("pp_size", 1))
    return {
        "model": MODEL,
        "data": {"source": "synthetic", "batch_size": GLOBAL_BATCH // dp, "num_samples": 8192,
                 "val_fraction": 0.0},
        "train": {"max_steps": steps, "lr": 1e-3, "lr_schedule": "constant", "grad_clip": 1.0},
        "parallel": parallel,
        "scaling": {"num_workers": ranks, "cpus_per_worker": 1, "torch_threads": 1},
        "run": {"name": name, "storage_path": str(storage), "checkpoint_every": 0,
                "eval_every": 0, "log_every": 1},
    }


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of all finished child processes: torchrun and its ranks."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_cost(storage: Path, name: str, ranks: int, parallel: dict, steps: int) -> float:
    """CPU seconds per sample over all ranks: a run of 2 steps subtracted from one of
    2 + `steps` (start-up cancels). Unlike samples/s it does not depend on what else
    the machine runs (ranks that wait in gloo sleep, they do not spin)."""
    short = run_layout(storage, f"{name}_short", ranks, parallel, 2)["cpu_s"]
    long = run_layout(storage, f"{name}_long", ranks, parallel, 2 + steps)["cpu_s"]
    return (long - short) / (steps * GLOBAL_BATCH)


def run_layout(storage: Path, name: str, ranks: int, parallel: dict, steps: int) -> dict:
    """One torchrun run; median samples/s after warm-up and rank 0's state bytes."""
    cfg = _config(storage, name, ranks, parallel, steps)
    path = storage / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cpu_before = _children_cpu_s()
    torchrun_core(ranks, path, label=name)
    cpu_s = _children_cpu_s() - cpu_before
    rows = [json.loads(x) for x in (storage / name / "metrics.jsonl").read_text().splitlines()]
    steady = rows[3:] or rows
    return {"samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
            "load_avg_1m": os.getloadavg()[0],  # other work on the machine during the run
            "cpu_s": cpu_s,
            "state_bytes": rows[-1]["param_bytes"] + rows[-1]["grad_bytes"] + rows[-1]["optim_bytes"],
            "param_bytes": rows[-1]["param_bytes"]}


def main(argv: list[str] | None = None) -> int:
    # --smoke: 3 steps of one data-, tensor- and pipeline-parallel layout, one repeat
    # (tests/test_model_parallel.py checks every layout).
    p = harness_parser(__doc__, out=ROOT / "benchmarks" / "strategies.json", page="strategies")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--cpu-steps", type=int, default=15, help="steps of the CPU-cost difference")
    args = p.parse_args(argv)
    args.repeats = args.repeats or 3
    layouts = LAYOUTS
    if args.smoke:
        args.repeats, args.steps, args.cpu_steps = 1, 3, 0
        layouts = {name: LAYOUTS[name] for name in ("none", "tp2", "pp2 1f1b")}
    results: dict[str, list[dict]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory(prefix="rtp-strategies-") as tmp:
        for i in range(args.repeats):
            for name, (ranks, parallel) in layouts.items():
                slug = f"{name.replace(' ', '_').replace('+', '')}_{i}"
                results[name].append(run_layout(Path(tmp), slug, ranks, parallel, args.steps))
                print(f"repeat {i + 1}/{args.repeats} {name}: "
                      f"{results[name][-1]['samples_per_s']:,.1f} samples/s", flush=True)
        cpu = {name: cpu_cost(Path(tmp), f"cpu_{i}", ranks, parallel, args.cpu_steps)
               for i, (name, (ranks, parallel)) in enumerate(layouts.items())} if args.cpu_steps else {}
    base = statistics.median(r["samples_per_s"] for r in results["none"])
    table = ["| layout | ranks | samples/s (median) | vs none | CPU ms per sample, all ranks | "
             "rank-0 params+grads+optimizer |", "|---|---|---|---|---|---|"]
    summary = {}
    for name, rows in results.items():
        sps = statistics.median(r["samples_per_s"] for r in rows)
        state = rows[-1]["state_bytes"]
        summary[name] = {"ranks": LAYOUTS[name][0], "parallel": LAYOUTS[name][1],
                         "samples_per_s": round(sps, 2), "state_bytes_rank0": state,
                         "load_avg_1m": [round(r["load_avg_1m"], 1) for r in rows]}
        cost = f"{1000 * cpu[name]:.1f}" if name in cpu else "-"
        if name in cpu:
            summary[name]["cpu_s_per_sample"] = round(cpu[name], 5)
        table.append(f"| {name} | {LAYOUTS[name][0]} | {sps:,.1f} | {sps / base:.2f} | {cost} | "
                     f"{state / 2**20:.2f} MiB |")
    finish(args, {"model": MODEL, "global_batch": GLOBAL_BATCH, "repeats": args.repeats, "steps": args.steps,
                  "layouts": summary}, script=__file__, argv=argv,
           title="Throughput and rank-0 memory of every parallel layout, on CPU", table="\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
