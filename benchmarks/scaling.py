"""Data-parallel scaling on this machine: 2 DDP workers vs 1, one torch thread each,
without and with gradient accumulation, through the platform (`rtp train`'s Python API).

    python benchmarks/scaling.py            # ~3 min on 2 quiet CPU cores
    python benchmarks/scaling.py --smoke    # 3 steps of 2 workers with accumulation

The job is the quickstart (`pipelines/configs/quickstart.yaml`: byte-level gpt, 2 blocks,
d 128, context 64, micro-batch 16 per worker, text read by Ray Data, 0.5 CPU and 1 torch
thread per worker); only the worker count and ``train.grad_accum_steps`` change. The
per-worker batch stays the same (weak scaling), so 2 workers train twice the samples per
step. Scaling efficiency = samples/s at 2 workers / (2 x samples/s at 1 worker); each
figure is the median per-step samples/s after 5 warm-up steps, medians over interleaved
repeats. With accumulation (4 micro-steps per optimizer step, gradients all-reduced once)
the all-reduce is paid once per 4 micro-batches.

The machine has 2 cores: 2 workers take both, and Ray Data's read tasks and Ray's own
processes share them; efficiency here is a floor, not what 2 real devices would give.
To tell the machine's ceiling from the platform's cost, the same job also runs on the
Ray-free core under torchrun (1 and 2 processes, the core's own in-process reader):
its 2-vs-1 efficiency is what this machine gives with no Ray at all.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from common import (ROOT, harness_parser, interleaved, local_ray, out_path, result_meta, stamp,
                    steady, torchrun_core, write_result)

QUICKSTART = ROOT / "pipelines/configs/quickstart.yaml"
WARMUP = 5
LAYOUTS = {"1w": (1, 1), "2w": (2, 1), "1w_accum4": (1, 4), "2w_accum4": (2, 4)}
CORE_LAYOUTS = {"core_1w": 1, "core_2w": 2}  # the Ray-free core under torchrun, no accumulation


def run_layout(storage: Path, name: str, workers: int, accum: int, steps: int) -> dict:
    from raytrain_platform.launch.trainer import train

    result = train(QUICKSTART, _overrides(storage, name, workers, accum, steps), progress=False)
    return steady(result.metrics, WARMUP)


def _overrides(storage: Path, name: str, workers: int, accum: int, steps: int) -> list[str]:
    return [f"run.storage_path={storage}", f"run.name={name}", f"scaling.num_workers={workers}",
            f"train.grad_accum_steps={accum}", f"train.max_steps={steps}", "run.eval_every=0",
            "run.checkpoint_every=0", "run.log_every=1"]


def run_core(storage: Path, name: str, workers: int, steps: int) -> dict:
    """The same job on the Ray-free core: `torchrun --nproc-per-node N -m raytrain_platform.core`."""
    from raytrain_platform.core.rundir import read_metrics

    torchrun_core(workers, QUICKSTART, _overrides(storage, name, workers, 1, steps), label=name, timeout=600)
    return steady(read_metrics(storage / name), WARMUP)


def measure(work: Path, *, smoke: bool, repeats: int | None = None, steps: int | None = None) -> dict:
    repeats = repeats or (1 if smoke else 2)  # each run spends ~15 s starting Ray Train
    steps = steps or (3 if smoke else 30)
    local_ray()
    # Smoke: one run, the layout with the most moving parts (each Ray Train run costs ~15 s here).
    layouts = LAYOUTS if not smoke else {"2w_accum4": LAYOUTS["2w_accum4"]}
    sides = {name: (lambda i, name=name, wa=wa: run_layout(
        work / "scaling", f"{name}_{i}", *wa, steps)) for name, wa in layouts.items()}
    core = CORE_LAYOUTS if not smoke else {"core_2w": 2}
    sides.update({name: (lambda i, name=name, n=n: run_core(work / "scaling", f"{name}_{i}", n, steps))
                  for name, n in core.items()})
    runs = interleaved(sides, repeats, label="scaling ")
    sps = {name: statistics.median(r["samples_per_s"] for r in rs) for name, rs in runs.items()}
    entry = {**stamp(), "repeats": repeats, "steps": steps, "warmup_steps": WARMUP,
             "model": "quickstart gpt (2 blocks, d 128, context 64), micro-batch 16 per worker, "
                      "0.5 CPU and 1 torch thread per worker",
             "samples_per_s": {k: round(v, 1) for k, v in sps.items()},
             "data_wait_frac": {k: round(statistics.median(r["data_wait_frac"] for r in rs), 4)
                                for k, rs in runs.items()}}
    for one, two, key in (("1w", "2w", "efficiency"), ("1w_accum4", "2w_accum4", "efficiency_accum4"),
                          ("core_1w", "core_2w", "efficiency_core")):
        if one in sps and two in sps:
            entry[key] = round(sps[two] / (2 * sps[one]), 3)
    return {"scaling": entry}


def table_rows(results: dict) -> list[str]:
    e = results.get("scaling")
    if not e:
        return []
    s, rows = e["samples_per_s"], []
    for one, two, key, what in (("1w", "2w", "efficiency", ""),
                                ("1w_accum4", "2w_accum4", "efficiency_accum4", ", 4 micro-steps per step"),
                                ("core_1w", "core_2w", "efficiency_core",
                                 ", Ray-free core under torchrun: this machine's ceiling")):
        if key in e:
            goal = "" if key == "efficiency_core" else ">= 0.85"
            rows.append(f"| 2 DDP workers vs 1 (quickstart gpt{what}), samples/s: scaling efficiency "
                        f"| {s[two]:,.0f} | 2 x {s[one]:,.0f} | {e[key]:.2f} | {goal} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = harness_parser(__doc__)  # a section of run.py, which renders the table and the results page
    p.add_argument("--steps", type=int)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rtp-scaling-") as tmp:
        result = measure(Path(tmp), smoke=args.smoke, repeats=args.repeats, steps=args.steps)
    print(json.dumps(result, indent=2))
    write_result({"_meta": result_meta(__file__, argv), **result}, out_path(args))
    print("\n".join(table_rows(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
