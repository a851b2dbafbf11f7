"""Does tokenized data keep up with training? The data-wait fraction of a 2-worker DDP
run on chat JSONL, tokenized and packed by Ray Data's CPU tasks, with the tiny Llama,
over 3 epochs (each epoch restarts the Ray Data pipeline). By default the read tasks map
the windows the driver's count pass tokenized and kept (``data.window_cache``); with
``--no-window-cache`` they tokenize the file again every epoch, beside the workers.

    python benchmarks/hf_data.py            # ~1 min on 2 CPU cores; writes benchmarks/hf_data.json
    python benchmarks/hf_data.py --records 5500 --epochs 2 --out /tmp/d.json  # more records
    python benchmarks/hf_data.py --records 5500 --repeat 5 --epochs 2 --out /tmp/d.json  # 5x the file
    python benchmarks/hf_data.py --records 5500 --repeat 5 --epochs 1 --eval-every 10 --out /tmp/e.json  # evaluations
    python benchmarks/hf_data.py --no-window-cache --out /tmp/t.json  # tokenizing in the read tasks
    python benchmarks/hf_data.py --smoke    # 2 epochs of 200 records (nothing written unless --out)

The job: `tools/tiny_llm.py`'s model folder (Llama, 2 layers, d 64, 512-token BPE with a
ChatML template) built from its config by a user builder (`hf_data:tiny_llama`: random
weights; the weights do not change what the data costs), 2 DDP workers at 0.5 CPU with
1 torch thread, micro-batch 8 per worker, ``data.seq_len`` 128, chat JSONL of 2000
stdlib-docstring Q/A pairs in one file (``data.format: chat``: the chat template renders
each conversation and only the assistant turns count in the loss). Each step's
``data_wait_frac`` (seconds it waited in ``next(batch)`` / step time) is logged by the
engine every step; after 5 warm-up steps the figures are its median (goal: under 5%),
its maximum, the whole run's share (all waits / all step time) and the wait of each
later epoch's first step. Also recorded: the driver's count of the windows before Ray
starts (it tokenizes every file once), the step time and tokens/s, and each evaluating
step's wall time beyond a median step (from when each line of metrics.jsonl appears;
the first evaluation also reads the validation batches).

Measured here (2 CPU cores; benchmarks/results/hf-data-2026-12-05.md): each later epoch's first
step waited 1.4 s at 2000 and 5500 records and 4.9 s with 5x the 5500, while one task
tokenized the whole file before Ray's strict repartition into micro-batches could pass
any of it on; about 0.1 s at each since a single task streams micro-batch blocks itself
(data/ray_data.py). Before the tokenized source's generator could run 64 blocks ahead
(Ray Data's default is 2), the same job waited a median 82% of each step. With 5x the
5500 records and an evaluation every 100 steps, the first evaluation took 18.35 s beyond
a step while a validation read task waited for the train task's CPU; 0.16 s since the
driver tokenizes the validation batches evaluation reads (data/ray_data.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, stamp, write_result

WARMUP = 5
EPOCHS = 3  # each later epoch's first step waits for the pipeline to restart
GOAL = 0.05
BENCH = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT)]), "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}


def tiny_llama(model_dir: str):
    """The tiny_llm model folder's architecture, randomly initialised (a user builder)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))


def job_config(work: Path, tiny: dict, *, epochs: int, batch: int, seq_len: int, eval_every: int = 0,
               window_cache: bool = True, val_fraction: float = 0.02) -> dict:
    return {
        "model": {"name": "hf_data:tiny_llama", "task": "lm", "kwargs": {"model_dir": str(tiny["model"])}},
        "data": {"source": "jsonl", "path": str(tiny["chat"]), "format": "chat",
                 "tokenizer": str(tiny["tokenizer"]), "batch_size": batch, "seq_len": seq_len,
                 "val_fraction": val_fraction, "window_cache": window_cache},
        "train": {"epochs": epochs, "lr": 1e-3, "warmup_steps": 2},
        "parallel": {"strategy": "ddp"},
        "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "torch_threads": 1},
        "run": {"name": "chat_ddp", "storage_path": str(work / "runs"), "log_every": 1,
                "eval_every": eval_every, "checkpoint_every": 0},
    }


def _ray() -> None:
    """A local Ray whose workers import this file (the user builder) and never reach a hub."""
    import ray

    from raytrain_platform.launch.trainer import DRIVER_ENV, JOB_ENV

    for k, v in {**DRIVER_ENV, **ENV}.items():
        os.environ.setdefault(k, v)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", runtime_env={"env_vars": {**JOB_ENV, **ENV}})


class LineTimes:
    """When each line of a run's metrics.jsonl appears (polled every 10 ms): the wall
    time of a step that also evaluated, measured the same way on any version of the
    engine."""

    def __init__(self, path: Path):
        import threading

        self.path, self.times = path, []  # (seconds since start, metrics row)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        t0, offset, partial = time.perf_counter(), 0, b""
        while not self._stop.wait(0.01):
            try:
                with self.path.open("rb") as f:
                    f.seek(offset)
                    new = f.read()
            except OSError:
                continue
            offset += len(new)
            *lines, partial = (partial + new).split(b"\n")  # the last may be half written
            now = time.perf_counter() - t0
            self.times += [(now, json.loads(line)) for line in lines if line.strip()]

    def stop(self) -> list[tuple[float, dict]]:
        self._stop.set()
        self._thread.join()
        return self.times


def eval_figures(times: list[tuple[float, dict]]) -> dict:
    """Each evaluating step's wall time beyond the median step's, but the last step's
    (which also saves a checkpoint): the first evaluation also reads the validation
    batches."""
    gaps = [(b[0] - a[0], b[1]) for a, b in zip(times, times[1:-1])]
    plain = [g for g, row in gaps if "val_loss" not in row]
    if not plain:
        return {"eval_extra_s": [], "first_eval_extra_s": None}
    evals = [(row["step"], round(g - statistics.median(plain), 3)) for g, row in gaps if "val_loss" in row]
    return {"eval_extra_s": evals, "first_eval_extra_s": evals[0][1] if evals else None}


def measure(work: Path, *, smoke: bool, records: int = 2000, epochs: int = EPOCHS, repeat: int = 1,
            eval_every: int = 0, window_cache: bool = True) -> dict:
    from raytrain_platform.launch.trainer import prepare, run_job
    from raytrain_platform.tools.tiny_llm import make_all

    samples, epochs, batch, seq_len = (200, 2, 4, 64) if smoke else (records, epochs, 8, 128)
    t0 = time.perf_counter()
    tiny = make_all(work / "tiny", samples=samples)
    print(f"tiny model, tokenizer and {samples} chat records: {time.perf_counter() - t0:.1f}s", flush=True)
    if repeat > 1:  # a larger file: the same records `repeat` times over
        tiny["chat"].write_text(tiny["chat"].read_text() * repeat)
    # The smoke's 200 records: 2% holds out too few windows for one round of 2 x 4.
    cfg = job_config(work, tiny, epochs=epochs, batch=batch, seq_len=seq_len, eval_every=eval_every,
                     window_cache=window_cache, val_fraction=0.05 if smoke else 0.02)
    t0 = time.perf_counter()
    job = prepare(cfg)  # tokenizes every file once on the driver to count the windows
    count_s = time.perf_counter() - t0
    _ray()
    lines = LineTimes(Path(job.config.run.run_dir) / "metrics.jsonl")
    t0 = time.perf_counter()
    result = run_job(job, emit=lambda line: None, tail=False)
    wall_s = time.perf_counter() - t0
    evals = eval_figures(lines.stop())
    rows = result.metrics
    written = sum(1 for line in Path(tiny["chat"]).read_text().splitlines() if line.strip())
    steady = rows[WARMUP:] if len(rows) > WARMUP else rows[-1:]
    med = {k: statistics.median(r[k] for r in steady) for k in ("data_wait_frac", "step_time_s", "tokens_per_s")}
    # log_every 1: each row is one step, so wait seconds = fraction x step time.
    wait = [r["data_wait_frac"] * r["step_time_s"] for r in steady]
    firsts = [r for prev, r in zip(rows, rows[1:]) if r["epoch"] != prev["epoch"]]
    return {
        **stamp(),
        "job": f"tiny Llama (2 layers, d 64, vocab 512), chat JSONL ({written} records), 2 DDP workers "
               f"x micro-batch {batch}, seq_len {seq_len}, 0.5 CPU + 1 torch thread each",
        "window_cache": window_cache, "epochs": epochs, "steps_per_epoch": job.steps_per_epoch, "steps": len(rows),
        "measured_steps": len(steady),
        "train_windows": job.data.num_train,
        "driver_count_s": round(count_s, 2), "run_wall_s": round(wall_s, 1),
        "data_wait_frac_median": round(med["data_wait_frac"], 4),
        "data_wait_frac_max": round(max(r["data_wait_frac"] for r in steady), 4),
        "data_wait_frac_overall": round(sum(wait) / sum(r["step_time_s"] for r in steady), 4),
        "wait_s_total": round(sum(wait), 3),
        "wait_s_in_10_worst_steps": round(sum(sorted(wait)[-10:]), 3),
        "steps_waiting_over_5ms": sum(w > 0.005 for w in wait),
        "epoch_first_step_wait_s": [round(r["data_wait_frac"] * r["step_time_s"], 3) for r in firsts],
        "step_time_s_median": round(med["step_time_s"], 4),
        "tokens_per_s_median": round(med["tokens_per_s"], 1),
        "eval_every": eval_every, **evals,
        "goal": f"data_wait_frac_median < {GOAL}", "meets_goal": med["data_wait_frac"] < GOAL,
    }


def table(r: dict) -> str:
    lines = [f"## Tokenized chat JSONL through Ray Data ({r['date']}, load {r['load_avg_1m']})", "",
             r["job"], "", "| figure | value |", "|---|---|"]
    for key in ("data_wait_frac_median", "data_wait_frac_overall", "data_wait_frac_max",
                "epoch_first_step_wait_s", "wait_s_total", "wait_s_in_10_worst_steps",
                "steps_waiting_over_5ms", "step_time_s_median", "tokens_per_s_median",
                "measured_steps", "train_windows", "window_cache", "driver_count_s", "run_wall_s", "eval_every",
                "first_eval_extra_s", "eval_extra_s", "meets_goal"):
        lines.append(f"| {key} | {r[key]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="2 epochs of 200 records (checks it runs)")
    p.add_argument("--records", type=int, default=2000, help="chat records in the one .jsonl file")
    p.add_argument("--epochs", type=int, default=EPOCHS, help="epochs (each restarts the pipeline)")
    p.add_argument("--repeat", type=int, default=1, help="write the records this many times over")
    p.add_argument("--eval-every", type=int, default=0,
                   help="evaluate every N steps (default 0: once, at the last step)")
    p.add_argument("--no-window-cache", action="store_true",
                   help="data.window_cache false: the read tasks tokenize every epoch, beside the workers, "
                        "instead of mapping the windows the driver's count keeps")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON result (default benchmarks/hf_data.json; with --smoke: none)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rtp-hf-data-") as tmp:
        # The token cache (counts, windows) beside the temporary data: the first count
        # tokenizes, and nothing is left in ~/.cache for files that are gone.
        os.environ["RTP_CACHE_DIR"] = os.path.join(tmp, "cache")
        result = measure(Path(tmp), smoke=args.smoke, records=args.records, epochs=args.epochs,
                         repeat=args.repeat, eval_every=args.eval_every, window_cache=not args.no_window_cache)
    print(table(result))
    out = args.out or (None if args.smoke else BENCH / "hf_data.json")
    write_result(result, out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH))
    sys.exit(main())
