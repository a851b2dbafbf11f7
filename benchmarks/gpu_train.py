"""Tokens/s and MFU of the `gpt` model on one GPU, without Ray: bf16, FSDP2, optional
`torch.compile`, through the platform's own training engine.

    torchrun --nproc-per-node 1 benchmarks/gpu_train.py --preset 125m,1b --compile --out gpu.json
    python benchmarks/gpu_train.py --smoke --out /tmp/gpu-smoke.json   # CPU, tiny, a few steps

What runs: for each preset, the torchrun core's `Engine` (core/engine.py) builds the
`gpt` model (models/gpt.py), shards it with the `fsdp` strategy (parallel/fsdp.py,
FSDP2 ``fully_shard`` per block; on a GPU with ``mixed_precision``: bf16 parameters and
compute, fp32 gradient reduction; on CPU plain fp32) and the AdamW optimizer, and each
step is its ``micro_step`` + ``optimizer_step`` (grad clip at 1.0, LR warm-up then
constant). Batches come from the platform's synthetic LM source (each byte follows the
previous one by a fixed permutation, 10% noise: learnable), pre-made on the device so
that the step alone is timed. With ``--compile`` each preset runs eagerly first, then
with every transformer block compiled (``block.compile()``, the unit FSDP shards).

Before training, the device's dense peak is measured: the best of large square bf16
matmuls (fp32 on CPU). MFU uses MosaicML llm-foundry's formula
(scripts/train/benchmarking/README.md and collect_results.py in mosaicml/llm-foundry):

    flops_per_seq      = 2 * n_params * seq_len                      # a MAC per parameter per token
    attn_flops_per_seq = n_layers * 2 * 2 * (d_model * seq_len**2)   # Q K^T and A V, forward
    mfu = (3 * flops_per_seq + 3 * attn_flops_per_seq) * seq_per_s / (n_gpus * peak_flops)

(3 = forward, backward, weight gradients; n_params is every parameter, as llm-foundry's
logged count; the causal mask is not discounted.) The peak is this device's measured
matmul rate, not the datasheet's.

Presets: the model is byte-level (vocabulary 256), so embeddings are tiny and the named
size comes from the blocks: ``125m`` 18 x d 768 (12 heads, 129M parameters), ``1b``
20 x d 2048 (16 heads, 1.01B), both context 2048. ``smoke``: 2 x d 64, context 32.

A hard time budget (``--budget-s``, default 260 s from process start) bounds the run:
a preset run that would not fit is skipped and says so, timed steps stop early when time
runs short, and a watchdog writes what was measured and exits at the budget + 20 s. The
JSON (``--out``) is rewritten after every run. Exit code 1 if a run failed or its loss
did not fall.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

T_START = time.time()
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

PRESETS = {  # model kwargs, micro-batch (sequences), LR, timed steps, warm-up steps
    "smoke": {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32},
              "batch": 8, "lr": 1e-2, "steps": 6, "warmup": 2},
    "125m": {"model": {"n_layer": 18, "n_head": 12, "n_embd": 768, "block_size": 2048},
             "batch": 16, "lr": 6e-4, "steps": 20, "warmup": 5},
    "1b": {"model": {"n_layer": 20, "n_head": 16, "n_embd": 2048, "block_size": 2048},
           "batch": 8, "lr": 3e-4, "steps": 15, "warmup": 5},
}
# Rough seconds a run needs besides its timed steps (build, warm-up; compile): a run
# is started only if this much budget is left.
MIN_LEFT_S = {"eager": 25.0, "compiled": 100.0}


def mfu_flops_per_seq(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per sequence, llm-foundry's formula (see the module docstring)."""
    flops_per_seq = 2 * n_params * seq_len
    attn_flops_per_seq = n_layers * 2 * 2 * (d_model * seq_len**2)
    return 3 * flops_per_seq + 3 * attn_flops_per_seq


def measure_peak_tflops(device: torch.device) -> dict:
    """Best dense matmul rate over a few square sizes: bf16 on a GPU, fp32 on CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = (4096, 8192, 16384) if device.type == "cuda" else (256, 512)
    rates = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        iters = 3
        for _ in range(2):  # warm-up, and find how many iterations fill ~0.2 s
            t0 = _now(device)
            for _ in range(iters):
                torch.mm(a, b)
            dt = _now(device) - t0
            iters = max(3, min(200, int(iters * 0.2 / max(dt, 1e-6))))
        t0 = _now(device)
        for _ in range(iters):
            torch.mm(a, b)
        rates[n] = 2 * n**3 * iters / (_now(device) - t0) / 1e12
        del a, b
    return {"dtype": str(dtype).removeprefix("torch."), "tflops_by_size": {str(k): round(v, 2) for k, v in rates.items()},
            "peak_tflops": round(max(rates.values()), 2)}


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _job(preset: dict, *, gpu: bool, world: int):
    from raytrain_platform.config import load_config
    from raytrain_platform.resolve import resolve_job

    cfg = {
        "model": {"name": "gpt", "kwargs": preset["model"]},
        "data": {"source": "synthetic", "batch_size": preset["batch"],
                 "num_samples": preset["batch"] * world * 4, "val_fraction": 0.0},
        "train": {"max_steps": preset["warmup"] + preset["steps"], "lr": preset["lr"],
                  "lr_schedule": "constant", "warmup_steps": preset["warmup"], "grad_clip": 1.0},
        # One GPU holds everything anyway: no re-gather in backward (reshard off).
        "parallel": {"strategy": "fsdp", "mixed_precision": gpu, "reshard_after_forward": world > 1},
        "scaling": {"num_workers": world, "use_gpu": gpu, "cpus_per_worker": 1},
        "run": {"name": "gpu-bench", "storage_path": "/tmp", "checkpoint_every": 0, "eval_every": 0},
    }
    return resolve_job(load_config(cfg))


def _batches(job, n: int, device: torch.device) -> torch.Tensor:
    """`n` sequences from the platform's synthetic LM source, as int64 on the device."""
    from raytrain_platform.data.sources import SourceSpec, synthetic_rows

    spec = SourceSpec.from_config(job.config)
    return torch.from_numpy(synthetic_rows(torch.arange(n).numpy(), spec)["tokens"]).to(device).long()


def train_run(name: str, *, compile_blocks: bool, env, deadline: float) -> dict:
    """Build, warm up (compiles when asked), time the steps; tokens/s, MFU, losses."""
    from raytrain_platform.core.engine import Engine

    preset = PRESETS[name]
    job = _job(preset, gpu=env.device.type == "cuda", world=env.world_size)
    spec = preset["model"]
    t0 = time.perf_counter()
    engine = Engine(job, env)
    if compile_blocks:
        # torchtitan compiles per transformer block (each an FSDP unit); identical blocks
        # share one compiled graph, so every block needs its own cache entry at most.
        torch._dynamo.config.cache_size_limit = max(64, 2 * spec["n_layer"])
        for block in engine.par.module.blocks.values():
            block.compile()
    n_params = sum(p.numel() for p in engine.par.module.parameters())
    B, T = preset["batch"], spec["block_size"]
    pool = _batches(job, min(64, B * 4), env.device)
    build_s = time.perf_counter() - t0
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        lo = (i * B) % (pool.shape[0] - B + 1)
        losses.append(engine.micro_step({"tokens": pool[lo:lo + B]}, sync=True))
        engine.optimizer_step()
        engine.state.step += 1

    t1 = _now(env.device)
    for i in range(preset["warmup"]):
        step(i)
    warmup_s = _now(env.device) - t1
    t2, timed = _now(env.device), 0
    for i in range(preset["warmup"], preset["warmup"] + preset["steps"]):
        if time.time() > deadline - 5 and timed >= 2:  # keep the budget: fewer timed steps
            break
        step(i)
        timed += 1
    elapsed = _now(env.device) - t2
    loss = [float(x) for x in losses]
    seq_per_s = timed * B * env.world_size / elapsed
    flops = mfu_flops_per_seq(n_params, spec["n_layer"], spec["n_embd"], T)
    out = {"preset": name, "compile": compile_blocks, "n_params": n_params, **spec,
           "micro_batch": B, "timed_steps": timed, "step_s": round(elapsed / timed, 4),
           "tokens_per_s": round(seq_per_s * T, 1), "model_tflops_per_s": round(flops * seq_per_s / 1e12, 3),
           "build_s": round(build_s, 2), "warmup_s": round(warmup_s, 2),
           "loss_first": round(loss[0], 4), "loss_last": round(loss[-1], 4),
           "losses": [round(x, 3) for x in loss],
           # Falls: the mean of the last 3 steps clearly below the first step's loss.
           "loss_fell": sum(loss[-3:]) / len(loss[-3:]) < loss[0] - 0.1}
    if env.device.type == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(env.device) / 2**30, 2)
    return out


def _release(device: torch.device) -> None:
    """Free the last run's model, optimizer and compiled graphs before the next run."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _setup_process_group(gpu: bool):
    """Under torchrun: its group. A plain process: a 1-rank group on a free local port."""
    from raytrain_platform.core.dist import init_torchrun

    if "WORLD_SIZE" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return init_torchrun(use_gpu=gpu)


class Results:
    """The JSON result, rewritten after every run (and by the watchdog) so that what was
    measured survives a run cut short."""

    def __init__(self, path: Path | None, head: dict, is_rank0: bool):
        self.path, self.data, self.is_rank0 = path, {**head, "runs": []}, is_rank0
        self.lock = threading.Lock()

    def write(self, **extra) -> None:
        with self.lock:
            self.data.update(extra, elapsed_s=round(time.time() - T_START, 1))
            if self.path and self.is_rank0:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.data, indent=2) + "\n")
                os.replace(tmp, self.path)


def _watchdog(results: Results, at: float) -> None:
    def fire() -> None:
        results.write(timed_out=True, ok=False)
        print(f"gpu_train: time budget exceeded, wrote {results.path}; exiting", flush=True)
        os._exit(3)

    timer = threading.Timer(max(1.0, at - time.time()), fire)
    timer.daemon = True
    timer.start()


def table(data: dict) -> str:
    lines = [f"device {data['device']} | torch {data['torch']} | measured peak "
             f"{data.get('peak', {}).get('peak_tflops', float('nan')):.1f} TFLOP/s "
             f"({data.get('peak', {}).get('dtype', '?')})", "",
             "| preset | compile | params | tokens/s | MFU | step s | loss first -> last | peak GiB |",
             "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in data["runs"]:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['preset']} | {r['compile']} | | | | | {r.get('error') or r.get('skipped')} | |")
            continue
        lines.append(f"| {r['preset']} | {r['compile']} | {r['n_params'] / 1e6:,.1f}M | {r['tokens_per_s']:,.0f} | "
                     f"{100 * r['mfu']:.1f}% | {r['step_s']:.3f} | {r['loss_first']:.3f} -> "
                     f"{r['loss_last']:.3f} | {r.get('peak_mem_gib', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="125m,1b", help=f"comma-separated, of {sorted(PRESETS)}")
    p.add_argument("--compile", action="store_true", help="also run each preset with compiled blocks")
    p.add_argument("--smoke", action="store_true", help="the tiny preset on this machine (CPU is fine)")
    p.add_argument("--out", type=Path, help="write the JSON result here")
    p.add_argument("--budget-s", type=float, default=260.0, help="hard limit from process start")
    args = p.parse_args(argv)
    names = ["smoke"] if args.smoke else [n.strip() for n in args.preset.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {unknown}; known: {sorted(PRESETS)}")
    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    deadline = T_START + args.budget_s
    env = _setup_process_group(gpu)
    device_name = torch.cuda.get_device_name(env.device) if gpu else "cpu"
    results = Results(args.out, {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device_name, "torch": torch.__version__,
        "cuda": torch.version.cuda, "world_size": env.world_size, "budget_s": args.budget_s,
        "command": " ".join(sys.argv), "mfu_formula": "llm-foundry: (3*2*n_params*T + 3*4*n_layers*d*T^2) "
        "* seq_per_s / (n_gpus * measured peak)"}, env.is_rank0)
    _watchdog(results, deadline + 20)
    peak = measure_peak_tflops(env.device)
    results.write(peak=peak)
    print(f"measured peak: {peak}", flush=True)
    ok = True
    for name in names:
        for compiled in ([False, True] if args.compile else [False]):
            left = deadline - time.time()
            need = MIN_LEFT_S["compiled" if compiled else "eager"] * (0.1 if args.smoke else 1.0)
            if left < need:
                run = {"preset": name, "compile": compiled,
                       "skipped": f"time budget: {left:.0f}s left, a run needs ~{need:.0f}s"}
            else:
                try:
                    run = train_run(name, compile_blocks=compiled, env=env, deadline=deadline)
                    run["mfu"] = round(run["model_tflops_per_s"] / (peak["peak_tflops"] * env.world_size), 4)
                    ok &= run["loss_fell"]
                except Exception as exc:  # noqa: BLE001 - keep the others' figures; report this one
                    run = {"preset": name, "compile": compiled, "error": f"{type(exc).__name__}: {exc}"[:500]}
                    traceback.print_exc()
                    ok = False
                _release(env.device)
            results.data["runs"].append(run)
            results.write()
            print(json.dumps(run), flush=True)
    results.write(ok=ok, timed_out=False)
    if env.is_rank0:
        print(table(results.data))
        if args.out:
            print(f"wrote {args.out}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
