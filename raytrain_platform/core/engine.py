"""The training core: model -> strategy -> loop with gradient accumulation.

Runs the same under Ray Train (launch/worker.py) and under plain torchrun
(core/__main__.py): data comes from a `BatchSource`, metrics and checkpoints
leave through a `Reporter`, and nothing here imports Ray.

One optimizer step = ``grad_accum_steps`` micro-steps per rank. Every micro-step
but the last runs under the strategy's ``no_sync()`` (no gradient all-reduce),
and each micro-batch's summed loss is divided by the step's count of targets over
all data-parallel ranks and micro-steps (`Engine.loss_scale`), so the step's gradient
is the mean over every counted target of the global batch, whatever the split into
ranks and micro-steps, also when a loss mask counts different tokens in each.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from pathlib import Path
from types import EllipsisType
from typing import Any, Callable, Iterator, Protocol

import torch

from raytrain_platform.core.build import build_model
from raytrain_platform.core.checkpoint import TrainState, load_checkpoint, save_checkpoint
from raytrain_platform.core.counted import counted_positions, counted_rows
from raytrain_platform.core.dist import DistEnv, all_reduce_sum
from raytrain_platform.core.nonfinite import NonFiniteGuard
from raytrain_platform.core.optim import build_optimizer, lr_at
from raytrain_platform.core.preference import PreferenceObjective, policy_is_reference, precompute_reference
from raytrain_platform.core.profile import StepProfiler
from raytrain_platform.data.dealing import EVAL_PAD
from raytrain_platform.models.registry import get_family
from raytrain_platform.models.tasks import get_task
from raytrain_platform.parallel.dims import ParallelDims
from raytrain_platform.parallel.memory import state_bytes
from raytrain_platform.resolve import ResolvedJob
from raytrain_platform.core.rundir import TRACKING_FILE, MetricsLog
from raytrain_platform.tracking.steps import open_step_trackers

__all__ = ["BatchSource", "Reporter", "Engine", "run_training"]

Batch = dict[str, torch.Tensor]


class BatchSource(Protocol):
    def train_epoch(self, epoch: int) -> Iterator[Batch]:
        """This rank's micro-batches of `epoch`, in order."""

    def val_batches(self, n: int) -> list[Batch]:
        """This rank's first `n` validation micro-batches (the same every call)."""


class Reporter(Protocol):
    def report(self, metrics: dict, save: Callable[[str], None] | None) -> None:
        """Called on every rank at the same steps; `save(dir)` writes this rank's
        part of a checkpoint when one is due."""


def _seed_for(seed: int, step: int, rank: int) -> int:
    # Dropout and other randomness depend on (seed, step, rank) only: a resumed
    # run draws the same numbers as an uninterrupted one.
    return (seed * 1_000_003 + step * 7919 + rank) % (2**63)


def _reseed(seed: int, device: torch.device) -> None:
    # Not torch.manual_seed: on a CPU-only build it also queues a lazy CUDA seeding that
    # records a Python stack trace, every step (a fifth of a small model's step time).
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # this worker's device only


class Engine:
    def __init__(self, job: ResolvedJob, env: DistEnv, *, run_dir: str | None = None,
                 profiler: StepProfiler | None = None, resuming: bool = False):
        self.job, self.cfg, self.env = job, job.config, env
        self.run_dir = run_dir
        self.profiler = profiler  # `rtp doctor`'s measured runs (core/profile.py)
        self.family = get_family(self.cfg.model.name)
        self.task = get_task(self.cfg.model.resolved_task, self.cfg.model.name)
        self.autocast = (torch.autocast(device_type=env.device.type, dtype=torch.bfloat16)
                         if self.cfg.train.precision == "bf16" else contextlib.nullcontext())
        t = self.cfg.train
        # train.dpo.precompute_reference: the reference scores the dataset's pairs before
        # the policy is built, so the two are never held at once (a LoRA run's reference is
        # the policy itself: PreferenceObjective scores with its adapters off)
        table = None
        if (t.objective == "dpo" and t.dpo.precompute_reference and job.data.prepared
                and not policy_is_reference(self.cfg)):
            table = precompute_reference(self.cfg, env, family=self.family, task=self.task,
                                         prepared=job.data.prepared, autocast=self.autocast, notes=run_dir)
        built = build_model(self.cfg, env, self.family, resuming=resuming)
        self.wrapped, self.param_counts, self.base = built.wrapped, built.param_counts, built.base
        # Data-parallel coordinates: ranks of one TP/PP group read the same micro-batches.
        dims = ParallelDims.from_config(self.cfg)
        self.data_world, self.data_rank = dims.dp, dims.data_rank(env.rank)
        self.optimizer = build_optimizer(self.wrapped.module, self.cfg.train)
        self.state = TrainState()
        self._memory: dict[str, int] | None = None  # measured once, at the first optimizer step
        self._config_yaml = self.cfg.to_yaml()
        self.nonfinite = NonFiniteGuard(policy=t.on_nonfinite, max_skips=t.max_nonfinite_skips,
                                        run_dir=run_dir or self.cfg.run.run_dir)
        self.step_skipped = False  # the last optimizer step was skipped (train.on_nonfinite)
        # train.logits counted: the output head runs on the counted tokens only (core/counted.py)
        counted = (self.task.name == "lm" and t.logits == "counted" and self.wrapped.pipeline is None)
        self.head = self.family.output_head(self.wrapped.base) if counted else None
        # A mixture of experts' router load-balancing loss, when its config asks for it:
        # weighted into what backward sees, logged apart from the loss (`aux_loss`).
        self.aux_coef = self.family.aux_loss_coef(self.cfg.model.kwargs)
        self._aux_sum = torch.zeros((), device=env.device)  # unweighted, since the last report
        self._aux_count = 0
        # train.objective dpo: pairs of responses, a reference model (core/preference.py)
        self.preference = (PreferenceObjective(self.cfg, env, family=self.family, task=self.task,
                                               wrapped=self.wrapped, head=self.head, autocast=self.autocast,
                                               table=table, prepared=job.data.prepared, notes=run_dir)
                           if t.objective == "dpo" else None)

    # ------------------------------------------------------------ state

    @property
    def split(self) -> bool:
        """Whether the data-parallel ranks share out each epoch's micro-batches (else each
        reads them all: data.split_across_workers false)."""
        return self.cfg.data.split_across_workers

    def restore(self, directory: str) -> None:
        self.state = load_checkpoint(directory, wrapped=self.wrapped, optimizer=self.optimizer,
                                     device=self.env.device, world_size=self.data_world,
                                     batch_size=self.cfg.data.micro_batch, split=self.split,
                                     epoch_rows=self.job.steps_per_epoch * self.cfg.train.grad_accum_steps
                                     * (self.data_world if self.split else 1) * self.cfg.data.micro_batch,
                                     base=self.base)

    def save(self, directory: str, metrics: dict) -> None:
        self.nonfinite.check_weights(self.wrapped.module, step=self.state.step)  # never save NaN weights
        save_checkpoint(directory, wrapped=self.wrapped, optimizer=self.optimizer, state=self.state,
                        lr=self.optimizer.param_groups[0]["lr"], config_yaml=self._config_yaml,
                        metrics=metrics, is_rank0=self.env.is_rank0,
                        world_size=self.data_world, batch_size=self.cfg.data.micro_batch, split=self.split,
                        base=self.base)
        self.nonfinite.saved(self.state.step)

    # ------------------------------------------------------------ steps

    def _to_device(self, batch: Batch) -> Batch:
        out = {}
        for k, v in batch.items():
            if k == "tokens" or k.endswith("_tokens"):
                v = v.long()  # stored as uint8 bytes (a DPO pair's chosen_tokens, rejected_tokens: ids)
            out[k] = v.to(self.env.device, non_blocking=True)
        return out

    def loss_scale(self, batches: list[Batch]) -> float:
        """What each micro-batch's summed loss is multiplied by: data-parallel size over
        the optimizer step's counted targets on all data-parallel ranks. DDP and FSDP
        average gradients over those ranks, so the step's gradient is the mean over every
        counted target of the global batch, whatever the layout or accumulation. DPO counts
        pairs: the step's gradient is the mean over its pairs."""
        if self.preference is not None:
            local = sum(int(b["sample_id"].numel()) for b in batches)
        else:
            local = sum(self.task.num_targets(self.task.split(b)[1]) for b in batches)
            if "loss_mask" not in batches[0]:  # every rank counts the same number
                return 1.0 / max(local, 1)
        # Masked targets differ per rank: one scalar all-reduce. TP/PP ranks of one
        # data-parallel group hold the same batch, so the world sum counts it `copies` times.
        copies = self.env.world_size // self.data_world
        total = float(all_reduce_sum(torch.tensor(float(local), device=self.env.device))) / copies
        return self.data_world / max(total, 1.0)

    def _head_for(self, batch: Batch) -> torch.nn.Module | None:
        """The output head to run on counted tokens only: with a loss mask, or on DPO pairs
        (without one, every token counts)."""
        return self.head if "loss_mask" in batch or self.preference is not None else None

    def _rows(self, batch: Batch) -> torch.Tensor | None:
        """The counted rows for the output head (`counted_rows`), None for every position."""
        head = self._head_for(batch)
        if head is None:
            return None
        return self.preference.rows(batch) if self.preference is not None else counted_rows(self.task.split(batch)[1])

    def micro_step(self, batch: Batch, *, sync: bool, scale: float | None = None,
                   rows: torch.Tensor | None | EllipsisType = ...) -> torch.Tensor:
        """Forward and backward of one micro-batch; its loss times `scale` (default: the
        mean over this micro-batch alone, for a step of one micro-batch). `rows`: the
        output head's counted rows (`_rows`; default: taken here)."""
        scale = self.loss_scale([batch]) if scale is None else scale
        if self.preference is not None:  # a pair's chosen and rejected in one forward, with the reference's
            with contextlib.nullcontext() if sync else self.wrapped.no_sync():
                pair_loss, outputs = self.preference.loss_sum(batch, self._rows(batch) if rows is ... else rows)
                loss = pair_loss * scale
                aux = self._aux_loss(outputs)
                (loss if aux is None else loss + aux).backward()
            return loss.detach()
        inputs, targets = self.task.split(batch)
        if self.wrapped.pipeline is not None:  # PP: the schedule runs forward and backward
            with self.autocast:
                return self.wrapped.pipeline.train(
                    inputs, targets, lambda out, tgt: self.task.loss_sum(out, tgt) * scale, sync=sync)
        with contextlib.nullcontext() if sync else self.wrapped.no_sync():
            with self.autocast, counted_positions(self._head_for(batch), targets, rows) as kept:
                outputs = self.wrapped.module(inputs, **self.task.forward_kwargs(batch))
                loss = self.task.loss_sum(outputs, kept.targets(self.task.logits(outputs))) * scale
            aux = self._aux_loss(outputs)
            (loss if aux is None else loss + aux).backward()
        return loss.detach()

    def _aux_loss(self, outputs: Any) -> torch.Tensor | None:
        """The auxiliary loss term of one micro-batch for backward: the model's own
        ``aux_loss`` times its coefficient, over the step's micro-batches (each data-
        parallel rank's gradients are then averaged as the loss's are); None without one."""
        raw = getattr(outputs, "aux_loss", None) if self.aux_coef else None
        if raw is None:
            return None
        self._aux_sum += raw.detach().float()
        self._aux_count += 1
        return raw * (self.aux_coef / self.cfg.train.grad_accum_steps)

    def optimizer_step(self, loss_sum: torch.Tensor | None = None, units: int = 0) -> float:
        """Clip, check the step is finite (`NonFiniteGuard`: stop, or skip the update and
        set `step_skipped`; its all-reduce also sums the loss and `units` over the ranks,
        `nonfinite.totals`), update, zero the gradients; returns the gradient norm."""
        lr = lr_at(self.state.step, self.cfg.train, self.job.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = 0.0
        if self.cfg.train.grad_clip > 0 and self.wrapped.clip_grad_norm is not None:  # TP / PP
            grad_norm = self.wrapped.clip_grad_norm(self.cfg.train.grad_clip)
        elif self.cfg.train.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.wrapped.module.parameters(), self.cfg.train.grad_clip)
            full = getattr(norm, "full_tensor", None)  # a DTensor (FSDP2): the global norm
            grad_norm = float(full() if full else norm)
        clipped = self.cfg.train.grad_clip > 0
        self.step_skipped = not self.nonfinite.step_ok(
            torch.zeros(()) if loss_sum is None else loss_sum, grad_norm if clipped else None,
            self.wrapped.module.parameters(), step=self.state.step + 1, units=units)
        if self.step_skipped:  # weights and optimizer state stay as they were
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm
        self.optimizer.step()
        if self._memory is None:  # params, grads and optimizer state all exist right now
            self._memory = self._measure_memory()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _measure_memory(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state: exact, from
        the local shards (a DTensor counts only its ``to_local()`` part)."""
        held = state_bytes(self.wrapped.module, self.optimizer)
        reference = {} if self.preference is None else self.preference.memory()
        return {"param_bytes": held["params"], "grad_bytes": held["grads"],
                "optim_bytes": held["optimizer"], **reference, **self.param_counts}

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        """Validation metrics over every rank's `batches`: loss, count and correct summed
        over them and over the ranks, then divided (a token-weighted mean for an LM). A
        batch marked `EVAL_PAD` runs (its forward is a collective) and adds nothing."""
        self.wrapped.module.eval()
        if self.preference is not None:
            metrics = self.preference.evaluate(batches, self._to_device)
            self.wrapped.module.train()
            return metrics
        sums = torch.zeros(3)
        for batch in batches:
            counts = not batch.get(EVAL_PAD)
            batch = self._to_device({k: v for k, v in batch.items() if k != EVAL_PAD})
            inputs, targets = self.task.split(batch)
            with self.autocast:
                if self.wrapped.pipeline is not None:  # sums on the last stage, zeros before it
                    part = self.wrapped.pipeline.evaluate(inputs, targets, self.task.eval_sums).cpu()
                    sums += part if counts else 0
                    continue
                with counted_positions(self._head_for(batch), targets) as kept:
                    outputs = self.wrapped.module(inputs, **self.task.forward_kwargs(batch))
                targets = kept.targets(self.task.logits(outputs))
            part = self.task.eval_sums(outputs, targets).cpu()
            sums += part if counts else 0
        self.wrapped.module.train()
        return self.task.eval_metrics(all_reduce_sum(sums.to(self.env.device)).cpu())

    # ------------------------------------------------------------ loop

    def _epoch_iter(self, source: BatchSource) -> Iterator[Batch]:
        """Micro-batches from the current data position to the end of the epoch's whole steps."""
        usable = self.job.steps_per_epoch * self.cfg.train.grad_accum_steps
        it = iter(source.train_epoch(self.state.epoch))
        skip = self.state.batches_in_epoch
        return itertools.islice(it, skip, usable)

    def _step_batches(self, it: Iterator[Batch], accum: int) -> tuple[list[Batch], float]:
        """The optimizer step's micro-batches on the device (fewer at the epoch's end),
        and the seconds spent waiting for them."""
        batches, wait = [], 0.0
        for _ in range(accum):
            t0 = time.perf_counter()
            batch = next(it, None)
            wait += time.perf_counter() - t0
            if batch is None:
                break
            batches.append(self._to_device(batch))
        return batches, wait

    def _due(self, every: int, last: bool) -> bool:
        return last or (every > 0 and self.state.step % every == 0)

    def _steps(self, source: BatchSource) -> Iterator[tuple[list[Batch], float, float]]:
        """Whole optimizer steps from the current data position on, epoch after epoch:
        (micro-batches on the device, when the step began waiting for them, the seconds
        it waited). Each step's randomness is seeded before its batches are read."""
        accum = self.cfg.train.grad_accum_steps
        it = self._epoch_iter(source)
        while True:
            _reseed(_seed_for(self.cfg.train.seed, self.state.step, self.data_rank), self.env.device)
            started = time.perf_counter()
            batches, data_wait = self._step_batches(it, accum)
            if len(batches) == accum:
                yield batches, started, data_wait
                continue
            # the epoch's whole steps are done (only whole steps are dealt, so nothing is left)
            self.state.epoch, self.state.batches_in_epoch = self.state.epoch + 1, 0
            it = self._epoch_iter(source)

    def fit(self, source: BatchSource, reporter: Reporter, *, log: MetricsLog | None = None) -> dict:
        """Train from the current state to ``total_steps``: whole optimizer steps over each
        epoch's dealt micro-batches, with metrics, evaluation and checkpoints when due."""
        cfg, total = self.cfg, self.job.total_steps
        val_cache: list[Batch] | None = None  # read once, at the first evaluation
        last_metrics: dict = {}
        self.wrapped.module.train()
        if self.state.batches_in_epoch >= self.job.steps_per_epoch * cfg.train.grad_accum_steps:
            self.state.epoch, self.state.batches_in_epoch = self.state.epoch + 1, 0  # resumed at an epoch's end
        steps = self._steps(source)
        t_prev = time.perf_counter()
        window = {"steps": 0, "wait": 0.0, "units": 0}  # since the last report
        while self.state.step < total:
            comm_before = self.wrapped.comm.calls
            batches, started, data_wait = next(steps)
            grad_norm = self.train_step(batches, started=started, data_wait=data_wait)
            window["steps"] += 1
            window["wait"] += data_wait
            window["units"] += self.nonfinite.totals[1]  # the step's, over all ranks
            last = self.state.step == total
            if not (self._due(cfg.run.log_every, last) or self._due(cfg.run.eval_every, last)
                    or self._due(cfg.run.checkpoint_every, last)):
                continue
            metrics = self._step_metrics(time.perf_counter() - t_prev, window, grad_norm,
                                         self.wrapped.comm.calls - comm_before)
            if self._due(cfg.run.eval_every, last) and self.job.data.num_val:
                t_eval = time.perf_counter()
                if val_cache is None:
                    val_cache = source.val_batches(cfg.run.eval_batches)
                metrics.update(self.evaluate(val_cache))
                metrics["eval_s"] = time.perf_counter() - t_eval  # the first one also reads the batches
            self._publish(metrics, reporter, log, checkpoint=self._due(cfg.run.checkpoint_every, last))
            last_metrics = metrics
            t_prev = time.perf_counter()
            window = {"steps": 0, "wait": 0.0, "units": 0}
        if self.profiler:
            self.profiler.finish(rank=self.env.rank, world_size=self.env.world_size,
                                 data_rank=self.data_rank, run_dir=self.run_dir)
        return last_metrics

    def train_step(self, batches: list[Batch], *, started: float, data_wait: float) -> float:
        """One optimizer step over its micro-batches (on the device): forward and backward
        each, sync the gradients, update, and advance the state; a profiled step records
        its phases (`started` is when the step began waiting for `batches`, `data_wait`
        how long it waited). Returns the gradient norm; the step's loss and units (tokens,
        rows) summed over the ranks are `nonfinite.totals`."""
        accum, profiler = self.cfg.train.grad_accum_steps, self.profiler
        assert len(batches) == accum, "a whole step: fit deals only whole steps"
        mode = profiler.mode(self.state.step) if profiler else None
        # breakdown steps sync gradients after backward, where the strategy can
        sync_grads = self.wrapped.sync_grads if mode == "breakdown" else None
        apart = sync_grads is not None
        loss_sum, n_units, compute = torch.zeros((), device=self.env.device), 0, 0.0
        scale = self.loss_scale(batches)
        rows = [self._rows(batch) for batch in batches]  # where loss_scale waits for the device anyway
        for micro, batch in enumerate(batches):
            if profiler and mode:
                profiler.see(self.state.epoch, batch["sample_id"])
            n_units += batch["sample_id"].numel() * (self.task.units_per_sample(batch) if self.preference is None
                                                     else self.preference.tokens_per_pair(batch))
            t1 = time.perf_counter()
            loss_sum += self.micro_step(batch, scale=scale, sync=micro == accum - 1 and not apart,
                                        rows=rows[micro])
            compute += self._since(t1, mode)
        t2 = time.perf_counter()
        if sync_grads is not None:
            sync_grads()
        comm = self._since(t2, mode)
        t3 = time.perf_counter()
        grad_norm = self.optimizer_step(loss_sum, n_units)
        if profiler and mode:
            profiler.record(step=self.state.step, mode=mode, data_wait_s=data_wait,
                            compute_s=compute, comm_s=comm if apart else None,
                            optimizer_s=self._since(t3, mode), step_s=self._since(started, mode),
                            samples=accum * self.cfg.data.micro_batch)
        self.state.step += 1
        self.state.batches_in_epoch += accum
        self.state.samples_seen += self.job.global_batch
        return grad_norm

    def _publish(self, metrics: dict, reporter: Reporter, log: MetricsLog | None, *, checkpoint: bool) -> None:
        """Log the metrics (rank 0) and report them, with a checkpoint when one is due and
        this step updated the weights (a skipped non-finite step saves nothing)."""
        save = None
        if checkpoint and not self.step_skipped:
            save = lambda d, m=metrics: self.save(d, m)  # noqa: E731
        if log is not None and self.env.is_rank0:
            log.append(metrics)
        reporter.report(metrics, save)

    def _since(self, t0: float, mode: str | None) -> float:
        """Seconds since `t0`; when profiling, after the device has finished its queued work."""
        if mode and self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
        return time.perf_counter() - t0

    def _step_metrics(self, elapsed: float, window: dict, grad_norm: float, comm_calls: int) -> dict:
        """Metrics of the step just taken; rates over the steps since the last report
        (`elapsed` seconds, which include the time spent waiting for data). The loss is
        the whole global batch's, not rank 0's part: summed over the ranks by the step's
        one all-reduce (`NonFiniteGuard`), as are `window`'s units, so reporting adds none.
        Each data-parallel group's loss and units are counted on `copies` ranks (TP/PP)."""
        loss_total = self.nonfinite.totals[0]
        steps = window["steps"]
        copies = self.env.world_size // self.data_world
        step_time = elapsed / steps
        samples = self.job.global_batch * steps
        metrics = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "loss": loss_total / (self.wrapped.loss_ranks or self.env.world_size),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm,
            "samples_per_s": samples / elapsed,
            "step_time_s": step_time,
            "data_wait_frac": min(1.0, window["wait"] / elapsed),
            "grad_allreduces": comm_calls,
            "samples_seen": self.state.samples_seen,
            **({"nonfinite_skips": self.nonfinite.skipped}
               if self.cfg.train.on_nonfinite == "skip_step" else {}),
        }
        if self.task.name == "lm":
            metrics["tokens_per_s"] = window["units"] / copies / elapsed
        if self.aux_coef:  # the mean over the window's micro-batches and ranks (TP copies alike)
            total = all_reduce_sum(torch.stack([self._aux_sum, torch.tensor(float(self._aux_count),
                                                                            device=self.env.device)]))
            metrics["aux_loss"] = float(total[0]) / max(float(total[1]), 1.0)
            self._aux_sum.zero_()
            self._aux_count = 0
        if self.preference is not None:
            metrics.update(self.preference.window_metrics())
        metrics.update(self._memory or {})
        if self.env.device.type == "cuda":
            metrics["peak_mem_bytes"] = torch.cuda.max_memory_allocated(self.env.device)
        return metrics


def run_training(job: ResolvedJob, env: DistEnv, *, source: BatchSource, reporter: Reporter,
                 resume_dir: str | None, run_dir: str | None,
                 profiler: StepProfiler | None = None) -> dict:
    """Build, restore if asked, train to the end; returns the last reported metrics."""
    engine = Engine(job, env, run_dir=run_dir, profiler=profiler, resuming=bool(resume_dir))
    if resume_dir:
        engine.restore(resume_dir)
    log = trackers = None
    if run_dir and env.is_rank0:  # rank 0 writes metrics.jsonl, then feeds run.tracking's trackers
        trackers = open_step_trackers(job.config.run.tracking, run_dir=run_dir, resume_step=engine.state.step,
                                      state_file=Path(run_dir) / TRACKING_FILE, world_size=env.world_size)
        log = MetricsLog(run_dir, resume_step=engine.state.step, on_append=trackers.log)
    try:
        return engine.fit(source, reporter, log=log)
    finally:
        if trackers is not None:
            trackers.close()
