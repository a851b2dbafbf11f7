"""The Accelerate side of `vs_accelerate.py`: the platform's fine-tune written as a plain
Hugging Face Accelerate script, as a user would write it without the platform.

    accelerate launch --cpu --num_processes 1 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no --num_cpu_threads_per_process 1 \\
        benchmarks/_accelerate_finetune.py --model DIR/model --data DIR/data/chat.jsonl \\
        --seq-len 256 --batch-size 8 --steps 24 --out result.json
    accelerate launch --multi_gpu --num_processes 2 ... (the same script arguments)

Two processes on a CPU need ``--multi_gpu`` (torchrun under the hood) and
``Accelerator(cpu=True)`` here: ``accelerate launch --cpu --num_processes 2`` without
``--mpirun_hostfile`` starts *one* plain process, and ``--multi_gpu`` alone starts two
unconnected single-process runs (accelerate 1.x, `accelerate.commands.launch`; checked
here: the result records the process count and backend, and `vs_accelerate.py` asserts
them).

What matches the platform's run (`vs_accelerate.py` writes its config): the model
(``from_pretrained`` of the same folder, fp32, SDPA attention, no KV cache), the windows
(the platform's own packer, `raytrain_platform.data.jsonl`, run up front: ``seq_len + 1``
tokens each, the chat template's assistant turns as targets), micro-batch ``j`` on rank
``j % world`` (Accelerate's batch-sampler sharding, the platform's dealing rule), the loss
(inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]`` where ``loss_mask[:, 1:]`` is set,
cross-entropy in fp32 summed on each rank and divided by the step's assistant-token count
over all ranks, as Hugging Face's Trainer does with ``num_items_in_batch``), AdamW with weight decay on matrices only, grad clip
1.0, constant LR, one torch thread. The optimizer is PyTorch's default AdamW
implementation unless ``--fused-adamw`` (the platform's choice).

Each step is timed from the previous step's end (so a batch's wait counts, as in the
platform's ``step_time_s``); rank 0 writes the step times and every step's loss, averaged
over ranks, to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import is_compiled_module
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raytrain_platform.data.sources import SourceSpec, local_windows  # noqa: E402

IGNORE_INDEX = -100  # cross_entropy's default ignore_index


def packed_windows(data: str, tokenizer: str, seq_len: int) -> TensorDataset:
    """The platform's windows of the chat JSONL: (n, seq_len + 1) token ids and loss masks."""
    spec = SourceSpec(kind="jsonl", task="lm", path=data, format="chat", tokenizer=tokenizer, seq_len=seq_len + 1,
                      val_fraction=0.0, packing="concat", cache_root=str(Path(data).parent / "datasets"))
    windows = local_windows(spec, "train")  # the ranks take turns: the first writes them
    return TensorDataset(torch.from_numpy(windows["tokens"]).long(), torch.from_numpy(windows["loss_mask"]))


def lm_loss(model, tokens: torch.Tensor, loss_mask: torch.Tensor, accelerator) -> torch.Tensor:
    """Next-token loss over the assistant tokens; HF's own ``labels=`` shift is not used so
    that inputs, targets and the fp32 cast are exactly the platform's. Summed, then divided
    by the global count of counted tokens over the ranks (times the rank count, since DDP
    averages gradients): each token weighs the same whichever rank holds it."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    targets = targets.masked_fill(loss_mask[:, 1:] == 0, IGNORE_INDEX)
    counted = accelerator.reduce((targets != IGNORE_INDEX).sum().float(), reduction="sum")
    logits = model(input_ids=inputs).logits.float()  # (B, T, vocab)
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum * accelerator.num_processes / counted.clamp(min=1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model folder (its tokenizer too)")
    p.add_argument("--data", required=True, help="chat JSONL")
    p.add_argument("--seq-len", type=int, required=True, help="tokens of context per sample")
    p.add_argument("--batch-size", type=int, required=True, help="micro-batch per process")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument("--fused-adamw", action="store_true", help="the fused AdamW kernel (the platform's)")
    p.add_argument("--out", type=Path, required=True, help="rank 0 writes its JSON result here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    accelerator = Accelerator(cpu=True)  # CPU: gloo under torchrun (see the module docstring)
    dataset = packed_windows(args.data, args.model, args.seq_len)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, drop_last=True)
    needed = args.steps * args.batch_size * accelerator.num_processes
    if len(dataset) < needed:
        raise SystemExit(f"{len(dataset)} windows, {needed} needed for {args.steps} steps: more data or fewer steps")

    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False  # training: no KV cache in forward
    # Weight decay on matrices, not on norms (nanoGPT's rule, as the platform).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas), fused=args.fused_adamw or None)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()

    step_s: list[float] = []
    losses: list[torch.Tensor] = []
    batches = iter(loader)
    t_prev = time.perf_counter()
    for _ in range(args.steps):
        tokens, loss_mask = next(batches)
        loss = lm_loss(model, tokens, loss_mask, accelerator)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        now = time.perf_counter()
        step_s.append(now - t_prev)
        t_prev = now

    mean_losses = accelerator.reduce(torch.stack(losses), reduction="mean")  # once, after timing
    if accelerator.is_main_process:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
            "backend": accelerator.state.backend, "device": str(accelerator.device),
            "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "fused_adamw": args.fused_adamw, "compiled": is_compiled_module(model), "windows": len(dataset),
            "tokens_per_step": args.batch_size * args.seq_len * accelerator.num_processes,
            "step_s": step_s, "losses": [float(x) for x in mean_losses]}) + "\n")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
