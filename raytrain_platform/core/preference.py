"""The engine's side of ``train.objective: dpo`` (Ray-free): the reference model, each
micro-batch's loss, and the metrics of a step and of a validation pass. The batch
contract and the losses are models/preference.py's.

The reference log-probs of a micro-batch come, in this order of preference, from the
batch itself (its ``ref_*_logps``), from the table kept with the data
(``train.dpo.precompute_reference``: `precompute_reference` scored every pair once, in a
pass before training; data/ref_logps.py), from the policy with its LoRA adapters
switched off (``model.lora`` with ``reference: auto``: no second copy), or from a frozen
copy built and sharded like the policy (`build_reference`). Each is a forward without
gradients over the same ``[chosen; rejected]`` rows as the policy's, with the output
head on the counted positions only where the policy's is (``train.logits: counted``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any, Callable, ContextManager

import numpy as np
import torch

from raytrain_platform._version import __version__
from raytrain_platform.config import JobConfig
from raytrain_platform.core.build import build_reference
from raytrain_platform.core.counted import counted_positions, counted_rows
from raytrain_platform.core.dist import DistEnv, all_gather_objects, all_reduce_sum
from raytrain_platform.core.rundir import append_note
from raytrain_platform.data.dealing import EVAL_PAD
from raytrain_platform.data.prepared import file_state
from raytrain_platform.data.ref_logps import ReferenceLogps, pair_chunks, pair_count, write_reference
from raytrain_platform.errors import DataError
from raytrain_platform.models.family import ModelFamily
from raytrain_platform.models.lora import adapters_disabled
from raytrain_platform.models.preference import (
    METRICS, REF_KEYS, dpo_loss, pair_inputs, pair_metrics, pair_sums, sequence_logps)
from raytrain_platform.models.tasks import Task
from raytrain_platform.parallel.base import Parallelized
from raytrain_platform.parallel.dims import ParallelDims
from raytrain_platform.parallel.memory import local_tensor

__all__ = ["PreferenceObjective", "policy_is_reference", "reference_key", "precompute_reference"]

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


def policy_is_reference(cfg: JobConfig) -> bool:
    """Whether the reference is the policy itself with its adapters off (``model.lora``
    with ``reference: auto``): no copy is ever built."""
    return cfg.model.lora is not None and cfg.train.dpo.reference == "auto"


class _Reference:
    """The reference model's forward: a frozen copy (`build_reference`), or the LoRA
    policy `lora_policy` with its adapters off."""

    def __init__(self, cfg: JobConfig, env: DistEnv, *, family: ModelFamily, task: Task,
                 head: bool, autocast: ContextManager, lora_policy: Parallelized | None = None):
        self.task, self.autocast, self.lora_policy = task, autocast, lora_policy
        self.copy = build_reference(cfg, env, family) if lora_policy is None else None
        model = self.copy if self.copy is not None else lora_policy
        assert model is not None
        self.module = model.module
        self.head = family.output_head(model.base) if head else None

    def _switch(self) -> ContextManager[None]:
        """The policy's adapters off while the LoRA reference runs (nothing for a copy)."""
        return contextlib.nullcontext() if self.lora_policy is None else _as_reference(self.lora_policy)

    @torch.no_grad()
    def logps(self, inputs: torch.Tensor, targets: torch.Tensor,
              rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-probs of the chosen and of the rejected responses, ``(B,)`` each."""
        with self._switch(), self.autocast:
            _, logps, _ = _logps(self.module, self.head, self.task, inputs, targets, rows)
        chosen, rejected = logps.chunk(2)
        return chosen, rejected


def reference_key(cfg: JobConfig, family: ModelFamily) -> str:
    """A hash of what a pair's reference log-probs depend on besides its tokens: the
    reference's architecture and weights (its files' path, size and modification time,
    its folder's config.json; or the seed of a random initialization), the precision
    (``train.precision``, FSDP's ``parallel.mixed_precision``), ``train.logits`` and this
    package's version. A LoRA run's reference with ``auto`` is its base: the same key as
    without LoRA."""
    m, ref = cfg.model, cfg.train.dpo.reference
    kwargs = m.kwargs if ref == "auto" else family.reference_kwargs(m.kwargs, ref)
    files = family.pretrained_files(kwargs)
    folder = kwargs.get("path")
    config = os.path.join(folder, "config.json") if isinstance(folder, str) else None
    what = {"model": m.name, "kwargs": kwargs,
            "files": [file_state(os.path.abspath(f)) for f in files] if files is not None else None,
            "config": file_state(os.path.abspath(config)) if config and os.path.isfile(config) else None,
            "seed": cfg.train.seed if files is None else None, "precision": cfg.train.precision,
            "mixed_precision": cfg.parallel.mixed_precision, "logits": cfg.train.logits, "version": __version__}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _pair_tensors(chunk: dict[str, np.ndarray], device: torch.device) -> Batch:
    """A chunk of the dataset's pair rows as the engine's batch (token ids as int64)."""
    batch = {k: torch.from_numpy(np.array(v)).to(device) for k, v in chunk.items()}  # copied: Arrow's are read-only
    return {k: v.long() if k.endswith("_tokens") else v for k, v in batch.items()}


def _say(env: DistEnv, text: str, notes: str | None) -> None:
    """Rank 0's line about the pass: printed, and added to the run directory's notes.log
    (`notes`), which `rtp train`'s driver echoes (a Ray worker's stdout reaches it only
    with --verbose)."""
    if env.is_rank0:
        print(f"reference log-probs: {text}", flush=True)
        if notes:
            append_note(notes, f"reference log-probs: {text}")


def _score(reference: _Reference, cfg: JobConfig, env: DistEnv, prepared: str,
           notes: str | None) -> tuple[np.ndarray, ...]:
    """This rank's share of every pair's reference log-probs: (sample ids, chosen,
    rejected). Each data-parallel rank scores a contiguous share of each split, in
    micro-batches; every rank runs the same number of forwards (a sharded forward is a
    collective), a rank short of a round re-scoring the split's first micro-batch."""
    dims = ParallelDims.from_config(cfg)
    dp, rank, mb = dims.dp, dims.data_rank(env.rank), cfg.data.micro_batch
    counted = cfg.train.logits == "counted"
    sizes = {split: pair_count(prepared, split) for split in ("train", "val")}
    total, done = sum(sizes.values()), 0
    shown = started = time.monotonic()
    _say(env, f"scoring {sizes['train']} train and {sizes['val']} validation pairs once "
              f"(train.dpo.precompute_reference), {dp} data-parallel rank(s)", notes)
    ids, chosen, rejected = [], [], []
    for split, n in sizes.items():
        if not n:
            continue
        rounds = -(-(-(-n // mb)) // dp)  # micro-batches per data-parallel rank
        lo, hi = min(n, rank * rounds * mb), min(n, (rank + 1) * rounds * mb)
        chunks, pad = pair_chunks(prepared, split, lo, hi, mb), None
        for _ in range(rounds):
            chunk = next(chunks, None)
            real = chunk is not None
            if chunk is None:
                pad = pad if pad is not None else next(pair_chunks(prepared, split, 0, min(n, mb), mb))
                chunk = pad
            inputs, targets = pair_inputs(_pair_tensors(chunk, env.device))
            c, r = reference.logps(inputs, targets, counted_rows(targets) if counted else None)
            if real:
                ids.append(chunk["sample_id"])
                chosen.append(c.float().cpu().numpy())
                rejected.append(r.float().cpu().numpy())
            done += len(chunk["sample_id"]) * dp if real else 0
            if env.is_rank0 and time.monotonic() - shown > 10:
                shown = time.monotonic()
                _say(env, f"{min(done, total)}/{total} pairs, {time.monotonic() - started:.0f} s", notes)
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32)
    return tuple(np.concatenate(a) for a in (ids, chosen, rejected))


def precompute_reference(cfg: JobConfig, env: DistEnv, *, family: ModelFamily, task: Task, prepared: str,
                         autocast: ContextManager, lora_policy: Parallelized | None = None,
                         notes: str | None = None) -> ReferenceLogps:
    """The reference log-probs of every pair of the dataset `prepared`
    (``train.dpo.precompute_reference``): the table kept with it where one was written
    for this reference (`reference_key`), else one pass that builds the reference (or
    switches off `lora_policy`'s adapters), scores every pair on every rank's share,
    writes the table (rank 0) and lets the reference go. Called on every rank; rank 0's
    lines also go to the run directory `notes` (`_say`)."""
    # rank 0's key for every rank: nodes with their own copy of the weights see other mtimes
    key = all_gather_objects(reference_key(cfg, family))[0]
    found = ReferenceLogps.find(prepared, key)
    # every rank must agree on the pass (its forwards are collectives)
    if all(all_gather_objects(found is not None)):
        assert found is not None
        _say(env, f"{len(found)} pairs found in {found.path}; no reference model is built", notes)
        return found
    started = time.monotonic()
    reference = _Reference(cfg, env, family=family, task=task, head=cfg.train.logits == "counted",
                           autocast=autocast, lora_policy=lora_policy)
    mine = _score(reference, cfg, env, prepared, notes)
    del reference
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    parts = all_gather_objects(mine)  # every rank checks the count: none waits on a failed rank 0
    ids, first = np.unique(np.concatenate([p[0] for p in parts]), return_index=True)
    expected = pair_count(prepared, "train") + pair_count(prepared, "val")
    copies = env.world_size // ParallelDims.from_config(cfg).dp  # a tensor-parallel group scores its pairs once each
    scored = sum(len(p[0]) for p in parts)
    if len(ids) != expected or scored != expected * copies:
        raise DataError(f"{prepared}: the reference pass scored {len(ids)} distinct pairs ({scored} in all) of the "
                        f"dataset's {expected}; delete {prepared} to tokenize it again")
    failed = None
    if env.is_rank0:
        values = [np.concatenate([p[i] for p in parts])[first] for i in (1, 2)]
        try:
            path = write_reference(prepared, key, ids, *values)
            _say(env, f"{len(ids)} pairs scored in {time.monotonic() - started:.0f} s, kept in {path}", notes)
        except OSError as exc:
            failed = f"{prepared}: the reference log-probs cannot be written there ({exc})"
    failed = all_gather_objects(failed)[0]  # every rank waits for the write, and hears of its failure
    if failed:
        raise DataError(failed)
    table = ReferenceLogps.find(prepared, key)
    missing = [rank for rank, ok in enumerate(all_gather_objects(table is not None)) if not ok]
    if missing:
        raise DataError(f"rank(s) {missing} cannot read the reference log-probs rank 0 wrote in {prepared}: "
                        "data.cache_path (default <run.storage_path>/datasets) must be storage every node reads")
    assert table is not None
    return table


class PreferenceObjective:
    """DPO on the engine's policy `wrapped`: `loss_sum` per micro-batch, its metrics
    summed until `window_metrics` reports them, `eval_sums` for validation. `head` is the
    policy's output head to run on counted positions only (None: every position).

    With ``precompute_reference``, the log-probs come from `table` (`precompute_reference`'s,
    found or computed before the policy was built), or from each batch where there is no
    table; a LoRA run with ``reference: auto`` computes its table here, with the policy's
    adapters off, where `prepared` (the tokenized dataset) is given and `table` is not."""

    def __init__(self, cfg: JobConfig, env: DistEnv, *, family: ModelFamily, task: Task, wrapped: Parallelized,
                 head: torch.nn.Module | None, autocast: ContextManager, table: ReferenceLogps | None = None,
                 prepared: str | None = None, notes: str | None = None):
        self.dpo, self.env, self.task, self.wrapped, self.head = cfg.train.dpo, env, task, wrapped, head
        self.autocast = autocast
        lora_base = policy_is_reference(cfg)
        self.table, self.reference = table, None
        if self.dpo.precompute_reference:
            if table is None and prepared is not None:
                self.table = precompute_reference(cfg, env, family=family, task=task, prepared=prepared,
                                                  autocast=autocast, lora_policy=wrapped if lora_base else None,
                                                  notes=notes)
        else:
            self.reference = _Reference(cfg, env, family=family, task=task, head=head is not None,
                                        autocast=autocast, lora_policy=wrapped if lora_base else None)
        self._sums = torch.zeros(_SUMS, device=env.device)  # since the last report

    @staticmethod
    def rows(batch: Batch) -> torch.Tensor | None:
        """The counted rows of the micro-batch's ``[chosen; rejected]`` targets (`counted_rows`)."""
        return counted_rows(pair_inputs(batch)[1])

    @staticmethod
    def tokens_per_pair(batch: Batch) -> int:
        """Tokens one pair puts through the forward (what tokens/s counts)."""
        return 2 * (batch["chosen_tokens"].shape[1] - 1)

    def reference_logps(self, batch: Batch, inputs: torch.Tensor, targets: torch.Tensor,
                        rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's log-probs of the chosen and of the rejected responses, ``(B,)`` each."""
        if REF_KEYS[0] in batch:
            return batch[REF_KEYS[0]].float(), batch[REF_KEYS[1]].float()
        if self.table is not None:
            chosen, rejected = self.table.lookup(batch["sample_id"].cpu().numpy())
            return (torch.from_numpy(chosen).to(inputs.device).float(),
                    torch.from_numpy(rejected).to(inputs.device).float())
        if self.reference is None:
            raise KeyError(f"a precomputing run's batches carry {', '.join(REF_KEYS)} (train.dpo.precompute_reference "
                           "without a tokenized dataset to score)")
        return self.reference.logps(inputs, targets, rows)

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
        """This rank's bytes of the reference model's parameters (its shards), when a copy is held."""
        if self.reference is None or self.reference.copy is None:
            return {}
        return {"ref_param_bytes": sum(local_tensor(p).nbytes for p in self.reference.copy.module.parameters())}

    def window_metrics(self) -> dict[str, float]:
        """The rewards and log-probs since the last report, means over every rank's pairs
        (a TP group's copies count each pair as often as its loss); resets the sums."""
        sums = all_reduce_sum(self._sums.clone()).cpu()
        self._sums.zero_()
        metrics = pair_metrics(sums)
        del metrics["loss"]  # the engine's loss is the same mean, from the step's own all-reduce
        return metrics
