"""The same fine-tune through the platform and written with Hugging Face Accelerate
(`accelerate launch`), at 1 and 2 processes: tokens/s, medians of interleaved repeats.

    pip install -e '.[bench]'                            # accelerate
    python benchmarks/vs_accelerate.py                   # ~15 min on 2 quiet CPU cores
    python benchmarks/vs_accelerate.py --smoke           # tiny, 2 processes, 1 repeat, writes nothing (a test)
    python benchmarks/vs_accelerate.py --vocab 4096 --samples 5556   # the LM head 31% of the weight matmuls
    python benchmarks/vs_accelerate.py --compile         # every side also compiled (~20 min)

The job: a Llama-style model from `raytrain_platform.tools.tiny_llm` (4 layers, d 256,
4 heads / 2 KV heads, MLP 512, its 512-token BPE; ~2.6M parameters, written as
safetensors and loaded from them by every side), chat JSONL of 2000 stdlib docstring
Q/A pairs, packed into windows of 256 + 1 tokens, loss on the assistant turns,
micro-batch 8 per process, AdamW (lr 1e-3 constant, betas 0.9/0.95, weight decay 0.1
on matrices), grad clip 1.0, fp32, one torch thread per process, 40 steps.

Sides, each at 1 and 2 processes (2: DDP on gloo, 127.0.0.1 only):

- ``ray``: the platform, ``rtp train CONFIG`` (its own process and embedded Ray): Ray
  Train workers, Ray Data reading and tokenizing the JSONL (0.5 CPU per worker, as
  pipelines/configs/finetune.yaml), ``parallel.strategy`` ``none`` / ``ddp``.
- ``torchrun``: the same config on the Ray-free core, ``torchrun -m raytrain_platform.core``
  (its in-process reader): the platform without Ray, so Ray's share is visible.
- ``accelerate``: `_accelerate_finetune.py`, a plain Accelerate script (``accelerator.prepare``
  of model, optimizer and DataLoader; DDP at 2 processes) launched by ``accelerate
  launch``, everything on the command line (no config file, offline). Its windows come
  from the platform's packer before the timed loop; it uses PyTorch's default AdamW, as
  a user writes it (the platform uses the fused kernel). On a CPU, 2 processes need
  ``accelerate launch --multi_gpu`` (torchrun underneath) and ``Accelerator(cpu=True)``:
  ``--cpu --num_processes 2`` starts one process (no ``--mpirun_hostfile``). The script
  records its process count and backend, and a run that is not what was asked fails.

With ``--compile`` every side runs a second time compiled, in the same interleaved
repeats: the platform with ``parallel.compile`` (each decoder layer compiled in place,
before DDP wraps the model), Accelerate with ``--dynamo_backend inductor`` (its
``torch.compile`` of the whole prepared model; the script records that its model was
compiled). Compiled sides are compared with compiled Accelerate (``ratio_*_compiled``),
and each side with itself eager (``compile_speedup_*``); results go to
``benchmarks/vs_accelerate.compile.json``.

Each side's figure is tokens per step (micro-batch x 256 x processes) over the median
step time of the steps after the first 3 (the platform's ``tokens_per_s`` from its
metrics.jsonl: the same quantity, a batch's wait included); ratios are platform /
Accelerate. Repeats are interleaved, the order turned by one side each repeat, with a
5 s pause before each side (the machine is shared: every side sees the same drift, and
none always follows a Ray run's teardown). Every side deals micro-batch ``j`` to rank
``j % processes`` from the same weights, so the global batches, and the losses, are the
same at every step (``loss_max_abs_diff``: the platform's minus Accelerate's, 1st repeat).
``wall_s`` is each side's whole run as a user waits for it (start-up, loading, steps,
shutdown): Ray's start-up is there, not in tokens/s. Results go to
``benchmarks/vs_accelerate.json`` with the date and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (ROOT, add_page_arg, command_line, free_port, machine, rotated, stamp,  # noqa: E402
                    torchrun_core, write_page)

BENCH = ROOT / "benchmarks"
ACCELERATE_SCRIPT = BENCH / "_accelerate_finetune.py"
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.1
# tiny_llm model shape and data, the job, interleaved repeats, process counts, and a pause
# before each side (a Ray run's workers take a few seconds to exit)
SIZES = {
    # warmup: steps left out of the medians (a Ray run's first step waits for Ray Data's
    # tokenizing task; allocator, DDP buckets). Start-up is reported apart, as each side's
    # wall time (`wall_s`). 40 steps and 3 repeats: this VM's speed drifts by up to 2x
    # over seconds (a 1-thread matmul loop, nothing else running), so short runs and few
    # repeats measure the drift.
    "full": {"hidden": 256, "layers": 4, "vocab": 512, "samples": 2000, "seq_len": 256, "batch": 8, "steps": 40,
             "warmup": 3,
             "repeats": 3,
             "processes": [1, 2], "settle_s": 5.0},
    # Smoke: 2 processes only (DDP, gloo, accelerate's torchrun path): each Ray Train run
    # costs ~15 s of start-up here whatever its steps.
    "smoke": {"hidden": 64, "layers": 2, "vocab": 512, "samples": 300, "seq_len": 32, "batch": 4, "steps": 6,
              "warmup": 3,
              "repeats": 1,
              "processes": [2], "settle_s": 0.0},
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def make_llm(folder: Path, size: dict) -> Path:
    """tiny_llm's model (safetensors + tokenizer) and chat data under `folder` (kept if there)."""
    from raytrain_platform.tools.tiny_llm import make_all

    config, chat = folder / "model" / "config.json", folder / "data" / "chat.jsonl"
    if config.exists() and chat.exists():  # --llm-dir reused: the sizes asked for, or say so
        vocab = json.loads(config.read_text())["vocab_size"]
        with chat.open() as f:
            records = sum(1 for _ in f)
        if vocab != size["vocab"] or records != size["samples"]:
            raise SystemExit(f"--llm-dir {folder}: its model has vocabulary {vocab} and {records} chat records; "
                             f"this run asks for {size['vocab']} and {size['samples']} (another folder, or "
                             "--vocab/--samples to match)")
    else:
        make_all(folder, samples=size["samples"], vocab_size=size["vocab"], num_layers=size["layers"],
                 hidden_size=size["hidden"], num_heads=4, num_kv_heads=2, intermediate_size=2 * size["hidden"])
    return folder


def platform_config(llm: Path, processes: int, size: dict, storage: Path, name: str, *,
                    compiled: bool = False) -> dict:
    return {
        "model": {"name": "hf", "kwargs": {"path": str(llm / "model"), "init": "pretrained"}},
        "data": {"source": "jsonl", "path": str(llm / "data" / "chat.jsonl"), "format": "chat",
                 "seq_len": size["seq_len"], "batch_size": size["batch"], "val_fraction": 0.0,
                 "prefetch_batches": 4},
        "train": {"max_steps": size["steps"], "lr": LR, "lr_schedule": "constant", "warmup_steps": 0,
                  "betas": list(BETAS), "weight_decay": WEIGHT_DECAY, "grad_clip": 1.0, "seed": 0},
        "parallel": {"strategy": "ddp" if processes > 1 else "none", "compile": compiled},
        # 0.5 CPU: leaves Ray's logical CPUs for Ray Data's tokenizing task (finetune.yaml).
        "scaling": {"num_workers": processes, "cpus_per_worker": 0.5, "torch_threads": 1},
        "run": {"name": name, "storage_path": str(storage), "checkpoint_every": 0, "eval_every": 0,
                "log_every": 1},
    }


def _platform_figures(rows: list[dict], processes: int, size: dict) -> dict:
    if len(rows) != size["steps"]:
        raise RuntimeError(f"expected {size['steps']} metrics rows, got {len(rows)}")
    timed = rows[size["warmup"]:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "step_s": statistics.median(r["step_time_s"] for r in timed),
            "data_wait_frac": statistics.median(r["data_wait_frac"] for r in timed),
            "tokens_per_step": size["batch"] * size["seq_len"] * processes,
            "losses": [r["loss"] for r in rows]}


def _write_config(llm: Path, processes: int, size: dict, storage: Path, name: str, compiled: bool = False) -> Path:
    import yaml

    path = storage / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(platform_config(llm, processes, size, storage, name, compiled=compiled)))
    return path


def ray_run(llm: Path, processes: int, size: dict, storage: Path, name: str, compiled: bool = False) -> dict:
    """``rtp train CONFIG`` as a user runs it: an embedded Ray, Ray Train workers, Ray Data
    tokenizing the JSONL. In its own process: on a shared machine another job's
    ``ray stop`` ends that run (retried once), not the whole benchmark."""
    from raytrain_platform.core.rundir import read_metrics

    path = _write_config(llm, processes, size, storage, name, compiled)
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "train", str(path)], cwd=ROOT,
                          env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=900,
                          check=False)
    if proc.returncode:
        raise RuntimeError(f"{name}: rtp train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return _platform_figures(read_metrics(storage / name), processes, size)


def torchrun_run(llm: Path, processes: int, size: dict, storage: Path, name: str, compiled: bool = False) -> dict:
    """The same config on the Ray-free core under torchrun (its in-process reader)."""
    from raytrain_platform.core.rundir import read_metrics

    torchrun_core(processes, _write_config(llm, processes, size, storage, name, compiled), label=name, timeout=900)
    return _platform_figures(read_metrics(storage / name), processes, size)


def accelerate_command(processes: int, port: int, script_args: list[str], compiled: bool = False) -> list[str]:
    """``accelerate launch`` with every choice on the command line. One process: ``--cpu``
    (a plain process). Two: ``--multi_gpu``, which is torchrun underneath; the script's
    ``Accelerator(cpu=True)`` then makes a gloo group (``--cpu`` with 2 processes would
    start one process, see `_accelerate_finetune.py`). `compiled`: ``--dynamo_backend
    inductor``, Accelerate's own ``torch.compile`` of the whole prepared model."""
    exe = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    if exe is None:
        raise RuntimeError("accelerate is not installed: pip install -e '.[bench]'")
    mode = ["--cpu"] if processes == 1 else ["--multi_gpu"]
    return [exe, "launch", *mode, "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "inductor" if compiled else "no",
            "--num_cpu_threads_per_process", "1",
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            str(ACCELERATE_SCRIPT), *script_args]


def accelerate_run(llm: Path, processes: int, size: dict, work: Path, name: str, compiled: bool = False) -> dict:
    out = work / f"{name}.json"
    script_args = ["--model", str(llm / "model"), "--data", str(llm / "data" / "chat.jsonl"),
                   "--seq-len", str(size["seq_len"]), "--batch-size", str(size["batch"]),
                   "--steps", str(size["steps"]), "--lr", str(LR), "--betas", *map(str, BETAS),
                   "--weight-decay", str(WEIGHT_DECAY), "--threads", "1", "--out", str(out)]
    # No config file (a missing path: the launcher's defaults), no hub cache of the user's.
    env = {**os.environ, **OFFLINE_ENV, "HF_HOME": str(work / "hf_home"),
           "ACCELERATE_CONFIG_FILE": str(work / "no_accelerate_config.yaml")}
    proc = subprocess.run(accelerate_command(processes, free_port(), script_args, compiled), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode:
        raise RuntimeError(f"{name}: accelerate launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    got = json.loads(out.read_text())
    if got["processes"] != processes or (processes > 1 and got["backend"] != "gloo"):
        raise RuntimeError(f"{name}: asked for {processes} processes on gloo, the script ran "
                           f"{got['processes']} ({got['distributed_type']}, backend {got['backend']})")
    if got["compiled"] != compiled:
        raise RuntimeError(f"{name}: asked for compiled={compiled}, the script's model was compiled={got['compiled']}")
    step_s = statistics.median(got["step_s"][size["warmup"]:])
    return {"tokens_per_s": got["tokens_per_step"] / step_s, "step_s": step_s,
            "tokens_per_step": got["tokens_per_step"], "losses": got["losses"],
            "backend": got["backend"], "torch_threads": got["torch_threads"]}


SIDES = ("ray", "torchrun", "accelerate")
# --compile: each side again with torch.compile (the platform's parallel.compile: each
# decoder layer; Accelerate's --dynamo_backend inductor: the whole model), same run.
COMPILED = tuple(f"{side}_compiled" for side in SIDES)


def _max_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise RuntimeError(f"loss lists of different lengths: {len(a)} vs {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))


def _accelerate_of(side: str) -> str:
    """The Accelerate side a platform side is compared with: eager with eager, compiled with compiled."""
    return "accelerate_compiled" if side.endswith("_compiled") else "accelerate"


def summarize(runs: dict[str, list[dict]], processes: list[int], size: dict) -> dict:
    by_n = {}
    for n in processes:
        got = {side: runs[f"{side}_{n}p"] for side in SIDES + COMPILED if f"{side}_{n}p" in runs}
        platform = [side for side in got if not side.startswith("accelerate")]
        tps = {side: statistics.median(r["tokens_per_s"] for r in rs) for side, rs in got.items()}
        acc_losses = got["accelerate"][0]["losses"]
        by_n[str(n)] = {
            "tokens_per_step": size["batch"] * size["seq_len"] * n,
            **{f"{side}_tokens_per_s": round(v, 1) for side, v in tps.items()},
            **{f"{side}_step_s": round(statistics.median(r["step_s"] for r in rs), 4) for side, rs in got.items()},
            **{f"{side}_tokens_per_s_repeats": [round(r["tokens_per_s"], 1) for r in rs] for side, rs in got.items()},
            **{f"{side}_wall_s": round(statistics.median(r["wall_s"] for r in rs), 1) for side, rs in got.items()},
            **{f"{side}_data_wait_frac": round(statistics.median(r["data_wait_frac"] for r in got[side]), 4)
               for side in platform},
            # platform / Accelerate, eager against eager and compiled against compiled
            **{f"ratio_{side}": round(tps[side] / tps[_accelerate_of(side)], 3) for side in platform},
            **({"ratio_ray_compiled_vs_accelerate_eager": round(tps["ray_compiled"] / tps["accelerate"], 3),
                **{f"compile_speedup_{side}": round(tps[f"{side}_compiled"] / tps[side], 3) for side in SIDES}}
               if "ray_compiled" in got else {}),
            # First repeat: the platform's loss per step minus Accelerate's (same weights, windows, order).
            "loss_first": round(acc_losses[0], 4), "loss_last": round(acc_losses[-1], 4),
            "losses_accelerate": [round(x, 4) for x in acc_losses],
            **{f"loss_max_abs_diff_{side}": round(_max_diff(got[side][0]["losses"], acc_losses), 5)
               for side in got if side != "accelerate"},
        }
    return by_n


def measure(work: Path, *, smoke: bool, repeats: int | None = None, processes: list[int] | None = None,
            llm_dir: Path | None = None, on_repeat: Callable[[dict], None] = lambda result: None,
            vocab: int = 512, samples: int | None = None, compiled: bool = False) -> dict:
    """Every side at every process count, `repeats` times; `on_repeat(result so far)`
    after each repeat (a long run on a shared machine keeps what it measured). `vocab`:
    the tokenizer's vocabulary (the model's embeddings and head follow it). `compiled`:
    every side also with torch.compile."""
    size = {**SIZES["smoke" if smoke else "full"], "vocab": vocab}
    size["samples"] = samples or size["samples"]
    repeats = repeats or size["repeats"]
    processes = processes or size["processes"]
    os.environ.update(OFFLINE_ENV)
    llm = make_llm(llm_dir or work / "tiny-llm", size)
    sides = {}
    for n in processes:
        for c in (False, True) if compiled else (False,):
            sfx = "_compiled" if c else ""
            sides[f"ray{sfx}_{n}p"] = lambda tag, n=n, c=c, sfx=sfx: ray_run(
                llm, n, size, work / "runs", f"ray{sfx}_{n}p_{tag}", c)
            sides[f"torchrun{sfx}_{n}p"] = lambda tag, n=n, c=c, sfx=sfx: torchrun_run(
                llm, n, size, work / "runs", f"core{sfx}_{n}p_{tag}", c)
            sides[f"accelerate{sfx}_{n}p"] = lambda tag, n=n, c=c, sfx=sfx: accelerate_run(
                llm, n, size, work / "accelerate", f"acc{sfx}_{n}p_{tag}", c)
    model_vocab = json.loads((llm / "model" / "config.json").read_text())["vocab_size"]
    runs = rotated(sides, repeats, size["settle_s"],
                   lambda runs, done: on_repeat(_result(runs, processes, size, done, repeats, model_vocab)),
                   label="vs_accelerate")
    return _result(runs, processes, size, repeats, repeats, model_vocab)


def _result(runs: dict[str, list[dict]], processes: list[int], size: dict, done: int, repeats: int,
            model_vocab: int) -> dict:
    import accelerate
    import ray
    import torch
    import transformers

    loads = [r["load_avg_1m"] for rs in runs.values() for r in rs]
    return {**stamp(), "repeats": done, "complete": done == repeats, "warmup_steps": size["warmup"],
            "load_avg_1m_runs": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
            **{k: size[k] for k in ("steps", "seq_len", "batch")},
            "model": f"tiny_llm llama, {size['layers']} layers x d {size['hidden']}, 4 heads / 2 KV heads, "
                     f"MLP {2 * size['hidden']}, vocab {model_vocab:,} (a {size['vocab']}-token BPE), fp32",
            "job": f"chat JSONL ({size['samples']} samples) packed into {size['seq_len']}+1-token windows, "
                   f"micro-batch {size['batch']} per process, AdamW lr {LR} constant, wd {WEIGHT_DECAY}, "
                   "grad clip 1.0, 1 torch thread per process; DDP on gloo at 2",
            "versions": {"torch": torch.__version__, "ray": ray.__version__, "accelerate": accelerate.__version__,
                         "transformers": transformers.__version__},
            "processes": summarize(runs, processes, size)}


def table(result: dict) -> str:
    lines = [("| processes | platform (Ray) tokens/s | platform (torchrun) tokens/s | Accelerate tokens/s | "
              "ratio Ray / Accelerate | ratio torchrun / Accelerate | loss diff (Ray, torchrun) | "
              "wall s (Ray, torchrun, Accelerate) |"),
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for n, e in result["processes"].items():
        for sfx in ("", "_compiled") if "ray_compiled_tokens_per_s" in e else ("",):
            ray, core, acc = (f"{side}{sfx}" for side in SIDES)
            lines.append(f"| {n}{', compiled' if sfx else ''} | {e[f'{ray}_tokens_per_s']:,.0f} | "
                         f"{e[f'{core}_tokens_per_s']:,.0f} | {e[f'{acc}_tokens_per_s']:,.0f} | "
                         f"{e[f'ratio_{ray}']:.3f} | {e[f'ratio_{core}']:.3f} | "
                         f"{e[f'loss_max_abs_diff_{ray}']:.1e}, {e[f'loss_max_abs_diff_{core}']:.1e} | "
                         f"{e[f'{ray}_wall_s']:.0f}, {e[f'{core}_wall_s']:.0f}, {e[f'{acc}_wall_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, a few steps, 1 repeat; writes only to --out")
    p.add_argument("--repeats", type=int, help="interleaved repeats of every side (default 3; smoke 1)")
    p.add_argument("--processes", help="comma-separated process counts (default 1,2; with --smoke: 2)")
    p.add_argument("--out", type=Path, help="the JSON result (default benchmarks/vs_accelerate.json; "
                                            "with --smoke, none)")
    p.add_argument("--llm-dir", type=Path, help="reuse (or keep) the tiny model and data here")
    p.add_argument("--vocab", type=int, default=512,
                   help="the tokenizer's vocabulary, and so the model's (default 512: the LM head is 5%% of the "
                        "weight matmuls; 4096: 31%%, 8192: 47%%); the default --out gains .vocabN")
    p.add_argument("--compile", action="store_true",
                   help="every side also compiled (the platform's parallel.compile, Accelerate's "
                        "--dynamo_backend inductor), in the same run; the default --out gains .compile")
    p.add_argument("--samples", type=int, help="chat records (default 2000; a larger vocabulary packs them into "
                                               "fewer windows: 5556, the most the standard library gives, for 8192)")
    add_page_arg(p, "vs-accelerate")
    args = p.parse_args(argv)
    if args.vocab < 300 or (args.samples is not None and args.samples < 1):
        p.error("--vocab: at least 300 (the byte alphabet and the special tokens); --samples: at least 1")
    processes = [int(x) for x in args.processes.split(",") if x.strip()] if args.processes else None
    if processes is not None and (not processes or any(n < 1 for n in processes)):
        p.error(f"--processes: positive integers, got {args.processes!r}")
    suffix = ("" if args.vocab == 512 else f".vocab{args.vocab}") + (".compile" if args.compile else "")
    out = args.out or (None if args.smoke else BENCH / f"vs_accelerate{suffix}.json")
    t0 = time.perf_counter()
    command, where = command_line(__file__, argv), machine()

    def save(result: dict) -> None:
        result.update(command=command, machine=where, seconds=round(time.perf_counter() - t0, 1))
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="rtp-vs-accelerate-") as tmp:
        result = measure(Path(tmp), smoke=args.smoke, repeats=args.repeats, processes=processes,
                         llm_dir=args.llm_dir, on_repeat=save, vocab=args.vocab, samples=args.samples,
                         compiled=args.compile)
    save(result)
    print(table(result))
    load = result["load_avg_1m_runs"]
    print(f"{result['seconds']:.0f}s; load average at the end of each run: {load['min']}-{load['max']} "
          f"(median {load['median']})")
    if out:
        print(f"wrote {out}")
    if args.page and args.smoke:
        print("--page: not written for a --smoke run (tiny sizes measure nothing)")
    elif args.page:
        write_page("vs-accelerate", "The Hugging Face fine-tune against Accelerate", table(result), command=command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
