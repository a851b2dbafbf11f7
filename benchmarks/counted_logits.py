"""The LM head on counted tokens (``train.logits: counted``, the default) against every
position (``all``, what Hugging Face's loss and a plain Accelerate loop do): step time and
the bytes autograd saves, side by side in one process.

    python benchmarks/counted_logits.py            # ~1 min on 2 quiet CPU cores
    python benchmarks/counted_logits.py --smoke    # tiny, writes nothing (a test)

The job is `vs_accelerate.py`'s fine-tune: a Llama-style model from `tools/tiny_llm.py`
(4 layers x d 256, 4 heads / 2 KV heads), chat JSONL of stdlib docstring pairs (the loss
on the assistant turns), 256-token windows, micro-batch 8, AdamW, fp32, one torch
thread, on the Ray-free engine in this process. Three tokenizers are trained on the
same text: 512 tokens (`vs_accelerate.py`'s), 4,096 and 8,192. What the head on counted
tokens saves is the head's share of the model's weight matmuls times the prompt share:
the head is 5%, 31% and 47% of them here, against 7% for Llama 3 8B, 21% for Llama 3.2
1B and 28% for Qwen2.5 0.5B (from their shapes).

For each vocabulary one engine trains; phases of 5 steps alternate between the
head on counted tokens and on every position (the same weights, advancing; the first
warm-up steps are left out), and each mode's median step is compared; the counted share
is that of the timed steps' positions. Then, on one
batch, the bytes autograd saves for backward in each mode (each storage once, the
parameters excluded, as `parallel/memory.py`'s `saved_activation_bytes` counts them).
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

from common import ROOT, load_avg, stamp  # noqa: E402

SIZES = {
    "full": {"hidden": 256, "layers": 4, "samples": 2000, "seq_len": 256, "batch": 8, "vocabs": [512, 4096, 8192],
             "warmup": 3, "phases": 8, "phase": 5},
    "smoke": {"hidden": 64, "layers": 2, "samples": 200, "seq_len": 32, "batch": 4, "vocabs": [512],
              "warmup": 1, "phases": 2, "phase": 2},
}


def job_config(llm: Path, size: dict, storage: Path, name: str) -> dict:
    return {
        "model": {"name": "hf", "kwargs": {"path": str(llm / "model"), "init": "pretrained"}},
        "data": {"source": "jsonl", "path": str(llm / "data" / "chat.jsonl"), "format": "chat",
                 "seq_len": size["seq_len"], "batch_size": size["batch"], "val_fraction": 0.0},
        "train": {"max_steps": 1000, "lr": 1e-3, "lr_schedule": "constant", "betas": [0.9, 0.95],
                  "weight_decay": 0.1, "grad_clip": 1.0, "seed": 0},
        "scaling": {"num_workers": 1, "torch_threads": 1},
        "run": {"name": name, "storage_path": str(storage), "checkpoint_every": 0, "eval_every": 0},
    }


def _batches(source):
    epoch = 0
    while True:
        yield from source.train_epoch(epoch)
        epoch += 1


def measure_vocab(work: Path, vocab: int, size: dict) -> dict:
    import torch
    import yaml

    from raytrain_platform.config import load_config
    from raytrain_platform.core.dist import init_torchrun
    from raytrain_platform.core.engine import Engine
    from raytrain_platform.data.local import LocalBatches
    from raytrain_platform.resolve import resolve_job
    from raytrain_platform.parallel.memory import saved_activation_bytes
    from raytrain_platform.tools.tiny_llm import make_all

    llm = work / f"llm{vocab}"
    made = make_all(llm, samples=size["samples"], vocab_size=vocab, num_layers=size["layers"],
                    hidden_size=size["hidden"], num_heads=4, num_kv_heads=2, intermediate_size=2 * size["hidden"])
    model_vocab = json.loads((made["model"] / "config.json").read_text())["vocab_size"]
    path = work / f"v{vocab}.yaml"
    path.write_text(yaml.safe_dump(job_config(llm, size, work / "runs", f"v{vocab}")))
    torch.set_num_threads(1)
    job = resolve_job(load_config(path))
    engine = Engine(job, init_torchrun(use_gpu=False))
    head = engine.head
    assert head is not None, "the hf family has an output head"
    matmul = sum(m.weight.numel() for m in engine.wrapped.base.modules() if isinstance(m, torch.nn.Linear))
    batches = _batches(LocalBatches(job, rank=0, world_size=1))

    share = [0, 0]  # counted targets, positions over the timed steps

    def step(mode: str) -> float:
        engine.head = head if mode == "counted" else None
        batch = engine._to_device(next(batches))
        targets = engine.task.split(batch)[1]
        share[0] += engine.task.num_targets(targets)
        share[1] += targets.numel()
        t0 = time.perf_counter()
        engine.train_step([batch], started=t0, data_wait=0.0)
        return time.perf_counter() - t0

    for _ in range(size["warmup"]):
        step("counted")
    share[:] = [0, 0]
    times: dict[str, list[float]] = {"counted": [], "all": []}
    for i in range(size["phases"]):
        mode = "counted" if i % 2 == 0 else "all"
        times[mode] += [step(mode) for _ in range(size["phase"])]
        print(f"vocab {model_vocab}, phase {i + 1}/{size['phases']} ({mode}): median "
              f"{statistics.median(times[mode][-size['phase']:]):.3f}s, load {load_avg():.1f}", flush=True)

    batch = engine._to_device(next(batches))
    saved: dict[str, int] = {}
    losses: dict[str, float] = {}
    for mode in ("counted", "all"):
        engine.head = head if mode == "counted" else None
        loss, saved[mode] = saved_activation_bytes(
            lambda: engine.micro_step(batch, sync=True, scale=1.0), list(engine.wrapped.base.parameters()))
        losses[mode] = float(loss)
        engine.optimizer.zero_grad(set_to_none=True)
    engine.head = head
    step_s = {mode: statistics.median(v) for mode, v in times.items()}
    return {"tokenizer_vocab": vocab, "model_vocab": model_vocab, "counted_share": round(share[0] / share[1], 3),
            "head_share_of_matmul_weights": round(head.weight.numel() / matmul, 3),
            "step_s": {m: round(v, 4) for m, v in step_s.items()},
            "tokens_per_s": {m: round(size["batch"] * size["seq_len"] / v, 1) for m, v in step_s.items()},
            "speedup": round(step_s["all"] / step_s["counted"], 3),
            "saved_bytes": saved, "saved_ratio": round(saved["counted"] / saved["all"], 3),
            "loss_sum": losses, "steps_per_mode": len(times["counted"])}


def table(result: dict) -> str:
    lines = ["| vocabulary (model) | head share of matmul weights | counted share | step s, counted | step s, all | "
             "speedup | saved MiB, counted | saved MiB, all | ratio |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["vocabs"]:
        lines.append(f"| {r['model_vocab']:,} | {r['head_share_of_matmul_weights']:.0%} | {r['counted_share']:.0%} | "
                     f"{r['step_s']['counted']:.3f} | "
                     f"{r['step_s']['all']:.3f} | **{r['speedup']:.2f}x** | "
                     f"{r['saved_bytes']['counted'] / 2**20:.1f} | {r['saved_bytes']['all'] / 2**20:.1f} | "
                     f"{r['saved_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one vocabulary; writes nothing")
    p.add_argument("--out", type=Path, help="the JSON result (default benchmarks/counted_logits.json)")
    args = p.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "full"]
    out = args.out or (None if args.smoke else ROOT / "benchmarks" / "counted_logits.json")
    t0 = time.perf_counter()
    result = {**stamp(), "command": " ".join(["python benchmarks/counted_logits.py", *(argv or sys.argv[1:])]),
              "job": f"tiny_llm llama {size['layers']} layers x d {size['hidden']}, chat JSONL, seq {size['seq_len']}, "
                     f"micro-batch {size['batch']}, fp32, 1 process, 1 thread",
              "phases": size["phases"], "steps_per_phase": size["phase"]}
    with tempfile.TemporaryDirectory(prefix="rtp-counted-") as tmp:
        result["vocabs"] = [measure_vocab(Path(tmp), vocab, size) for vocab in size["vocabs"]]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(table(result))
    if out is not None:
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
