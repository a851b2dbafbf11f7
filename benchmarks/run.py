"""Every comparison, side by side, in one command: the platform against what a user
would write without it, on this machine.

    python benchmarks/run.py                          # all sections, ~10 min on 2 quiet CPU cores
                                                      # (~15 min while other jobs load them)
    python benchmarks/run.py --sections ingest,startup --repeats 4
    python benchmarks/run.py --smoke [--out-dir DIR]  # the new sections at tiny sizes (tests)

Sections (each interleaves its sides' repeats and reports medians and ratios):

- ``train_vs_loop``: 1-worker platform training (Ray Train + Ray Data from Parquet) vs a
  hand-written loop over in-memory tensors, same MLP and thread count (with default and
  with fused AdamW); the same engine without Ray; the quickstart's data wait (functions
  of `train_vs_loop.py`).
- ``ingest``: Ray Data ingest as the platform uses it vs `torch.utils.data.DataLoader`
  over the same Parquet files, and ingest settings tried on top (`ingest.py`).
- ``scaling``: 2 DDP workers vs 1, one thread each, without and with accumulation (`scaling.py`).
- ``memory``: FSDP vs DDP, rank 0's bytes of parameters + gradients + optimizer state
  (`strategies.py`'s runner, 2 ranks under torchrun).
- ``serve``: Ray Serve with vs without dynamic batching at 32 clients (`serve_bench.py`).
- ``startup``: `rtp train` to the first optimizer step vs a bare TorchTrainer script (`startup.py`).

Results merge by key into ``benchmarks/results.json`` (a section not run keeps its last
figures, each with its date and load average) and the whole table is rendered again into
``benchmarks/results.md``. With ``--smoke`` nothing is written unless ``--out-dir`` is
given; ``--page`` also writes the table to ``benchmarks/results/alternatives-DATE.md``
with the date, command and machine. Not here: the GPU run (`gpu_train.py`, its JSON is
added to the table when saved as ``benchmarks/gpu_results.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ingest
import scaling
import startup
from common import (ROOT, add_page_arg, command_line, free_port, interleaved, local_ray, machine, machine_line,
                    stamp, tabular_data, write_page)

BENCH = ROOT / "benchmarks"


# ---------------------------------------------------------------- sections built on the older scripts


def train_vs_loop_section(work: Path, *, smoke: bool, repeats: int | None = None) -> dict:
    import torch
    import train_vs_loop as tvl

    torch.set_num_threads(1)  # the hand loop's; both platform sides set theirs from the config
    # Each platform run spends ~15 s starting Ray Train here, whatever its steps: 2 repeats.
    default_repeats, steps, quick_steps = (1, 8, 4) if smoke else (2, 60, 30)
    repeats = repeats or default_repeats
    models = tvl.MODELS[:1] if smoke else tvl.MODELS
    local_ray()
    data = tabular_data(work / "tabular", max(max(b for _, _, b in models) * (steps + 8), 20_000),
                        features=tvl.FEATURES, classes=tvl.CLASSES)
    out = {}
    for label, hidden, batch in models:
        args = (steps, hidden, batch)
        runs = interleaved({  # each side called right away, in this iteration
            "platform": lambda i, label=label, args=args: tvl.platform_run(data, work / "runs", f"{label}{i}", *args),
            "engine": lambda i, label=label, args=args: tvl.engine_run(data, work / "core", f"{label}{i}", *args),
            "loop": lambda i, args=args: tvl.hand_loop(data, *args),
            "loop_fused": lambda i, args=args: tvl.hand_loop(data, *args, fused=True)},
            repeats, label=f"{label} ")
        med = {side: statistics.median(r["samples_per_s"] for r in rs) for side, rs in runs.items()}
        out[f"train_vs_loop_{label}"] = {
            **stamp(), "model": f"mlp {tvl.FEATURES}-{'-'.join(map(str, hidden))}-{tvl.CLASSES}, batch "
                                f"{batch}, AdamW, 1 worker, 1 torch thread",
            "repeats": repeats, "steps": steps,
            "platform_samples_per_s": round(med["platform"], 1), "hand_loop_samples_per_s": round(med["loop"], 1),
            "ratio": round(med["platform"] / med["loop"], 3),
            "hand_loop_fused_samples_per_s": round(med["loop_fused"], 1),
            "ratio_vs_fused_loop": round(med["platform"] / med["loop_fused"], 3),
            "overhead_ms_per_step": round(1000 * batch * (1 / med["platform"] - 1 / med["loop"]), 2),
            "engine_without_ray_samples_per_s": round(med["engine"], 1),
            "engine_without_ray_ratio": round(med["engine"] / med["loop"], 3),
            "platform_data_wait_frac": round(statistics.median(r["data_wait_frac"] for r in runs["platform"]), 4)}
    quick = tvl.quickstart_wait(work / "runs", quick_steps)
    out["quickstart_data_wait"] = {**stamp(), **{k: round(v, 4) if isinstance(v, float) else v
                                                 for k, v in quick.items()}}
    return out


def train_vs_loop_rows(r: dict) -> list[str]:
    rows = []
    for label in ("small", "medium"):
        e = r.get(f"train_vs_loop_{label}")
        if not e:
            continue
        rows.append(f"| 1-worker training ({e['model']}), Ray Data from Parquet vs in-memory hand loop, "
                    f"samples/s | {e['platform_samples_per_s']:,.0f} | {e['hand_loop_samples_per_s']:,.0f} | "
                    f"{e['ratio']:.3f} ({e['overhead_ms_per_step']:+.1f} ms/step) | >= 0.95 |")
        if "ratio_vs_fused_loop" in e:
            rows.append(f"| the same vs a hand loop with the platform's fused AdamW (the platform's own "
                        f"overhead) | {e['platform_samples_per_s']:,.0f} | "
                        f"{e['hand_loop_fused_samples_per_s']:,.0f} | {e['ratio_vs_fused_loop']:.3f} | |")
        rows.append(f"| the same engine without Ray (torchrun core reading the Parquet files) vs the hand "
                    f"loop | {e['engine_without_ray_samples_per_s']:,.0f} | {e['hand_loop_samples_per_s']:,.0f} | "
                    f"{e['engine_without_ray_ratio']:.3f} | |")
    q = r.get("quickstart_data_wait")
    if q:
        rows.append(f"| quickstart data wait, median / p90 of step time | {100 * q['median_data_wait_frac']:.1f}% "
                    f"/ {100 * q['p90_data_wait_frac']:.1f}% | | | |")
    return rows


def memory_section(work: Path, *, smoke: bool, repeats: int | None = None) -> dict:
    """Exact byte counts: one run per layout, whatever `repeats` says."""
    import strategies

    work.mkdir(parents=True, exist_ok=True)
    got = {name: strategies.run_layout(work, name.replace(" ", "_"), *strategies.LAYOUTS[name], 2 if smoke else 3)
           for name in ("ddp x2", "fsdp x2")}
    ddp, fsdp = got["ddp x2"]["state_bytes"], got["fsdp x2"]["state_bytes"]
    return {"fsdp_vs_ddp_memory": {**stamp(), "model": strategies.MODEL, "ranks": 2,
                                   "ddp_state_bytes_rank0": ddp, "fsdp_state_bytes_rank0": fsdp,
                                   "ratio": round(fsdp / ddp, 3)}}


def memory_rows(r: dict) -> list[str]:
    e = r.get("fsdp_vs_ddp_memory")
    if not e:
        return []
    return [f"| FSDP vs DDP at 2 ranks, rank 0's parameters + gradients + AdamW state (gpt 4 x d 128) | "
            f"{e['fsdp_state_bytes_rank0'] / 2**20:.2f} MiB | {e['ddp_state_bytes_rank0'] / 2**20:.2f} MiB | "
            f"{e['ratio']:.2f} | 0.5 |"]


def serve_section(work: Path, *, smoke: bool, repeats: int | None = None) -> dict:
    import serve_bench

    levels = {"mlp-small": [(4, 16)]} if smoke else serve_bench.QUICK_LEVELS
    repeats = repeats or (1 if smoke else 2)
    rows = serve_bench.run(levels, free_port(), repeats=repeats)
    out = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        on = next(r for r in rows if r["model"] == name and r["batching"])
        off = next(r for r in rows if r["model"] == name and not r["batching"])
        out[name] = {"clients": on["clients"], "req_per_s_batched": round(on["req_per_s"], 1),
                     "req_per_s_unbatched": round(off["req_per_s"], 1),
                     "ratio": round(on["req_per_s"] / off["req_per_s"], 3),
                     "p50_ms_batched": round(on["p50_ms"], 1), "p50_ms_unbatched": round(off["p50_ms"], 1),
                     "p99_ms_batched": round(on["p99_ms"], 1), "p99_ms_unbatched": round(off["p99_ms"], 1),
                     "errors": on["errors"] + off["errors"]}
    return {"serve_batching": {**stamp(), "repeats": repeats, "models": out}}


def serve_rows(r: dict) -> list[str]:
    e = r.get("serve_batching")
    if not e:
        return []
    return [f"| Ray Serve `{name}` with vs without batching, {m['clients']} clients, requests/s (p50 "
            f"{m['p50_ms_batched']:.0f} vs {m['p50_ms_unbatched']:.0f} ms) | {m['req_per_s_batched']:,.0f} | "
            f"{m['req_per_s_unbatched']:,.0f} | {m['ratio']:.2f} | |" for name, m in e["models"].items()]


def gpu_rows(r: dict) -> list[str]:
    path = BENCH / "gpu_results.json"
    if not path.exists():
        return []
    g = json.loads(path.read_text())
    return [f"| GPU ({g['device']}, {g['date'][:10]}): gpt {x['preset']}{' compiled' if x['compile'] else ''}, "
            f"bf16 FSDP2, tokens/s (MFU vs measured peak {g['peak']['peak_tflops']:.0f} TFLOP/s) | "
            f"{x['tokens_per_s']:,.0f} | | {100 * x['mfu']:.1f}% MFU | |"
            for x in g.get("runs", []) if "tokens_per_s" in x]


# ---------------------------------------------------------------- the command


SECTIONS = {  # name -> (measure(work, smoke=...), needs the in-process Ray)
    "train_vs_loop": (train_vs_loop_section, True),
    "ingest": (ingest.measure, True),
    "scaling": (scaling.measure, True),
    "memory": (memory_section, False),
    "serve": (serve_section, False),
    "startup": (startup.measure, False),
}
# The older sections have their own --smoke tests. In smoke mode every section shares
# this process's Ray (startup's two sides join it too): each Ray start costs ~5 s here.
SMOKE_SECTIONS = ("ingest", "scaling", "startup")
ROW_MAKERS = (train_vs_loop_rows, ingest.table_rows, scaling.table_rows, memory_rows, serve_rows,
              startup.table_rows, gpu_rows)


def render(results: dict) -> str:
    meta = results.get("_meta", {})
    lines = [f"Rendered by `python benchmarks/run.py` from `benchmarks/results.json` ({meta.get('machine', '')}); "
             "each row's date and the machine's load average while it was measured are there.", "",
             "| comparison | platform | baseline | ratio | goal |", "|---|---|---|---|---|"]
    for make in ROW_MAKERS:
        lines += make(results)
    for extra in (ingest.detail(results),):
        if extra:
            lines += ["", extra]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", help=f"comma-separated, of {list(SECTIONS)} (default: all; "
                                      f"with --smoke: {','.join(SMOKE_SECTIONS)})")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat; writes only to --out-dir")
    p.add_argument("--out-dir", type=Path, help="where results.json / results.md go (default benchmarks/)")
    p.add_argument("--repeats", type=int, help="interleaved repeats of every side (default: each section's own, 2-3)")
    add_page_arg(p, "alternatives")
    args = p.parse_args(argv)
    names = (args.sections.split(",") if args.sections else
             list(SMOKE_SECTIONS if args.smoke else SECTIONS))
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; known: {list(SECTIONS)}")
    out_dir = args.out_dir or (None if args.smoke else BENCH)
    results: dict = {}
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rtp-bench-") as tmp:
        for name in names:
            measure, in_process_ray = SECTIONS[name]
            if not in_process_ray and not args.smoke:  # its own Ray (or none): free our CPUs first
                import ray

                ray.shutdown()
            t0 = time.perf_counter()
            print(f"== {name}", flush=True)
            results.update(measure(Path(tmp) / name, smoke=args.smoke, repeats=args.repeats))
            timings[name] = round(time.perf_counter() - t0, 1)
            print(f"== {name}: {timings[name]:.0f}s", flush=True)
    import ray

    ray.shutdown()
    merged = {}
    if out_dir and (out_dir / "results.json").exists():
        merged = json.loads((out_dir / "results.json").read_text())
    merged.update(results)
    command, m = command_line(__file__, argv), machine()
    merged["_meta"] = {"command": command, "date": time.strftime("%Y-%m-%d"), "machine": machine_line(m),
                       **{k: v for k, v in m.items() if k in ("torch", "ray", "transformers")},
                       "section_seconds": {**merged.get("_meta", {}).get("section_seconds", {}), **timings}}
    text = render(merged)
    print(text)
    print(f"sections took {timings} ({time.perf_counter() - t_all:.0f}s in all)")
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
        (out_dir / "results.md").write_text(text)
        print(f"wrote {out_dir / 'results.json'} and {out_dir / 'results.md'}")
    if args.page and args.smoke:
        print("--page: not written for a --smoke run (tiny sizes measure nothing)")
    elif args.page:
        write_page("alternatives", "The platform against what a user would write without it", text,
                   command=command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
