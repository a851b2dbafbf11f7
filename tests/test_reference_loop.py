"""An independent reference for the training loop: `reference_train` below is plain
PyTorch in nanoGPT's style and imports nothing from this package. Over 5 steps with
warm-up, cosine decay, clipping and gradient accumulation, it gives the engine's losses
on one process, so a bug every layout shares (the loss, its masking and weighting, the
schedule, the optimizer's parameter groups, clipping) cannot hide behind the layout-
equality tests, which all compare against the engine's own one-process run.

- hf Llama with a loss mask (chat data): the reference's model is transformers' own,
  loaded from the folder with ``from_pretrained``; independent end to end.
- gpt: the platform's own model (its definition is what `gpt` is), a copy of the
  engine's freshly built module; the loop around it is the reference's.

The batches are data, not the subject: the engine's are recorded as it reads them and
fed to the reference in the same order.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import hf_config, job_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS, ACCUM = 5, 2
TRAIN = {"max_steps": STEPS, "grad_accum_steps": ACCUM, "lr": 3e-3, "warmup_steps": 2, "lr_schedule": "cosine",
         "min_lr_ratio": 0.1, "grad_clip": 0.1, "weight_decay": 0.1, "betas": [0.9, 0.95], "seed": 0}
# fp32: the engine's fused AdamW, its output head on counted tokens only and its summed
# micro-batch losses order their additions differently (measured: 8.0e-8 relative for the
# Llama, 4.4e-8 for gpt); the reference with a clip of 1.0, no weight decay or no cosine
# floor instead moves them by 7e-6 to 3e-4.
RTOL = 1e-6


def reference_train(model, steps, *, lr, warmup_steps, min_lr_ratio, total_steps, grad_clip, weight_decay,
                    betas):
    """Train `model` on `steps` (each a list of micro-batches: ``tokens`` (B, T+1) and an
    optional ``loss_mask``); returns each optimizer step's loss (mean over its targets)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # weight decay on matrices only
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=lr, betas=betas)
    losses = []
    for step, micro_batches in enumerate(steps):
        if step < warmup_steps:  # linear warm-up, then cosine down to min_lr_ratio * lr
            step_lr = lr * (step + 1) / warmup_steps
        else:
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            step_lr = lr * min_lr_ratio + lr * (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = step_lr
        xs, ys = [], []
        for batch in micro_batches:
            tokens = batch["tokens"].long()
            x, y = tokens[:, :-1], tokens[:, 1:].clone()  # (B, T) inputs, (B, T) next tokens
            if "loss_mask" in batch:
                y[batch["loss_mask"][:, 1:] == 0] = -100  # prompt tokens are context only
            xs.append(x)
            ys.append(y)
        n_targets = sum(int((y != -100).sum()) for y in ys)  # the step's mean is over all its targets
        step_loss = 0.0
        for x, y in zip(xs, ys):  # forward backward, with gradient accumulation
            out = model(x)
            logits = getattr(out, "logits", out).float()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum") / n_targets
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
    return losses


class _Recorded:
    """The engine's reader, its micro-batches kept as they are read."""

    def __init__(self, source):
        self.source, self.batches = source, []

    def train_epoch(self, epoch):
        for batch in self.source.train_epoch(epoch):
            self.batches.append({k: v.clone() for k, v in batch.items()})
            yield batch

    def val_batches(self, n):
        return self.source.val_batches(n)


class _Losses:
    def __init__(self):
        self.rows = []

    def report(self, metrics, save):
        self.rows.append(metrics)


def _engine_run(tmp_path, cfg: dict):
    """The engine on one process (Ray-free), as torchrun's rank 0 runs it."""
    from raytrain_platform.config import load_config
    from raytrain_platform.core.dist import init_torchrun
    from raytrain_platform.core.engine import Engine
    from raytrain_platform.data.local import LocalBatches
    from raytrain_platform.resolve import resolve_job

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    job = resolve_job(load_config(path))
    engine = Engine(job, init_torchrun(use_gpu=False))
    initial = copy.deepcopy(engine.wrapped.module)
    source, losses = _Recorded(LocalBatches(job, rank=0, world_size=1)), _Losses()
    engine.fit(source, losses)
    steps = [source.batches[i:i + ACCUM] for i in range(0, STEPS * ACCUM, ACCUM)]
    assert len(steps) == STEPS and all(len(s) == ACCUM for s in steps)
    return [r["loss"] for r in losses.rows], steps, initial


def _reference_losses(model, steps):
    return reference_train(model, steps, lr=TRAIN["lr"], warmup_steps=TRAIN["warmup_steps"],
                           min_lr_ratio=TRAIN["min_lr_ratio"], total_steps=STEPS, grad_clip=TRAIN["grad_clip"],
                           weight_decay=TRAIN["weight_decay"], betas=tuple(TRAIN["betas"]))


def _assert_same(ours: list[float], theirs: list[float]) -> None:
    assert len(ours) == len(theirs) == STEPS
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64),
                               rtol=RTOL, atol=0)


def test_the_engine_trains_an_hf_llama_on_masked_chat_data_as_a_plain_pytorch_loop(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    cfg = hf_config(tmp_path, "llama", tiny["model"], train=TRAIN, run={"log_every": 1, "eval_every": 0,
                                                                        "checkpoint_every": 0})
    cfg["data"] = {"source": "jsonl", "path": str(tiny["chat"]), "format": "chat", "batch_size": 2, "seq_len": 64,
                   "val_fraction": 0.05}
    ours, steps, _ = _engine_run(tmp_path, cfg)
    assert all("loss_mask" in b and (b["loss_mask"] == 0).any() for s in steps for b in s)  # masked prompts
    reference = AutoModelForCausalLM.from_pretrained(str(tiny["model"]), local_files_only=True)
    _assert_same(ours, _reference_losses(reference, steps))


def test_the_engine_trains_gpt_as_a_plain_pytorch_loop(tmp_path):
    cfg = job_config(tmp_path, "gpt", dict(
        model={"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}},
        data={"source": "synthetic", "batch_size": 4, "num_samples": 512, "seq_len": 32, "val_fraction": 0.1},
        train=TRAIN, run={"log_every": 1, "eval_every": 0, "checkpoint_every": 0}))
    ours, steps, initial = _engine_run(tmp_path, cfg)
    _assert_same(ours, _reference_losses(initial, steps))
