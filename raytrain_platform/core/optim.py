"""Optimizers and the learning-rate schedule (a pure function of the step, so a
resumed run needs only the step to continue the schedule exactly)."""

from __future__ import annotations

import math

import torch
from torch import nn

from raytrain_platform.config import TrainConfig

__all__ = ["build_optimizer", "lr_at"]

_FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # Weight decay on matrices only, not on biases and norms (nanoGPT's rule).
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        # Fused: one kernel over all parameters, faster than the multi-tensor path on CPU
        # (benchmarks/results/profile-2026-12-03.md); it also takes DTensors (FSDP2, TP). The
        # multi-tensor path stays for devices without a fused kernel.
        fused = all(p.device.type in _FUSED_ADAMW_DEVICES for p in params)
        beta1, beta2 = cfg.betas  # two numbers (TrainConfig checks)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(beta1, beta2), fused=fused,
                                 foreach=not fused)
    # SGD stays multi-tensor: its fused kernel has no DTensor sharding rule (FSDP2 / TP).
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then constant or cosine."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
