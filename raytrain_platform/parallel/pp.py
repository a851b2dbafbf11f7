"""Pipeline parallelism for `gpt` with ``torch.distributed.pipelining``, then DDP or
FSDP over the data-parallel dimension (PP x DP).

The blocks are split into stages (balanced by block count, or ``pp_split``); stage 0
also holds the embeddings, the last stage the final norm and LM head. Each rank keeps
only its stages' modules (the others are deleted: the memory PP saves). Schedules:
GPipe (all forwards, then all backwards), 1F1B (one forward, one backward in the
steady state: at most pp_size micro-batches of activations alive) and interleaved
1F1B (2 stages per rank, looped: a smaller bubble). Each micro-batch is cut into
``pp_microbatches`` chunks; the loss is computed on the last stage only.

Gradient scaling: the schedule's own ``scale_grads`` would divide *all* gradients
after every step, including those accumulated over earlier micro-steps; here the
loss of each chunk is divided by the chunk count instead (``scale_grads=False``), so
gradient accumulation across micro-steps stays a plain sum.

Run it (Ray absent)::

    torchrun --nproc-per-node 2 -m raytrain_platform.core --config pipelines/configs/quickstart.yaml \\
        --set parallel.pp_size=2 --set parallel.pp_schedule=gpipe
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from raytrain_platform.parallel.base import CommCounter, Parallelized
from raytrain_platform.parallel.ddp import allreduce_grads
from raytrain_platform.parallel.dims import PP_SCHEDULES, stage_blocks
from raytrain_platform.parallel.grads import clip_grad_norm

__all__ = ["apply_pp", "PipelineRunner"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _prune(model: nn.Module, blocks: range, *, first: bool, last: bool) -> nn.Module:
    """`model` (a GPT) keeping only `blocks` (original names) and the ends it owns."""
    for name in list(model.blocks):  # type: ignore[attr-defined]
        if int(name) not in blocks:
            del model.blocks[name]  # type: ignore[attr-defined]
    if not first:
        model.wte = model.wpe = None
    if not last:
        model.ln_f = model.lm_head = None
    return model


def _merge(parts: list[nn.Module]) -> nn.Module:
    """One module holding every local stage's parts under their original names: what
    the optimizer steps and the checkpoint saves (``blocks.5.attn...``, as unsplit)."""
    holder = nn.Module()
    holder.blocks = nn.ModuleDict({k: b for p in parts for k, b in p.blocks.items()})  # type: ignore[attr-defined]
    for attr in ("wte", "wpe", "ln_f", "lm_head"):
        owned = [getattr(p, attr) for p in parts if getattr(p, attr) is not None]
        if owned:
            setattr(holder, attr, owned[0])
    return holder


class _SummedCounter(CommCounter):
    """The gradient collectives of several stages' data-parallel wrappers together."""

    def __init__(self, counters: list[CommCounter]):  # noqa: D107 - no dataclass fields set
        self.counters = counters

    @property  # type: ignore[override]
    def calls(self) -> int:
        return sum(c.calls for c in self.counters)


class PipelineRunner:
    """What the engine calls instead of forward + backward: one schedule step over a
    micro-batch. Every rank of the pipeline calls it with the same batch."""

    def __init__(self, schedule, *, chunks: int, has_first: bool, has_last: bool, device):
        self.schedule, self.chunks = schedule, chunks
        self.has_first, self.has_last, self.device = has_first, has_last, device
        self.loss_fn: LossFn | None = None
        self.grad_sync: Callable[[], None] | None = None  # PP x DDP: all-reduce over dp

    def chunk_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.loss_fn is not None
        return self.loss_fn(output, target) / self.chunks

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, *,
              sync: bool = True) -> torch.Tensor:
        """Forward and backward of the whole micro-batch; returns the summed (already
        scaled) loss on last-stage ranks, 0 elsewhere. With `sync` (the optimizer step's
        last micro-step) a replicated stage's gradients are averaged over the dp group."""
        self.loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        self.schedule.step(*args, target=targets if self.has_last else None,
                           losses=losses if self.has_last else None)
        if sync and self.grad_sync is not None:
            self.grad_sync()
        if not self.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([x.detach() for x in losses]).sum()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 sums_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Forward only; `sums_fn(outputs, targets)` on the last stage, zeros elsewhere."""
        # The schedule computes its loss on the last stage whenever it has a loss_fn:
        # it gets the targets (the loss is discarded; `sums_fn` gives the metrics).
        outputs = self.schedule.eval(*((inputs,) if self.has_first else ()),
                                     target=targets if self.has_last else None,
                                     losses=[] if self.has_last else None)
        if not self.has_last:
            return torch.zeros(3, device=self.device)
        return sums_fn(outputs, targets)


def _counted_allreduce(model: nn.Module, group, counter: CommCounter) -> Callable[[], None]:
    def sync() -> None:
        counter.calls += 1
        allreduce_grads(model, group)
    return sync


def _schedule(name: str, stages: list[PipelineStage], n_chunks: int, loss_fn: LossFn):
    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_chunks, loss_fn=loss_fn, scale_grads=False)
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return cls(stages[0], n_chunks, loss_fn=loss_fn, scale_grads=False)


def _data_parallel(part: nn.Module, *, env, cfg, mesh: DeviceMesh) -> Parallelized:
    """FSDP over the dp mesh; or for 'ddp', a replica whose gradients `PipelineRunner`
    all-reduces over the dp group once per optimizer step (a stage wrapped in
    DistributedDataParallel hung in its first p2p exchange under gloo, torch 2.13)."""
    if mesh["dp"].size() > 1 and cfg.strategy == "fsdp":
        from raytrain_platform.parallel.fsdp import apply_fsdp

        return apply_fsdp(part, env=env, cfg=cfg, mesh=mesh["dp"])
    return Parallelized(module=part, base=part)


def apply_pp(model: nn.Module, *, env, cfg, mesh: DeviceMesh) -> Parallelized:
    """This rank's stage(s) of `model`, data-parallel over ``mesh["dp"]``, and the
    schedule that runs them (`Parallelized.pipeline`)."""
    pp_mesh = mesh["pp"]
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    per_rank = PP_SCHEDULES[cfg.pp_schedule]
    n_stages = pp * per_rank
    ranges = stage_blocks(len(model.blocks), n_stages, cfg.pp_split)  # type: ignore[arg-type]
    stage_ids = [rank + k * pp for k in range(per_rank)]  # looped: rank r holds r, r + pp, ...
    parts = []
    for sid in stage_ids:
        part = model if per_rank == 1 else copy.deepcopy(model)
        parts.append(_prune(part, ranges[sid], first=sid == 0, last=sid == n_stages - 1))
    wrapped = [_data_parallel(p, env=env, cfg=cfg, mesh=mesh) for p in parts]
    stages = [PipelineStage(w.module, sid, n_stages, env.device, group=pp_mesh.get_group())
              for w, sid in zip(wrapped, stage_ids)]
    chunks = cfg.pp_microbatches or pp
    runner = PipelineRunner(None, chunks=chunks, has_first=0 in stage_ids,
                            has_last=n_stages - 1 in stage_ids, device=env.device)
    runner.schedule = _schedule(cfg.pp_schedule, stages, chunks, runner.chunk_loss)
    holder = parts[0] if per_rank == 1 else _merge(parts)
    comm = wrapped[0].comm if per_rank == 1 else _SummedCounter([w.comm for w in wrapped])
    if mesh["dp"].size() > 1 and cfg.strategy == "ddp":
        runner.grad_sync = _counted_allreduce(holder, mesh["dp"].get_group(), comm)
    return Parallelized(
        module=holder, base=holder, sharded=True, comm=comm,
        clip_grad_norm=lambda max_norm: clip_grad_norm(holder.parameters(), max_norm,
                                                       stage_group=pp_mesh.get_group()),
        pipeline=runner, loss_ranks=mesh["dp"].size() * mesh["tp"].size())
