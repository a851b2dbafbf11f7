"""Pretrained weights straight into shards: peak memory per rank while loading a
Hugging Face checkpoint of >= 300M parameters with FSDP, and in pipeline stages, on 2
ranks, against loading the whole model in one process. Goal (issue 17): each rank's
peak <= 0.6x the one-process peak.

    python benchmarks/hf_load.py                      # writes a 311M Llama once, then measures
    python benchmarks/hf_load.py --moe                # a 308M Qwen3-MoE (8 experts): hf_load.moe.json
    python benchmarks/hf_load.py --smoke [--moe]      # a tiny model, one repeat (what the tests run)

A mixture of experts' checkpoint holds one tensor per expert, which transformers fuses
into one per layer while loading (models/hf_weights.py): a rank builds each fused tensor
whole from its experts, then keeps its slice. The MoE side measures FSDP2 only (no ``pp2``).

Sides, each in a fresh process, interleaved over repeats:

- ``fsdp2``: the platform's path (core/build.py `build_model`): the model built on the
  meta device, `fully_shard` per decoder layer (parallel/compose.py), ``to_empty``,
  then each rank reads only its slices of the safetensors files (core/weights.py);
- ``pp2``: two pipeline stages (models/hf_pipeline.py): each rank keeps its half of the
  decoder layers of the meta model (rank 0 the embedding, rank 1 the norm and LM head)
  and reads only those tensors, whole;
- ``one``: the same loader in one process, no sharding (every tensor whole);
- ``from_pretrained``: ``transformers.AutoModelForCausalLM.from_pretrained``, for reference.

Memory is the process's peak resident set (VmHWM) while loading and then reading every
weight it holds once, minus its resident set just before (imports, process group and
the meta model are the same on every side): the bytes the load itself costs. The peak is reset (``/proc/self/clear_refs``)
just before loading. The safetensors files are memory-mapped: pages a rank reads count
in its resident set, so a rank that read the whole file would show it. Each side also
reports the sum of squares of every weight it holds (summed over ranks): equal sums
show the shards hold exactly the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (ROOT, free_port, harness_parser, load_avg, out_path, result_meta,  # noqa: E402
                               stamp, write_result)

BIG = dict(hidden_size=1024, num_layers=22, num_heads=16, num_kv_heads=4, intermediate_size=2816,
           vocab_size=32000, max_position_embeddings=2048)  # 311M parameters (untied head)
SMOKE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
             vocab_size=512, max_position_embeddings=128)
# transformers' Qwen3MoeConfig keywords: 16 layers of 8 experts (2 per token), 308M parameters
BIG_MOE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
               moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
               intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
SMOKE_MOE = dict(BIG_MOE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, moe_intermediate_size=32, num_experts=4, intermediate_size=128, vocab_size=512,
                 max_position_embeddings=128)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def worker(side: str, model_dir: str) -> dict:
    """One side's load, in this process (rank 0 of torchrun, or alone)."""
    import torch
    import torch.distributed as dist

    from raytrain_platform.config import ParallelConfig
    from raytrain_platform.core.dist import init_torchrun
    from raytrain_platform.core.build import fill_pretrained
    from raytrain_platform.models import get_family
    from raytrain_platform.parallel.compose import parallelize
    from raytrain_platform.parallel.memory import local_tensor

    torch.set_num_threads(1)
    env = init_torchrun(use_gpu=False)
    fam = get_family("hf")
    kw = fam.resolve_kwargs({"path": model_dir})
    if side == "from_pretrained":
        from transformers import AutoModelForCausalLM

        before = _status("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        parts = [AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)]
    else:
        model = fam.build(kw, device="meta")
        parts = [model]  # what this rank holds: the model, its FSDP shards, or its stages
        if side == "fsdp2":
            parallelize(model, env=env, cfg=ParallelConfig(strategy="fsdp"), family=fam, model_kwargs=kw)
        elif side == "pp2":
            parts = parallelize(model, env=env, cfg=ParallelConfig(strategy="none", pp_size=2), family=fam,
                                model_kwargs=kw).pipeline.parts
        before = _status("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        for part in parts:  # the platform's own loader, as core/build.py `build_model` fills each part
            fill_pretrained(part, fam, fam.pretrained_files(kw), env.device)
    params = [p for part in parts for p in part.parameters()]
    # Read every weight held, inside the measured window: transformers maps the files and
    # reads pages only when a weight is first used; this counts them on every side alike.
    local = [local_tensor(p) for p in params]
    sq = torch.zeros((), dtype=torch.float64)
    for t in local:  # in 1M-element chunks: the check itself adds no tensor-sized copies
        for chunk in t.detach().reshape(-1).split(1 << 20):
            sq += chunk.double().pow(2).sum()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - before
    held = sum(t.numel() for t in local)
    if dist.is_initialized():
        dist.all_reduce(sq)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, {"peak_bytes": peak, "held_params": held})
        dist.destroy_process_group()
    else:
        rows = [{"peak_bytes": peak, "held_params": held}]
    return {"side": side, "seconds": seconds, "sum_sq": float(sq), "ranks": rows,
            "num_params": sum(p.numel() for p in params) if side in ("one", "from_pretrained") else None}


def _run_side(side: str, model_dir: str) -> dict:
    nproc = 2 if side in ("fsdp2", "pp2") else 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), __file__, "--worker", side,
           "--dir", model_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def ensure_model(directory: Path, sizes: dict, *, moe: bool = False) -> Path:
    """The benchmark's model in `directory`, written once: a Llama by tools/tiny_llm, or
    (`moe`) a Qwen3-MoE from transformers' config class (its files hold per-expert tensors)."""
    from raytrain_platform.tools.tiny_llm import make_model

    if not (directory / "config.json").is_file():
        t0 = time.perf_counter()
        if moe:
            import torch
            from transformers import AutoModelForCausalLM, Qwen3MoeConfig

            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(Qwen3MoeConfig(**sizes)).save_pretrained(directory,
                                                                                       max_shard_size="500MB")
        else:
            make_model(directory, arch="llama", max_shard_size="500MB", **{k: v for k, v in sizes.items()})
        print(f"wrote {directory} in {time.perf_counter() - t0:.0f}s", flush=True)
    return directory


def main(argv: list[str] | None = None) -> int:
    p = harness_parser(__doc__, out=None)
    p.add_argument("--dir", default=None, help="default /tmp/rtp-hf-load/llama-311m (--moe: qwen3-moe-308m)")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE (fused experts) instead of a Llama")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = worker(args.worker, args.dir)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        return 0
    sizes = (SMOKE_MOE if args.smoke else BIG_MOE) if args.moe else (SMOKE if args.smoke else BIG)
    directory = args.dir or ("/tmp/rtp-hf-load/" + ("qwen3-moe-308m" if args.moe else "llama-311m"))
    model_dir = ensure_model(Path(directory + ("-smoke" if args.smoke else "")), sizes, moe=args.moe)
    # the default JSON result, unless --smoke (benchmarks/common.py out_path)
    args.default_out = ROOT / "benchmarks" / ("hf_load.moe.json" if args.moe else "hf_load.json")
    repeats = 1 if args.smoke else args.repeats or 3
    sides = ("fsdp2", "one", "from_pretrained") if args.moe else ("fsdp2", "pp2", "one", "from_pretrained")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for i in range(repeats):
        for side in runs:
            r = _run_side(side, str(model_dir))
            runs[side].append(r)
            print(f"repeat {i + 1}/{repeats} {side}: peak per rank "
                  f"{[round(x['peak_bytes'] / 2**20) for x in r['ranks']]} MiB, {r['seconds']:.1f}s "
                  f"(load {load_avg():.1f})", flush=True)
    peak = {s: statistics.median([max(x["peak_bytes"] for x in r["ranks"]) for r in runs[s]]) for s in runs}
    sums = {s: runs[s][0]["sum_sq"] for s in runs}
    sharded = [s for s in ("fsdp2", "pp2") if s in runs]
    summary = {
        **stamp(), "model_dir": str(model_dir), "num_params": runs["one"][0]["num_params"],
        "one_process_peak_MiB": peak["one"] / 2**20,
        **{f"{s}_rank_peak_MiB": peak[s] / 2**20 for s in sharded},
        "from_pretrained_peak_MiB": peak["from_pretrained"] / 2**20,
        **{f"ratio_{s}_rank_vs_one": peak[s] / peak["one"] for s in sharded},
        "ratio_fsdp2_rank_vs_from_pretrained": peak["fsdp2"] / peak["from_pretrained"], "goal": "<= 0.6",
        "weights_equal": all(abs(sums[s] - sums["one"]) <= 1e-9 * abs(sums["one"])
                             for s in (*sharded, "from_pretrained")),
        "held_params_per_rank": {s: [x["held_params"] for x in runs[s][0]["ranks"]] for s in sharded},
        "load_seconds": {s: statistics.median([r["seconds"] for r in runs[s]]) for s in runs}, "repeats": repeats,
    }
    print(json.dumps(summary, indent=2))
    write_result({"_meta": result_meta(__file__, argv), "summary": summary, "runs": runs}, out_path(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
