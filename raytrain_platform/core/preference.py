"""The engine's side of ``train.objective: dpo`` (Ray-free): the reference model, each
micro-batch's loss, and the metrics of a step and of a validation pass. The batch
contract and the losses are models/preference.py's.

The reference log-probs of a micro-batch come, in this order of preference, from the
batch itself (``train.dpo.precompute_reference``: `ReferenceScorer` computed them in a
pass before training), from the policy with its LoRA adapters switched off (``model.lora``
with ``reference: auto``: no second copy), or from a frozen copy built and sharded like
the policy (`build_reference`). Each is a forward without gradients over the same
``[chosen; rejected]`` rows as the policy's, with the output head on the counted
positions only where the policy's is (``train.logits: counted``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, ContextManager

import torch

from raytrain_platform.config import JobConfig
from raytrain_platform.core.build import build_reference
from raytrain_platform.core.counted import counted_positions, counted_rows
from raytrain_platform.core.dist import DistEnv, all_reduce_sum
from raytrain_platform.data.dealing import EVAL_PAD
from raytrain_platform.models.family import ModelFamily
from raytrain_platform.models.lora import adapters_disabled
from raytrain_platform.models.preference import (
    METRICS, PAIR_KEYS, REF_KEYS, dpo_loss, pair_inputs, pair_metrics, pair_sums, sequence_logps)
from raytrain_platform.models.registry import get_family
from raytrain_platform.models.tasks import Task
from raytrain_platform.parallel.base import Parallelized
from raytrain_platform.parallel.memory import local_tensor

__all__ = ["PreferenceObjective", "ReferenceScorer"]

Batch = dict[str, torch.Tensor]
_SUMS = 2 + len(METRICS)  # pair_sums: loss, pairs, then each metric


def _logps(module: torch.nn.Module, head: torch.nn.Module | None, task: Task, inputs: torch.Tensor,
           targets: torch.Tensor, rows: torch.Tensor | None) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One forward of the ``[chosen; rejected]`` rows: the model's output, each row's
    summed log-prob of its counted targets and their count ``(2B,)`` each."""
    with counted_positions(head, targets, rows) as kept:
        outputs = module(inputs)
    logits = task.logits(outputs)
    kept.targets(logits)  # refuses a head whose output was reshaped (train.logits)
    logps, counts = sequence_logps(logits, targets, kept.rows)
    return outputs, logps, counts


@contextlib.contextmanager
def _as_reference(wrapped: Parallelized) -> Iterator[None]:
    """The LoRA policy as its own reference: adapters off, in eval mode (no dropout)."""
    training = wrapped.module.training
    wrapped.module.eval()
    try:
        with adapters_disabled(wrapped.base):
            yield
    finally:
        wrapped.module.train(training)


class PreferenceObjective:
    """DPO on the engine's policy `wrapped`: `loss_sum` per micro-batch, its metrics
    summed until `window_metrics` reports them, `eval_sums` for validation. `head` is the
    policy's output head to run on counted positions only (None: every position)."""

    def __init__(self, cfg: JobConfig, env: DistEnv, *, family: ModelFamily, task: Task, wrapped: Parallelized,
                 head: torch.nn.Module | None, autocast: ContextManager):
        self.dpo, self.env, self.task, self.wrapped, self.head = cfg.train.dpo, env, task, wrapped, head
        self.autocast = autocast
        lora_base = cfg.model.lora is not None and self.dpo.reference == "auto"
        self.reference: Parallelized | None = None
        if not self.dpo.precompute_reference and not lora_base:
            self.reference = build_reference(cfg, env, family)
        self.ref_head = (family.output_head(self.reference.base)
                         if self.reference is not None and head is not None else None)
        self._sums = torch.zeros(_SUMS, device=env.device)  # since the last report

    @staticmethod
    def rows(batch: Batch) -> torch.Tensor | None:
        """The counted rows of the micro-batch's ``[chosen; rejected]`` targets (`counted_rows`)."""
        return counted_rows(pair_inputs(batch)[1])

    @staticmethod
    def tokens_per_pair(batch: Batch) -> int:
        """Tokens one pair puts through the forward (what tokens/s counts)."""
        return 2 * (batch["chosen_tokens"].shape[1] - 1)

    @torch.no_grad()
    def reference_logps(self, batch: Batch, inputs: torch.Tensor, targets: torch.Tensor,
                        rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's log-probs of the chosen and of the rejected responses, ``(B,)`` each."""
        if self.dpo.precompute_reference:
            return batch[REF_KEYS[0]].float(), batch[REF_KEYS[1]].float()
        switch: ContextManager[None]
        if self.reference is not None:
            module, head, switch = self.reference.module, self.ref_head, contextlib.nullcontext()
        else:  # LoRA: the policy itself, its adapters off and without dropout, as the frozen copy
            module, head, switch = self.wrapped.module, self.head, _as_reference(self.wrapped)
        with switch, self.autocast:
            _, logps, _ = _logps(module, head, self.task, inputs, targets, rows)
        chosen, rejected = logps.chunk(2)
        return chosen, rejected

    def loss_sum(self, batch: Batch, rows: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """The micro-batch's summed pair losses (to scale and backward) and the policy's
        output (its aux loss); the metrics' sums are kept for `window_metrics`."""
        inputs, targets = pair_inputs(batch)
        ref_chosen, ref_rejected = self.reference_logps(batch, inputs, targets, rows)
        with self.autocast:
            outputs, logps, counts = _logps(self.wrapped.module, self.head, self.task, inputs, targets, rows)
        pair, chosen, rejected = self._pairs(logps, counts, ref_chosen, ref_rejected)
        self._sums += pair_sums(pair, chosen, rejected)
        return pair.losses.sum(), outputs

    def _pairs(self, logps: torch.Tensor, counts: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor):
        chosen, rejected = logps.chunk(2)
        chosen_n, rejected_n = counts.chunk(2)
        pair = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=self.dpo.beta, loss=self.dpo.loss,
                        label_smoothing=self.dpo.label_smoothing, chosen_counts=chosen_n,
                        rejected_counts=rejected_n)
        return pair, chosen, rejected

    @torch.no_grad()
    def eval_sums(self, batch: Batch) -> torch.Tensor:
        """`pair_sums` of one validation micro-batch (the policy in eval mode)."""
        inputs, targets = pair_inputs(batch)
        rows = self.rows(batch) if self.head is not None else None
        ref_chosen, ref_rejected = self.reference_logps(batch, inputs, targets, rows)
        with self.autocast:
            _, logps, counts = _logps(self.wrapped.module, self.head, self.task, inputs, targets, rows)
        pair, chosen, rejected = self._pairs(logps, counts, ref_chosen, ref_rejected)
        return pair_sums(pair, chosen, rejected)

    def evaluate(self, batches: list[Batch], to_device: Callable[[Batch], Batch]) -> dict[str, float]:
        """``val_loss`` and ``val_rewards/...``, ``val_logps/...``: means over every rank's
        pairs of `batches`. A batch marked `EVAL_PAD` runs (its forward is a collective)
        and adds nothing."""
        sums = torch.zeros(_SUMS)
        for batch in batches:
            part = self.eval_sums(to_device({k: v for k, v in batch.items() if k != EVAL_PAD})).cpu()
            sums += 0 if batch.get(EVAL_PAD) else part
        return pair_metrics(all_reduce_sum(sums.to(self.env.device)).cpu(), "val_")

    def memory(self) -> dict[str, int]:
        """This rank's bytes of the reference model's parameters (its shards), when one is held."""
        if self.reference is None:
            return {}
        return {"ref_param_bytes": sum(local_tensor(p).nbytes for p in self.reference.module.parameters())}

    def window_metrics(self) -> dict[str, float]:
        """The rewards and log-probs since the last report, means over every rank's pairs
        (a TP group's copies count each pair as often as its loss); resets the sums."""
        sums = all_reduce_sum(self._sums.clone()).cpu()
        self._sums.zero_()
        metrics = pair_metrics(sums)
        del metrics["loss"]  # the engine's loss is the same mean, from the step's own all-reduce
        return metrics


class ReferenceScorer:
    """The reference log-probs of DPO batches, for a pass before training that stores them
    with the data (``train.dpo.precompute_reference``; TRL's ``precompute_ref_log_probs``).
    Builds the reference as a run with that config would (`build_reference`: ``reference``
    auto or a folder; with LoRA, auto is the base model), sharded by the config's layout.
    Every rank of the job calls `logps` with its own batches, the same number of times
    (a sharded forward is collective)."""

    def __init__(self, cfg: JobConfig, env: DistEnv):
        family = get_family(cfg.model.name)
        self.task = Task(cfg.model.resolved_task, cfg.model.name)
        self.reference = build_reference(cfg, env, family)
        counted = cfg.train.logits == "counted"
        self.head = family.output_head(self.reference.base) if counted else None
        self.device = env.device
        self.autocast = (torch.autocast(device_type=env.device.type, dtype=torch.bfloat16)
                         if cfg.train.precision == "bf16" else contextlib.nullcontext())

    @torch.no_grad()
    def logps(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``{"ref_chosen_logps", "ref_rejected_logps"}``: float32 ``(B,)`` on the CPU, for
        `batch` (the pair keys of the contract, on any device)."""
        inputs, targets = pair_inputs({k: batch[k].to(self.device) for k in PAIR_KEYS})
        rows = counted_rows(targets) if self.head is not None else None
        with self.autocast:
            _, logps, _ = _logps(self.reference.module, self.head, self.task, inputs, targets, rows)
        chosen, rejected = logps.float().cpu().chunk(2)
        return {REF_KEYS[0]: chosen, REF_KEYS[1]: rejected}
