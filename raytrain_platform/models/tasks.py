"""What a batch means for each task: inputs, targets, loss and eval metrics.

A batch is a dict of tensors: ``{"tokens": (B, T+1)}`` for language models (bytes, or
token ids), with an optional ``"loss_mask": (B, T+1)`` (1 where a token is a target the
loss counts: completion and assistant tokens of instruction data) and an optional
``"position_ids": (B, T+1)`` (``data.packing: documents``: restarting at 0 at each
document, which the model's forward takes to keep the documents apart), and
``{"x": (B, F) float32, "y": (B,)}`` for tabular; both carry ``"sample_id": (B,)``.
A model's forward output becomes logits through its family (`ModelFamily.logits`):
a tensor, or a Hugging Face-style output with ``.logits``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from raytrain_platform.models.family import logits_of

__all__ = ["Task", "get_task", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # a target the loss skips (cross_entropy's default ignore_index)


@dataclass(frozen=True)
class Task:
    name: str
    model: str = ""  # model.name, for the message when an output has no logits

    def split(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.name == "lm":
            tokens = batch["tokens"]
            inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs, (B, T) next tokens
            mask = batch.get("loss_mask")
            if mask is not None:  # prompt tokens are context, not targets
                targets = targets.masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
            return inputs, targets
        return batch["x"], batch["y"]

    def forward_kwargs(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What the model's forward takes besides the inputs: the inputs' position ids
        where the batch has them (packed documents), else nothing."""
        positions = batch.get("position_ids")
        if self.name != "lm" or positions is None:
            return {}
        # transformers makes restarting positions a block-causal mask only without a KV
        # cache, which a model whose config says use_cache would make in its forward.
        return {"position_ids": positions[:, :-1].long(), "use_cache": False}  # (B, T): the inputs'

    def logits(self, outputs: Any) -> torch.Tensor:
        return logits_of(outputs, self.model)

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss over the micro-batch (over counted tokens for lm), in fp32."""
        return self.loss_sum(outputs, targets) / max(self.num_targets(targets), 1)

    def loss_sum(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """Summed loss over the micro-batch's counted targets, in fp32. The engine divides
        it by the whole optimizer step's count, so masked tokens weigh the same in every
        layout (a per-micro-batch mean would weigh a token by its micro-batch's count)."""
        outputs = self.logits(outputs).float()
        if self.name == "lm":
            return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        if self.name == "classification":
            return F.cross_entropy(outputs, targets, reduction="sum")
        return F.mse_loss(outputs, targets.float(), reduction="sum")

    def num_targets(self, targets: torch.Tensor) -> int:
        """How many targets the loss counts (lm: tokens not masked out)."""
        if self.name == "lm":
            return int((targets != IGNORE_INDEX).sum())
        return targets.numel()

    def units_per_sample(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens per sample for lm (what tokens/s counts), 1 otherwise."""
        return batch["tokens"].shape[1] - 1 if self.name == "lm" else 1

    def eval_sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """[loss sum, count, correct] for one batch; summed over batches and ranks."""
        outputs = self.logits(outputs).float()
        if self.name == "lm":
            flat, tgt = outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1)
            counted = tgt != IGNORE_INDEX
            loss_sum = F.cross_entropy(flat, tgt, reduction="sum", ignore_index=IGNORE_INDEX)
            correct = ((flat.argmax(-1) == tgt) & counted).sum()
            return torch.stack([loss_sum, counted.sum().float(), correct.float()])
        if self.name == "classification":
            loss_sum = F.cross_entropy(outputs, targets, reduction="sum")
            correct = (outputs.argmax(-1) == targets).sum()
            count = torch.tensor(float(targets.numel()), device=outputs.device)  # a GPU's, as the loss
            return torch.stack([loss_sum, count, correct.float()])
        loss_sum = F.mse_loss(outputs, targets.float(), reduction="sum")
        count, zero = (torch.tensor(v, device=outputs.device) for v in (float(targets.numel()), 0.0))
        return torch.stack([loss_sum, count, zero])

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


def get_task(name: str, model: str = "") -> Task:
    return Task(name, model)

