"""What a batch means for each kind of model: inputs, targets, loss and eval metrics.

A batch is a dict of tensors: ``{"tokens": (B, T+1) int64}`` for language models,
``{"x": (B, F) float32, "y": (B,)}`` for tabular; both carry ``"sample_id": (B,)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Task", "get_task"]


@dataclass(frozen=True)
class Task:
    name: str

    def split(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.name == "lm":
            tokens = batch["tokens"]
            return tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs, (B, T) next-token targets
        return batch["x"], batch["y"]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss over the micro-batch (over tokens for lm), in fp32."""
        outputs = outputs.float()
        if self.name == "lm":
            return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))
        if self.name == "classification":
            return F.cross_entropy(outputs, targets)
        return F.mse_loss(outputs, targets.float())

    def units_per_sample(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens per sample for lm (what tokens/s counts), 1 otherwise."""
        return batch["tokens"].shape[1] - 1 if self.name == "lm" else 1

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[loss sum, count, correct] for one batch; summed over batches and ranks."""
        outputs = outputs.float()
        if self.name == "lm":
            flat, tgt = outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1)
            loss_sum = F.cross_entropy(flat, tgt, reduction="sum")
            correct = (flat.argmax(-1) == tgt).sum()
            return torch.stack([loss_sum, torch.tensor(float(tgt.numel())), correct.float()])
        if self.name == "classification":
            loss_sum = F.cross_entropy(outputs, targets, reduction="sum")
            correct = (outputs.argmax(-1) == targets).sum()
            return torch.stack([loss_sum, torch.tensor(float(targets.numel())), correct.float()])
        loss_sum = F.mse_loss(outputs, targets.float(), reduction="sum")
        return torch.stack([loss_sum, torch.tensor(float(targets.numel())), torch.tensor(0.0)])

    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        loss_sum, count, correct = (float(v) for v in sums)
        count = max(count, 1.0)
        val_loss = loss_sum / count
        metrics = {"val_loss": val_loss}
        if self.name == "lm":
            metrics["val_perplexity"] = math.exp(min(val_loss, 50.0))
            metrics["val_accuracy"] = correct / count
        elif self.name == "classification":
            metrics["val_accuracy"] = correct / count
        return metrics


def get_task(name: str) -> Task:
    return Task(name)
