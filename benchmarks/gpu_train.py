"""Tokens/s and MFU on one GPU, without Ray: bf16, FSDP2, optional `torch.compile`,
through the platform's own training engine, for the `gpt` model and a Llama-style
Hugging Face model (the `hf` family).

    torchrun --nproc-per-node 1 benchmarks/gpu_train.py --preset 125m,1b --compile --out gpu.json
    torchrun --nproc-per-node 1 benchmarks/gpu_train.py --preset llama-1b --compile --out gpu.json
    python benchmarks/gpu_train.py --smoke --out /tmp/gpu-smoke.json   # CPU, tiny, a few steps
    python benchmarks/gpu_train.py --smoke --preset hf-smoke --out /tmp/gpu-smoke.json   # the hf path

What runs: for each preset, the torchrun core's `Engine` (core/engine.py) builds the model
(models/gpt.py, or models/hf.py from a ``config.json`` written to a temporary folder with
``init: random``: no weights are written or read), shards it with the `fsdp` strategy
through parallel/compose.py (FSDP2 ``fully_shard`` per block, a gpt block or a Llama
decoder layer; on a GPU with ``mixed_precision``: bf16 parameters and compute, fp32
gradient reduction; on CPU plain fp32) and the AdamW optimizer, and each step is its
``micro_step`` + ``optimizer_step`` (grad clip at 1.0, LR warm-up then constant). Batches
come from the platform's synthetic LM source (each byte follows the previous one by a
fixed permutation, 10% noise: learnable; token ids 0-255, inside any vocabulary),
pre-made on the device so that the step alone is timed. With ``--compile`` each preset
runs eagerly first, then with every block compiled (``parallel.compile``: each block's
``Module.compile()`` before FSDP makes it a unit, as torchtitan).

Before training, the device's dense peak is measured: the best of large square bf16
matmuls (fp32 on CPU). MFU uses MosaicML llm-foundry's formula
(scripts/train/benchmarking/README.md and collect_results.py in mosaicml/llm-foundry):

    flops_per_seq      = 2 * n_params * seq_len                      # a MAC per parameter per token
    attn_flops_per_seq = n_layers * 2 * 2 * (d_attn * seq_len**2)    # Q K^T and A V, forward
    mfu = (3 * flops_per_seq + 3 * attn_flops_per_seq) * seq_per_s / (n_gpus * peak_flops)

(3 = forward, backward, weight gradients; the causal mask is not discounted.) Per token
that is ``6 N + 12 L d_attn T``, the formula of PaLM (Chowdhery et al. 2022, appendix B)
and torchtitan's ``get_num_flop_per_token``. For the gpt presets N is every parameter
(llm-foundry's logged count) and ``d_attn = n_embd``. For the Llama presets, grouped-query
attention and SwiGLU change only which matrices N counts, and N counts them exactly:
q/o are d x d, k/v are d x (kv_heads x head_dim), the MLP is three d x intermediate
matrices, all from the built model; ``d_attn = heads x head_dim`` (the query heads: each
still scores all T keys, GQA only shares K/V between them). N leaves out the input token
embedding, a lookup with no matmul (as PaLM and torchtitan do); the untied LM head is a
matmul and counts. The peak is this device's measured matmul rate, not the datasheet's.

Presets: ``125m`` gpt 18 x d 768 (12 heads, 129M parameters), ``1b`` gpt 20 x d 2048
(16 heads, 1.01B): byte-level (vocabulary 256), so the named size comes from the blocks;
``llama-1b``: Llama 16 x d 2048, 32 heads / 8 KV heads (GQA), SwiGLU MLP 8192, vocabulary
32000, untied head: 1.10B parameters (0.97B in the decoder layers). All at context 2048.
``smoke`` (gpt 2 x d 64) and ``hf-smoke`` (Llama 2 x d 64, 4 / 2 heads): context 32.

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

# Llama-style shapes for the `hf` family (transformers' LlamaConfig fields).
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 8192, "vocab_size": 32000, "max_position_embeddings": 2048}
LLAMA_SMOKE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 32}
PRESETS = {  # model family and kwargs (gpt) or config (hf), context, micro-batch (sequences), LR, steps
    "smoke": {"family": "gpt", "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32},
              "seq_len": 32, "batch": 8, "lr": 1e-2, "steps": 6, "warmup": 2},
    "125m": {"family": "gpt", "model": {"n_layer": 18, "n_head": 12, "n_embd": 768, "block_size": 2048},
             "seq_len": 2048, "batch": 16, "lr": 6e-4, "steps": 20, "warmup": 5},
    "1b": {"family": "gpt", "model": {"n_layer": 20, "n_head": 16, "n_embd": 2048, "block_size": 2048},
           "seq_len": 2048, "batch": 8, "lr": 3e-4, "steps": 15, "warmup": 5},
    "hf-smoke": {"family": "hf", "model": LLAMA_SMOKE, "seq_len": 32, "batch": 8, "lr": 1e-2, "steps": 6,
                 "warmup": 2},
    # ~0.11 PFLOP per step of 8 x 2048 tokens; params, grads and AdamW state ~18 GB fp32.
    "llama-1b": {"family": "hf", "model": LLAMA_1B, "seq_len": 2048, "batch": 8, "lr": 3e-4, "steps": 15,
                 "warmup": 5},
}
SMOKE_PRESETS = ("smoke", "hf-smoke")
# Rough seconds a run needs besides its timed steps (build, warm-up; compile): a run
# is started only if this much budget is left.
MIN_LEFT_S = {"eager": 25.0, "compiled": 100.0}


def mfu_flops_per_seq(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per sequence, llm-foundry's formula (see the module docstring);
    `d_model` is the attention width (query heads x head dim)."""
    flops_per_seq = 2 * n_params * seq_len
    attn_flops_per_seq = n_layers * 2 * 2 * (d_model * seq_len**2)
    return 3 * flops_per_seq + 3 * attn_flops_per_seq


def flop_shape(family: str, model: torch.nn.Module, spec: dict) -> dict:
    """What the MFU formula takes from a built model: the parameters it counts (gpt: all;
    hf: all but the input token embedding, a lookup), layers and attention width."""
    n_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the global one
    if family == "gpt":
        return {"flops_params": n_params, "n_layers": spec["n_layer"], "d_attn": spec["n_embd"]}
    lookup = model.get_input_embeddings().weight.numel()
    head_dim = spec.get("head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    return {"flops_params": n_params - lookup, "n_layers": spec["num_hidden_layers"],
            "d_attn": spec["num_attention_heads"] * head_dim}


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
            "peak_tflops": round(max(rates.values()), 2), "peak_flops": max(rates.values()) * 1e12}


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def write_llama_config(folder: Path, shape: dict) -> Path:
    """A model folder holding only ``config.json`` (a Llama of `shape`, untied head): the
    `hf` family builds it with ``init: random``, so no weights are written for 1B."""
    from transformers import LlamaConfig

    LlamaConfig(tie_word_embeddings=False, **shape).save_pretrained(str(folder))
    return folder


def _model_section(preset: dict, folder: Path) -> dict:
    if preset["family"] == "gpt":
        return {"name": "gpt", "kwargs": preset["model"]}
    return {"name": "hf", "kwargs": {"path": str(write_llama_config(folder, preset["model"])), "init": "random",
                                     "dtype": "float32", "attn_implementation": "sdpa"}}


def _job(preset: dict, *, gpu: bool, world: int, folder: Path, compile_blocks: bool = False):
    from raytrain_platform.config import load_config
    from raytrain_platform.resolve import resolve_job

    cfg = {
        "model": _model_section(preset, folder),
        "data": {"source": "synthetic", "batch_size": preset["batch"], "seq_len": preset["seq_len"],
                 "num_samples": preset["batch"] * world * 4, "val_fraction": 0.0},
        "train": {"max_steps": preset["warmup"] + preset["steps"], "lr": preset["lr"],
                  "lr_schedule": "constant", "warmup_steps": preset["warmup"], "grad_clip": 1.0},
        # One GPU holds everything anyway: no re-gather in backward (reshard off).
        # parallel.compile: each block compiled in place before FSDP wraps it (torchtitan's order).
        "parallel": {"strategy": "fsdp", "mixed_precision": gpu, "reshard_after_forward": world > 1,
                     "compile": compile_blocks},
        "scaling": {"num_workers": world, "use_gpu": gpu, "cpus_per_worker": 1},
        "run": {"name": "gpu-bench", "storage_path": "/tmp", "checkpoint_every": 0, "eval_every": 0},
    }
    return resolve_job(load_config(cfg))


def _batches(job, n: int, device: torch.device) -> torch.Tensor:
    """`n` sequences from the platform's synthetic LM source, as int64 on the device."""
    from raytrain_platform.data.sources import SourceSpec, synthetic_rows

    spec = SourceSpec.from_config(job.config)
    return torch.from_numpy(synthetic_rows(torch.arange(n).numpy(), spec)["tokens"]).to(device).long()


def _build(preset: dict, *, compile_blocks: bool, env):
    """The engine (model sharded, optimizer; its blocks compiled with `parallel.compile`
    when asked), a pool of batches on the device, and what the MFU formula needs of the model."""
    import tempfile

    from raytrain_platform.core.engine import Engine

    with tempfile.TemporaryDirectory(prefix="gpu-train-model-") as folder:  # hf: config.json only
        job = _job(preset, gpu=env.device.type == "cuda", world=env.world_size, folder=Path(folder),
                   compile_blocks=compile_blocks)
        engine = Engine(job, env)
        pool = _batches(job, min(64, preset["batch"] * 4), env.device)
    return engine, pool, flop_shape(preset["family"], engine.wrapped.base, preset["model"])


def train_run(name: str, *, compile_blocks: bool, env, deadline: float) -> dict:
    """Build, warm up (compiles when asked), time the steps; tokens/s, MFU, losses."""
    preset = PRESETS[name]
    t0 = time.perf_counter()
    engine, pool, shape = _build(preset, compile_blocks=compile_blocks, env=env)
    n_params = sum(p.numel() for p in engine.wrapped.module.parameters())
    B, T = preset["batch"], preset["seq_len"]
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
    flops = mfu_flops_per_seq(shape["flops_params"], shape["n_layers"], shape["d_attn"], T)
    out = {"preset": name, "family": preset["family"], "compile": compile_blocks, "n_params": n_params,
           **preset["model"], **shape, "seq_len": T, "micro_batch": B, "timed_steps": timed, "step_s": round(elapsed / timed, 4),
           "tokens_per_s": round(seq_per_s * T, 1), "model_tflops_per_s": round(flops * seq_per_s / 1e12, 3),
           "model_flops_per_s": flops * seq_per_s,
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
    torch.compiler.reset()
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
    p.add_argument("--preset", help=f"comma-separated, of {sorted(PRESETS)} (default 125m,1b; with "
                                    f"--smoke: smoke)")
    p.add_argument("--compile", action="store_true", help="also run each preset with compiled blocks")
    p.add_argument("--smoke", action="store_true", help=f"tiny presets on this machine (CPU is fine): "
                                                         f"{', '.join(SMOKE_PRESETS)}")
    p.add_argument("--out", type=Path, help="write the JSON result here")
    p.add_argument("--budget-s", type=float, default=260.0, help="hard limit from process start")
    args = p.parse_args(argv)
    names = [n.strip() for n in (args.preset or ("smoke" if args.smoke else "125m,1b")).split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {unknown}; known: {sorted(PRESETS)}")
    if args.smoke and set(names) - set(SMOKE_PRESETS):
        p.error(f"--smoke runs the tiny presets {list(SMOKE_PRESETS)}, not {sorted(set(names) - set(SMOKE_PRESETS))}")
    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    deadline = T_START + args.budget_s
    env = _setup_process_group(gpu)
    device_name = torch.cuda.get_device_name(env.device) if gpu else "cpu"
    results = Results(args.out, {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device_name, "torch": torch.__version__,
        "cuda": torch.version.cuda, "world_size": env.world_size, "budget_s": args.budget_s,
        "command": " ".join(sys.argv), "mfu_formula": "llm-foundry: (3*2*flops_params*T + 3*4*n_layers*d_attn*T^2) "
        "* seq_per_s / (n_gpus * measured peak); flops_params: gpt all parameters, hf all but the "
        "input embedding"}, env.is_rank0)
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
                    # Unrounded rates: a tiny CPU run's TFLOP/s rounds to 0.
                    run["mfu"] = round(run["model_flops_per_s"] / (peak["peak_flops"] * env.world_size), 4)
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
