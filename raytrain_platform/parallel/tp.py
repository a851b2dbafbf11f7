"""Tensor parallelism for `gpt` with DTensor (``parallelize_module``), Megatron-style,
then optionally FSDP over the data-parallel dimension of the same mesh (TP x FSDP).

Per block: q/k/v and the MLP up-projection are column-wise (each rank computes
n_head / tp whole heads and 4d / tp hidden units, no communication), the attention
output and MLP down-projection are row-wise (partial sums, one all-reduce each in
forward, one in backward). Embeddings are split by rows (vocabulary / positions), the
LM head by columns with its logits gathered (Replicate) for the loss. Layer norms
are replicated, or with ``sequence_parallel`` run on sequence shards (activations
between blocks are then split along T; the all-reduces become reduce-scatter +
all-gather).

Order (torchtitan): TP first, then FSDP on ``mesh["dp"]``, so TP'd parameters become
2-D DTensors (Shard over dp, Shard/Replicate over tp).

Run it (Ray absent)::

    torchrun --nproc-per-node 4 -m raytrain_platform.core --config pipelines/configs/quickstart.yaml \\
        --set parallel.tp_size=2 --set parallel.strategy=fsdp
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from raytrain_platform.parallel.base import Parallelized
from raytrain_platform.parallel.grads import clip_grad_norm

__all__ = ["apply_tp", "gpt_tp_plan"]


class ReplicateParams(ParallelStyle):
    """Parameters as Replicate DTensors, plain tensors in and out: the layer norms
    without sequence parallel. Every parameter is then a DTensor on the TP mesh, which
    the foreach optimizers need (they refuse a mix of DTensors and plain tensors)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            input_fn=lambda mod, inputs, mesh: tuple(
                DTensor.from_local(t, mesh, (Replicate(),), run_check=False) for t in inputs),
            output_fn=lambda mod, output, mesh: output.to_local())


def gpt_tp_plan(model: nn.Module, *, sequence_parallel: bool) -> dict:
    """The `parallelize_module` plan for `models.gpt.GPT`, by module FQN."""
    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # layout of the residual stream (B, T, d)
    plan: dict = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # (T, d): with SP, rows of positions go to the rank holding those tokens.
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate()),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    norm = SequenceParallel() if sp else ReplicateParams()
    plan["ln_f"] = norm
    for name in model.blocks:  # type: ignore[attr-defined]
        p = f"blocks.{name}."
        plan.update({
            p + "attn.q_proj": ColwiseParallel(), p + "attn.k_proj": ColwiseParallel(),
            p + "attn.v_proj": ColwiseParallel(),
            p + "attn.o_proj": RowwiseParallel(output_layouts=between),
            p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=between),
        })
        plan.update({p + "ln_1": norm, p + "ln_2": norm})
        if sp:  # norms on sequence shards; attention and MLP gather the full sequence
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan.update({p + "attn": gather, p + "mlp": gather})
    return plan


def _grad_like_param(param: DTensor) -> None:
    """Row-split embeddings get Replicate (full-size) gradients from DTensor's embedding
    backward; keep only this rank's rows, as the parameter (a local slice, no
    communication): gradient memory then splits like the parameters."""
    if param.grad is not None and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)


def apply_tp(model: nn.Module, *, env, cfg, mesh: DeviceMesh) -> Parallelized:
    """Shard `model` over ``mesh["tp"]``; with a data-parallel size > 1, FSDP over
    ``mesh["dp"]`` on top (`cfg.strategy` is then 'fsdp', checked by the config)."""
    parallelize_module(model, mesh["tp"], gpt_tp_plan(model, sequence_parallel=cfg.sequence_parallel))
    par = Parallelized(module=model, base=model)
    if mesh["dp"].size() == 1:  # (FSDP's reduce-scatter reshards them itself)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(_grad_like_param)
    else:
        from raytrain_platform.parallel.fsdp import apply_fsdp

        par = apply_fsdp(model, env=env, cfg=cfg, mesh=mesh["dp"])
    par.sharded = True  # DTensor shards: checkpoint with DCP
    par.clip_grad_norm = lambda max_norm: clip_grad_norm(model.parameters(), max_norm)
    return par
