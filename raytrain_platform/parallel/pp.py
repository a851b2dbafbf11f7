"""Pipeline parallelism with ``torch.distributed.pipelining``, split where the model's
family says (`PipelineLayout`: gpt's blocks, embeddings first, norm and head last),
then DDP or FSDP over the data-parallel dimension (PP x DP, parallel/compose.py).

The blocks are split into stages (balanced by block count, or ``pp_split``); stage 0
also holds the embeddings, the last stage the final norm and LM head. Each rank keeps
only its stages' modules (the others are deleted: the memory PP saves). Schedules:
GPipe (all forwards, then all backwards), 1F1B (one forward, one backward in the
steady state: at most pp_size micro-batches of activations alive) and interleaved
1F1B (2 stages per rank, looped: a smaller bubble). Each micro-batch is cut into
``pp_microbatches`` chunks; the loss is computed on the last stage only.

A tied LM head (the embedding's weight: Llama 3.2 1B, the small Qwens) is one
parameter of the unsplit model, held by the first stage (the embedding) and the last
(the head). As Megatron does, the last stage keeps its own copy: both start equal
(the same seed, or the same tensor read from the files, where it is stored once, under
the embedding's name), their gradients are summed over the two stages before each
optimizer step, so both take the same update, and the gradient norm counts it once.
The checkpoint holds it under both names, as the unsplit model's state dict does.

With ``tp_size > 1`` too (TP x PP, parallel/compose.py), each stage is made tensor
parallel over ``mesh["tp"]`` by the family's plan (the entries for the modules it
holds) before FSDP wraps it; a rank exchanges activations with the rank of the same TP
index in the next stage, and a tied head's two copies, split alike by vocabulary, are
summed shard by shard.

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
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from raytrain_platform.errors import ConfigError
from raytrain_platform.parallel.base import CommCount, CommCounter, Parallelized
from raytrain_platform.parallel.dims import PP_SCHEDULES, stage_blocks
from raytrain_platform.parallel.grads import allreduce_grads, clip_grad_norm
from raytrain_platform.parallel.ties import shared_parameters
from raytrain_platform.models.family import PipelineLayout

__all__ = ["apply_pp", "PipelineRunner", "stage_plan"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _get(module: nn.Module, path: str, *, what: str = "pipeline layout path") -> nn.Module | None:
    """The submodule at a dotted `path` (a layout's names), None where a stage dropped
    it; a path the model lacks is an error (a layout's typo would drop a part silently)."""
    found: nn.Module | None = module
    for attr in path.split("."):
        if not hasattr(found, attr):
            raise ValueError(f"{what} {path!r}: {type(found).__name__} has no {attr!r}")
        found = getattr(found, attr)
        if found is None:
            return None
    return found


def _put(module: nn.Module, path: str, child: nn.Module | None, *, make_parents: bool = False) -> None:
    """Set the submodule at a dotted `path` of `module`, which must have it; or, with
    `make_parents` (a holder being filled), making empty parents where it lacks them."""
    *parents, attr = path.split(".")
    for name in parents:
        if make_parents and getattr(module, name, None) is None:
            module.add_module(name, nn.Module())
        module = getattr(module, name)
    if not make_parents and not hasattr(module, attr):
        raise ValueError(f"pipeline layout path {path!r}: {type(module).__name__} has no {attr!r}")
    setattr(module, attr, child)


def _prune(model: nn.Module, layout: PipelineLayout, blocks: range, *, first: bool, last: bool) -> nn.Module:
    """`model` keeping only `blocks` (original names) and the ends it owns."""
    container = model.get_submodule(layout.blocks)
    if not isinstance(container, nn.ModuleDict):
        raise TypeError(f"pipeline layout blocks {layout.blocks!r}: a ModuleDict keyed by block index, "
                        f"not {type(container).__name__}")
    for name in list(container):
        if int(name) not in blocks:
            del container[name]
    for path in (() if first else layout.first) + (() if last else layout.last):
        _put(model, path, None)
    return model


def stage_plan(part: nn.Module, plan: dict[str, str], layout: PipelineLayout) -> dict[str, str]:
    """A stage's entries of the whole model's tensor-parallel plan (TP x PP): those of
    the blocks it holds and of the ends it keeps. A path that names no module of the
    model is an error (`_get`), not left out silently."""
    blocks, prefix = {name for name, _ in part.get_submodule(layout.blocks).named_children()}, layout.blocks + "."
    held = {}
    for path, kind in plan.items():
        if path.startswith(prefix) and path[len(prefix):].split(".")[0] not in blocks:
            continue  # another stage's block
        if _get(part, path, what="tensor-parallel plan path") is not None:
            held[path] = kind
    return held


def _owner(name: str, layout: PipelineLayout) -> str:
    """Where a parameter lives in the split: "first", "last" or "blocks"."""
    def under(paths: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in paths)
    return "first" if under(layout.first) else "last" if under(layout.last) else "blocks"


def _tied_ends(model: nn.Module, layout: PipelineLayout) -> list[list[str]]:
    """The names of each parameter held both by the first stage's ends and by the last's
    (an LM head tied to its embedding), the first stage's name first. A parameter shared
    between blocks, or between a block and an end, could sit on any two stages: refused."""
    tied = []
    for group in shared_parameters(model):
        owners = [_owner(n, layout) for n in group]
        if len(set(owners)) == 1 and owners[0] != "blocks":
            continue  # on one stage: one parameter there, as unsplit
        if "blocks" in owners or len(group) != 2:
            raise ValueError(f"pipeline stages cannot split the shared parameter {group}: only one held under "
                             f"one name by the first stage's {layout.first} and one by the last stage's "
                             f"{layout.last} is kept in step")
        tied.append(sorted(group, key=lambda n: owners[group.index(n)] != "first"))
    return tied


def _tie_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """This rank's group with the rank of the other end of its pipeline (the first and
    the last stage of one data-parallel replica); None on the ranks in between.
    Collective: every rank calls it."""
    pp_mesh = mesh["pp"]
    if pp_mesh.size() == 2:
        return pp_mesh.get_group()
    ranks = mesh.mesh  # (pp, dp, tp) global ranks
    pairs = [[int(a), int(b)] for a, b in zip(ranks[0].flatten(), ranks[-1].flatten())]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


class TiedEnds:
    """The gradients of a tied LM head's two copies (the first stage's embedding, the
    last stage's head) summed over the pair of ranks holding them, so both copies take
    the same update. `names` are the groups of `_tied_ends`; the parameters are looked
    up when used (a meta-device build gives the modules new ones after the split)."""

    def __init__(self, holder: nn.Module, names: list[list[str]], group: dist.ProcessGroup | None):
        held = {n for n, _ in holder.named_parameters(remove_duplicate=False)}
        self.holder, self.names, self.group = holder, names, group
        self.held = [n for g in names for n in g if n in held]  # this rank's copies (none mid-pipeline)
        self.second = [g[-1] for g in names if g[-1] in held and g[0] not in held]  # the last stage's

    def optim_aliases(self) -> dict[str, str]:
        """The last stage's copies -> the name whose optimizer state they resume from
        (the unsplit model's: the embedding's; `core.sharded.load_sharded`)."""
        return {g[-1]: g[0] for g in self.names if g[-1] in self.second}

    def second_copies(self) -> list[nn.Parameter]:
        """The last stage's copies: left out of the gradient norm (counted on the first)."""
        return [self.holder.get_parameter(n) for n in self.second]

    def sync(self) -> None:
        if self.group is None:
            return
        for name in self.held:
            p = self.holder.get_parameter(name)
            grad = p.grad
            if grad is None:  # no gradient this step: the other end's alone, and zeros here
                grad = p.grad = torch.zeros_like(p)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.group)


def _merge(parts: list[nn.Module], layout: PipelineLayout) -> nn.Module:
    """One module holding every local stage's parts under their original names: what
    the optimizer steps and the checkpoint saves (``blocks.5.attn...``, as unsplit)."""
    holder = nn.Module()
    _put(holder, layout.blocks, nn.ModuleDict(
        {k: b for p in parts for k, b in p.get_submodule(layout.blocks).named_children()}), make_parents=True)
    for path in layout.first + layout.last:
        owned = [m for m in (_get(p, path) for p in parts) if m is not None]
        if owned:
            _put(holder, path, owned[0], make_parents=True)
    return holder


class _SummedCounter:
    """The gradient collectives of several stages' data-parallel wrappers together: read
    only (a `CommCount`); each collective increments its own stage's counter."""

    def __init__(self, counters: list[CommCount]):
        self.counters = counters

    @property
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
        self.tied: TiedEnds | None = None  # a tied LM head: its copies' gradients summed
        self.whole: set[str] = set()  # the unsplit model's state-dict names
        # This rank's stage modules, whole (blocks, ends, buffers): what a meta-device
        # build gives storage and fills with pretrained weights, each its own slices.
        self.parts: list[nn.Module] = []

    def chunk_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The engine's loss is a sum scaled by the whole step's target count, so chunks add up.
        assert self.loss_fn is not None
        return self.loss_fn(output, target)

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
        if sync and self.tied is not None:
            self.tied.sync()
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
        # torch annotates list[_PipelineStageBase] (invariant); PipelineStage is one
        return ScheduleInterleaved1F1B(stages, n_chunks, loss_fn=loss_fn, scale_grads=False)  # type: ignore[arg-type]
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return cls(stages[0], n_chunks, loss_fn=loss_fn, scale_grads=False)


def apply_pp(model: nn.Module, *, env, cfg, mesh: DeviceMesh, layout: PipelineLayout,
             data_parallel: Callable[[nn.Module], Parallelized]) -> Parallelized:
    """This rank's stage(s) of `model` (split by its family's `layout`), each made data
    parallel over ``mesh["dp"]`` by `data_parallel`, and the schedule that runs them
    (`Parallelized.pipeline`)."""
    pp_mesh = mesh["pp"]
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    per_rank = PP_SCHEDULES[cfg.pp_schedule]
    n_stages = pp * per_rank
    n_blocks = len(list(model.get_submodule(layout.blocks).children()))
    ranges = stage_blocks(n_blocks, n_stages, cfg.pp_split)
    if sum(map(len, ranges)) != n_blocks:  # the config check counted other blocks than were built
        raise ConfigError("parallel.pp_split", cfg.pp_split, f"{n_stages} block counts summing to the "
                          f"{n_blocks} blocks the model was built with")
    stage_ids = [rank + k * pp for k in range(per_rank)]  # looped: rank r holds r, r + pp, ...
    tied_names = _tied_ends(model, layout)
    whole = set(model.state_dict())  # the unsplit model's names (a meta model: no storage)
    parts = []
    for sid in stage_ids:
        part = model if per_rank == 1 else copy.deepcopy(model)
        parts.append(_prune(part, layout, ranges[sid], first=sid == 0, last=sid == n_stages - 1))
    wrapped = [data_parallel(p) for p in parts]
    stages = [PipelineStage(w.module, sid, n_stages, env.device, group=pp_mesh.get_group())
              for w, sid in zip(wrapped, stage_ids)]
    chunks = cfg.pp_microbatches or pp
    runner = PipelineRunner(None, chunks=chunks, has_first=0 in stage_ids,
                            has_last=n_stages - 1 in stage_ids, device=env.device)
    runner.schedule = _schedule(cfg.pp_schedule, stages, chunks, runner.chunk_loss)
    runner.parts = parts
    runner.whole = whole
    holder = parts[0] if per_rank == 1 else _merge(parts, layout)
    counts = [w.comm for w in wrapped]  # each stage's own collectives (FSDP's reduce-scatters)
    if mesh["dp"].size() > 1 and cfg.strategy == "ddp":
        synced = CommCounter()  # the flat all-reduce of all this rank's stages, once per step
        runner.grad_sync = _counted_allreduce(holder, mesh["dp"].get_group(), synced)
        counts.append(synced)
    if tied_names:
        runner.tied = TiedEnds(holder, tied_names, _tie_group(mesh))
    tied = runner.tied
    return Parallelized(
        module=holder, base=holder, sharded=True, comm=_SummedCounter(counts),
        clip_grad_norm=lambda max_norm: clip_grad_norm(
            holder.parameters(), max_norm, stage_group=pp_mesh.get_group(),
            uncounted=tied.second_copies() if tied is not None else ()),
        pipeline=runner, loss_ranks=mesh["dp"].size() * mesh["tp"].size())
