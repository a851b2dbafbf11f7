"""TRL's DPOTrainer on preference JSONL, as a user runs it: `dpo_vs_trl.py` starts it
with ``python`` (1 process) or ``torchrun`` (2: DDP on gloo, ``use_cpu``), and reads the
JSON it writes. Not a benchmark itself.

    python benchmarks/_trl_dpo.py --model M --data D.jsonl --seq-len 128 --batch-size 4 --steps 20 --out r.json

Figures: the time of each optimizer step (a callback's ``on_step_end``), and the pairs'
real tokens (prompt + response, both sides, after TRL's truncation to ``max_length``)
averaged over TRL's own tokenized dataset: tokens/s is that mean x pairs per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, required=True, help="tokens per pair side is seq_len + 1, as the platform's")
    p.add_argument("--batch-size", type=int, required=True, help="pairs per process per step")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", required=True, help="TRL's output_dir (nothing is saved there)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in open(args.data, encoding="utf-8") if line.strip()]
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    config = DPOConfig(output_dir=args.work, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
                       learning_rate=args.lr, beta=args.beta, loss_type=["sigmoid"], max_length=args.seq_len + 1,
                       use_cpu=True, report_to=[], save_strategy="no", logging_steps=args.steps, seed=0,
                       dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo" if "RANK" in os.environ else None)
    steps: list[float] = []

    class _Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter())

    start = time.perf_counter()
    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(records), processing_class=tok,
                         callbacks=[_Clock()])
    ds = trainer.train_dataset
    limit = args.seq_len + 1
    tokens = [min(len(p) + len(c), limit) + min(len(p) + len(r), limit)
              for p, c, r in zip(ds["prompt_ids"], ds["chosen_ids"], ds["rejected_ids"])]
    began = time.perf_counter()
    trainer.train()
    times = [b - a for a, b in zip([began] + steps[:-1], steps)][args.warmup:]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    step_s = statistics.median(times)
    pairs_per_s = args.batch_size * world / step_s
    result = {"processes": world, "backend": dist.get_backend() if world > 1 else None, "steps": len(steps),
              "step_s": step_s, "pairs_per_s": pairs_per_s, "tokens_per_pair": statistics.mean(tokens),
              "tokens_per_s": pairs_per_s * statistics.mean(tokens), "setup_s": began - start,
              "wall_s": time.perf_counter() - start}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
