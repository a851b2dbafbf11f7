"""The one place parallelism is composed, in torchtitan's order (``parallelize_llama``):
pipeline split, then tensor parallel, then activation checkpointing, compile, or both on
the repeated blocks (of the whole model, the TP-sharded one, or each pipeline stage),
then FSDP or DDP.
Strategy files do not call each other; what the model contributes (its blocks, its
tensor-parallel plan, its pipeline split) comes from its family (models/family.py).

    wrapped = parallelize(model, env=env, cfg=cfg.parallel, family=get_family("gpt"),
                      model_kwargs=cfg.model.kwargs)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from torch import nn

from raytrain_platform.parallel.base import Parallelized
from raytrain_platform.parallel.dims import ParallelDims
from raytrain_platform.parallel.registry import get_strategy

if TYPE_CHECKING:
    from raytrain_platform.models.family import ModelFamily

__all__ = ["parallelize"]

Blocks = Callable[[nn.Module], list[tuple[str, nn.Module]]]


def parallelize(model: nn.Module, *, env, cfg, family: "ModelFamily", model_kwargs: dict,
                block_class: str | None = None) -> Parallelized:
    """`model` (on its device) -> `Parallelized` for the `ParallelConfig` `cfg`."""
    def blocks(m: nn.Module) -> list[tuple[str, nn.Module]]:
        return family.blocks(m, block_class=block_class)

    if cfg.tp_size * cfg.pp_size == 1:  # data parallel (or none) over every rank
        _block_options(model, env=env, cfg=cfg, blocks=blocks)
        return get_strategy(cfg.strategy).load()(model, env=env, cfg=cfg, blocks=blocks(model))
    from raytrain_platform.parallel.mesh import build_mesh

    dims = ParallelDims(dp=env.world_size // (cfg.tp_size * cfg.pp_size), tp=cfg.tp_size, pp=cfg.pp_size)
    mesh = build_mesh(env, dims)
    if cfg.pp_size > 1:
        from raytrain_platform.parallel.pp import apply_pp

        staged = family.pipeline_module(model)
        # TP x PP: the plan of the whole model (its names), each stage taking its entries
        plan = family.tp_plan(staged, model_kwargs) if cfg.tp_size > 1 else None
        first = iter([True])  # rank 0 announces compiling once, at its first stage
        layout = family.pipeline_layout(staged)
        return apply_pp(staged, env=env, cfg=cfg, mesh=mesh, layout=layout,
                        data_parallel=lambda part: _stage_data_parallel(part, env=env, cfg=cfg, mesh=mesh,
                                                                        blocks=blocks, plan=plan, layout=layout,
                                                                        announce=next(first, False)))
    wrapped = _tensor_parallel(model, env=env, cfg=cfg, mesh=mesh, plan=family.tp_plan(model, model_kwargs),
                               blocks=blocks)
    from raytrain_platform.parallel.grads import clip_grad_norm

    wrapped.clip_grad_norm = lambda max_norm: clip_grad_norm(model.parameters(), max_norm)
    return wrapped


def _tensor_parallel(model: nn.Module, *, env, cfg, mesh, plan: dict[str, str], blocks: Blocks,
                     announce: bool = True) -> Parallelized:
    """TP over ``mesh["tp"]``, then (dp > 1) FSDP over ``mesh["dp"]``: TP'd parameters
    become 2-D DTensors (Shard over dp, Shard/Replicate over tp). `model` may be a
    pipeline stage (its entries of the plan: `parallel.pp.stage_plan`)."""
    from raytrain_platform.parallel.tp import apply_tp

    dp = mesh["dp"].size()
    # Alone, TP reshards its embeddings' gradients itself; under FSDP its reduce-scatter does.
    apply_tp(model, mesh=mesh["tp"], plan=plan, sequence_parallel=cfg.sequence_parallel,
             reshard_grads=dp == 1)
    _block_options(model, env=env, cfg=cfg, blocks=blocks, announce=announce)
    if dp > 1:
        wrapped = get_strategy("fsdp").load()(model, env=env, cfg=cfg, mesh=mesh["dp"], blocks=blocks(model))
    else:
        wrapped = Parallelized(module=model, base=model)
    wrapped.sharded = True  # DTensor shards: checkpoint with DCP
    return wrapped


def _stage_data_parallel(part: nn.Module, *, env, cfg, mesh, blocks: Blocks, plan: dict[str, str] | None,
                         layout, announce: bool) -> Parallelized:
    """A pipeline stage over the data-parallel ranks: with a TP `plan`, TP over
    ``mesh["tp"]`` first (TP x PP; then FSDP where dp > 1); else FSDP over ``mesh["dp"]``,
    or for 'ddp', a replica whose gradients the pipeline runner all-reduces once per
    optimizer step (a stage wrapped in DistributedDataParallel hung in its first p2p
    exchange under gloo, torch 2.13). The stage's blocks are checkpointed or compiled
    first."""
    if plan is not None:
        from raytrain_platform.parallel.pp import stage_plan

        return _tensor_parallel(part, env=env, cfg=cfg, mesh=mesh, plan=stage_plan(part, plan, layout),
                                blocks=blocks, announce=announce)
    _block_options(part, env=env, cfg=cfg, blocks=blocks, announce=announce)
    if mesh["dp"].size() > 1 and cfg.strategy == "fsdp":
        return get_strategy("fsdp").load()(part, env=env, cfg=cfg, mesh=mesh["dp"], blocks=blocks(part))
    return Parallelized(module=part, base=part)


def _block_options(model: nn.Module, *, env, cfg, blocks: Blocks, announce: bool = True) -> None:
    """Activation checkpointing, or compile, or both, on each repeated block of `model` (a
    whole model, a TP'd one or a pipeline stage), before FSDP or DDP wraps it. Both: each
    compiled block recomputes in its own graph (parallel/compile.py says why not the
    eager wrapper)."""
    if cfg.compile:
        from raytrain_platform.parallel.compile import apply_compile

        apply_compile(blocks(model), device=env.device, announce=announce and env.is_rank0,
                      recompute=cfg.activation_checkpointing)
    elif cfg.activation_checkpointing:
        from raytrain_platform.parallel.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model, blocks=blocks(model))
