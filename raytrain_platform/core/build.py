"""The engine's model: built from its family, LoRA adapters injected, parallelized,
and pretrained weights read into it (Ray-free).

Weights come one of two ways. Without pretrained files the model is initialised on
the CPU with the run's seed, so every rank starts from the same weights. With them it
is built on the meta device; a layout that shards or splits it (FSDP, TP, PP) is
applied first, and each rank then gives its own shards storage and reads only their
slices of the files: no rank ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from raytrain_platform.config import JobConfig
from raytrain_platform.core.adapters import base_identity, param_counts, reset_adapters
from raytrain_platform.core.dist import DistEnv
from raytrain_platform.core.weights import load_safetensors, materialize
from raytrain_platform.models.family import ModelFamily
from raytrain_platform.models.lora import apply_lora, base_source_name
from raytrain_platform.parallel.base import Parallelized
from raytrain_platform.parallel.compose import parallelize
from raytrain_platform.parallel.registry import get_strategy

__all__ = ["BuiltModel", "build_model", "build_reference", "fill_pretrained"]


@dataclass
class BuiltModel:
    wrapped: Parallelized
    param_counts: dict[str, int]  # total and trainable parameters (`adapters.param_counts`)
    base: dict | None  # a LoRA run's base identity (`adapters.base_identity`), else None


def fill_pretrained(model: torch.nn.Module, family: ModelFamily, files: list[str], device: torch.device, *,
                    read: bool = True, source_name: Callable[[str], str | None] | None = None,
                    tied: list[list[str]] | None = None) -> None:
    """A meta-device `model` (or one pipeline stage of it) given storage on `device`,
    its family's buffers set, then its tensors read from the safetensors `files`: only
    its own slices under FSDP or TP, found where its family says (renamed or converted
    checkpoint keys). ``read=False`` leaves the weights to a checkpoint.
    `tied`: a pipeline's tied ends (`load_safetensors`)."""
    materialize(model, device)
    family.init_buffers(model, device)
    if read:
        load_safetensors(model, files, source_name=source_name, tied=tied or [],
                         sources=partial(family.checkpoint_sources, model))


def build_model(cfg: JobConfig, env: DistEnv, family: ModelFamily, *, resuming: bool) -> BuiltModel:
    """The job's model, parallelized, its weights from the seed or the pretrained files
    (a resumed run reads its own checkpoint afterwards: only a LoRA base is read here)."""
    m, par = cfg.model, cfg.parallel
    torch.manual_seed(cfg.train.seed)
    files = family.pretrained_files(m.kwargs)
    base = None if m.lora is None else base_identity(
        model_name=m.name, kwargs=m.kwargs, seed=cfg.train.seed, files=files)

    def adapted(model: torch.nn.Module) -> torch.nn.Module:
        # LoRA adapters go in before any parallelism wraps the model.
        return model if m.lora is None else apply_lora(model, m.lora, model_name=m.name)

    def parallelized(model: torch.nn.Module) -> Parallelized:
        return parallelize(model, env=env, cfg=par, family=family, model_kwargs=m.kwargs,
                           block_class=m.block_class)

    def fill(model: torch.nn.Module, tied: list[list[str]] | None = None) -> None:
        assert files is not None
        # a resumed run reads its own checkpoint (LoRA: the adapters only, the base from files)
        fill_pretrained(model, family, files, env.device, read=not resuming or m.lora is not None,
                        source_name=base_source_name if m.lora is not None else None, tied=tied)
        if m.lora is not None:
            reset_adapters(model, cfg.train.seed)

    if files is None:
        model = adapted(family.build(m.kwargs))
        counts = param_counts(model)
        if m.lora is not None:
            reset_adapters(model, cfg.train.seed)
        return BuiltModel(parallelized(model.to(env.device)), counts, base)
    model = adapted(family.build(m.kwargs, device="meta"))
    counts = param_counts(model)
    if get_strategy(par.strategy).shards_state or par.tp_size * par.pp_size > 1:
        # No rank ever holds the whole model: split the meta model, then each rank
        # gives its shards storage and reads only their slices of the files.
        wrapped = parallelized(model)
        # A pipeline rank fills only its stages (the meta model may be whole: copies were cut).
        pipeline = wrapped.pipeline
        # a tied head's copy on the last stage reads the tensor the files store once
        tied = pipeline.tied.names if pipeline is not None and pipeline.tied is not None else None
        for part in pipeline.parts if pipeline is not None else [model]:
            fill(part, tied)
        return BuiltModel(wrapped, counts, base)
    # Replicas (none, ddp) hold the whole model anyway; load before DDP broadcasts it.
    fill(model)
    return BuiltModel(parallelized(model), counts, base)


def build_reference(cfg: JobConfig, env: DistEnv, family: ModelFamily) -> Parallelized:
    """A preference run's frozen reference model (``train.dpo.reference``): the policy's
    starting weights (its pretrained files, or the seed's initialization) or another
    model folder's, sharded like the policy (FSDP, TP, TP x FSDP) so that no rank holds
    more of it than of the policy; a replica (none, DDP) is the whole model, unwrapped
    (nothing to sync). No adapters, no gradients, no optimizer; in eval mode."""
    m, ref = cfg.model, cfg.train.dpo.reference
    kwargs = m.kwargs if ref == "auto" else family.reference_kwargs(m.kwargs, ref)
    # no backward: activation checkpointing and compile would only cost
    strategy = "none" if cfg.parallel.strategy == "ddp" else cfg.parallel.strategy
    par = dataclasses.replace(cfg.parallel, strategy=strategy, activation_checkpointing=False, compile=False)
    torch.manual_seed(cfg.train.seed)  # a random init is the policy's own
    files = family.pretrained_files(kwargs)

    def parallelized(model: torch.nn.Module) -> Parallelized:
        return parallelize(model, env=env, cfg=par, family=family, model_kwargs=kwargs, block_class=m.block_class)

    if files is None:
        wrapped = parallelized(family.build(kwargs).to(env.device))
    elif get_strategy(par.strategy).shards_state or par.tp_size > 1:
        model = family.build(kwargs, device="meta")
        wrapped = parallelized(model)  # each rank reads only its shards' slices
        fill_pretrained(model, family, files, env.device)
    else:
        model = family.build(kwargs, device="meta")
        fill_pretrained(model, family, files, env.device)
        wrapped = parallelized(model)
    # after sharding: TP registers gradient hooks, which a frozen parameter refuses
    wrapped.module.requires_grad_(False).eval()
    return wrapped
