"""Tensor parallelism with DTensor (``parallelize_module``), Megatron-style, by the
plan a model's family declares (models/family.py); parallel/compose.py then puts FSDP
over the data-parallel dimension of the same mesh (TP x FSDP).

For gpt, per block: q/k/v and the MLP up-projection are column-wise (each rank computes
n_head / tp whole heads and 4d / tp hidden units, no communication), the attention
output and MLP down-projection are row-wise (partial sums, one all-reduce each in
forward, one in backward). Embeddings are split by rows (vocabulary / positions), the
LM head by columns with its logits gathered (Replicate) for the loss. Layer norms
are replicated, or with ``sequence_parallel`` run on sequence shards (activations
between blocks are then split along T; the all-reduces become reduce-scatter +
all-gather).

A parameter shared by two modules (an LM head tied to its embedding) stays one
parameter: `parallelize_module` distributes each module's parameters on its own, so the
tie is restored afterwards, where the plan shards both uses alike (the embedding by
rows and the head by columns both split the ``vocab x d`` weight along the vocabulary).

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

from raytrain_platform.parallel.ties import retie, shared_parameters


__all__ = ["apply_tp", "tp_styles"]


class ReplicateParams(ParallelStyle):
    """Parameters as Replicate DTensors, plain tensors in and out: the layer norms
    without sequence parallel. Every parameter is then a DTensor on the TP mesh, which
    the foreach optimizers need (they refuse a mix of DTensors and plain tensors)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            # torch annotates input_fn as returning None; what it returns replaces the inputs
            input_fn=lambda mod, inputs, mesh: tuple(  # type: ignore[arg-type]
                DTensor.from_local(t, mesh, (Replicate(),), run_check=False) for t in inputs),
            output_fn=lambda mod, output, mesh: output.to_local())


class LocalReplicate(ParallelStyle):
    """Parameters as Replicate DTensors, the module computing with their local tensors
    (each rank's whole copy): a module a plan leaves whole whose ops DTensor does not
    run (a mixture of experts' grouped matmuls, torch 2.13). Its inputs are the same on
    every rank, so each computes the whole gradient, which reaches the DTensor
    parameter through ``to_local`` as Replicate."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)  # parameters and buffers replicated
        held: dict[str, DTensor] = {}

        def local(mod: nn.Module, args: tuple) -> None:
            for name, param in list(mod._parameters.items()):
                if isinstance(param, DTensor):
                    held[name] = param
                    mod._parameters[name] = param.to_local()  # for this call

        def restore(mod: nn.Module, args: tuple, output: object) -> None:
            mod._parameters.update(held)  # type: ignore[arg-type]  # the DTensor parameters
            held.clear()

        module.register_forward_pre_hook(local)
        module.register_forward_hook(restore)
        return module


class EmbeddingRowwise(RowwiseParallel):
    """`RowwiseParallel` for embeddings whose output waits for its all-reduce (or
    reduce-scatter) before it leaves: a plain tensor, not the `AsyncCollectiveTensor` of
    an async collective. A compiled block fed straight by the embedding (a Hugging Face
    decoder's first layer) was recompiled for that type, and its backward failed
    (``'Tensor' object has no attribute '_local_tensor'``, torch 2.13). Nothing waits
    less for it: the next op reads the embedding's output at once."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def _style(kind: str, *, sequence_parallel: bool) -> ParallelStyle | None:
    """The DTensor style of one entry of a family's plan (models/family.py `TP_KINDS`)."""
    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # layout of the residual stream (B, T, d)
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel(output_layouts=between)
    if kind == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if kind == "rowwise_split":  # a whole input: each rank takes its slice (no communication)
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if kind == "embedding":
        return EmbeddingRowwise(input_layouts=Replicate(), output_layouts=between)
    if kind == "position_embedding":  # (T, d): with SP, rows of positions go with their tokens
        return EmbeddingRowwise(input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate())
    if kind == "head":
        return ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    if kind == "norm":
        return SequenceParallel() if sp else ReplicateParams()
    if kind == "replicate":
        return LocalReplicate()
    if kind == "local_norm":
        # Each rank normalises its own heads (rows of a colwise output): declared a shard of
        # them (dim 0, any dim but the normalised last), so the replicated weight's
        # gradient sums over the ranks (a Partial DTensor, reduced to its placement).
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if kind == "sequence_gather":  # norms on sequence shards; attention and MLP see all of it
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)) if sp else None
    raise ValueError(f"unknown tensor-parallel kind {kind!r}")  # a bug in a family's plan


def tp_styles(plan: dict[str, str], *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A family's plan (FQN -> kind) as the `parallelize_module` plan."""
    styles = {fqn: _style(kind, sequence_parallel=sequence_parallel) for fqn, kind in plan.items()}
    return {fqn: style for fqn, style in styles.items() if style is not None}


def _grad_like_param(param: DTensor) -> None:
    """Row-split embeddings get Replicate (full-size) gradients from DTensor's embedding
    backward; keep only this rank's rows, as the parameter (a local slice, no
    communication): gradient memory then splits like the parameters."""
    grad = param.grad  # typed Tensor: a DTensor parameter's gradient is a DTensor
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _same_split(first: str, kept: nn.Parameter, name: str, other: nn.Parameter) -> None:
    """Tied parameters stay one only where the plan splits both uses alike."""
    if not (isinstance(kept, DTensor) and isinstance(other, DTensor) and other.shape == kept.shape
            and other.device_mesh == kept.device_mesh and other.placements == kept.placements):
        layouts = [getattr(p, "placements", "not split") for p in (kept, other)]
        raise ValueError(f"the tensor-parallel plan splits the tied parameters {first} and {name} "
                         f"differently ({layouts[0]} and {layouts[1]})")  # a bug in a family's plan


def apply_tp(model: nn.Module, *, mesh: DeviceMesh, plan: dict[str, str], sequence_parallel: bool,
             reshard_grads: bool) -> None:
    """Shard `model` in place over the 1-D TP `mesh` by its family's `plan`, keeping tied
    parameters tied. With `reshard_grads` (no FSDP on top), row-split embeddings keep
    only their rows' gradients."""
    tied = shared_parameters(model)
    parallelize_module(model, mesh, tp_styles(plan, sequence_parallel=sequence_parallel))
    retie(model, tied, check=_same_split)
    if reshard_grads:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(_grad_like_param)
