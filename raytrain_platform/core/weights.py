"""Pretrained weights straight into shards: fill a module whose parameters are plain
tensors or DTensors (FSDP2 shards, TP slices, both) from safetensors files, each rank
reading only the slices it holds (``safe_open(...).get_slice``: the file is memory-
mapped, and only the pages of those slices are read, one tensor at a time). No rank
materialises a full tensor it does not keep.

Names are the module's own state-dict keys, unless its family says where each is in the
files (`ModelFamily.checkpoint_sources`: an hf model's keys as transformers renames and
converts them, fused experts built whole from their per-expert tensors, then sliced); a
tied weight (an LM head that is the embedding) is found under any of its names.

>>> # load_safetensors(model, ["/models/llama/model-00001-of-00002.safetensors", ...])
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from raytrain_platform.compat.torch_private import (local_shape_and_offset, post_accumulate_grad_hooks,
                                                     set_post_accumulate_grad_hooks)
from raytrain_platform.errors import CheckpointError
from raytrain_platform.models.family import ConvertedWeight
from raytrain_platform.parallel.ties import retie, shared_parameters

__all__ = ["Sources", "load_safetensors", "local_slice", "materialize"]


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give a meta-device model (or its shards) real, uninitialised storage on `device`;
    tied parameters stay tied (`to_empty` gives plain tensors one copy per module), and
    the post-accumulate-grad hooks registered on the meta parameters are registered
    again: `to_empty` gives each parameter new storage (a new `Parameter`, or for a
    DTensor the same one over a new local tensor), which drops them. TP's hook that
    keeps only an embedding's own rows of its gradient was lost so, and each TP rank
    held the whole vocabulary's gradient. (Handles returned by the first registration
    no longer remove them; nothing here removes one.)"""
    tied = shared_parameters(model)
    hooks = {name: found for name, p in model.named_parameters() if (found := post_accumulate_grad_hooks(p))}
    model.to_empty(device=device)
    retie(model, tied)
    for name, p in model.named_parameters():
        if name in hooks:  # a new Parameter, or new storage under the old one's hook dict
            set_post_accumulate_grad_hooks(p, hooks[name])


def local_slice(target: torch.Tensor) -> tuple[slice, ...] | None:
    """The part of the full tensor this rank holds (None: all of it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return None
    shape, offset = local_shape_and_offset(target.shape, target.device_mesh, target.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _index(files: list[str]) -> dict[str, str]:
    from safetensors import safe_open

    where: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    where[key] = f
        except Exception as exc:  # safetensors raises its own types for corrupt files
            raise CheckpointError(f"{f}: not a readable safetensors file ({exc})") from None
    return where


Sources = Callable[[list[str]], "Mapping[str, str | ConvertedWeight] | None"]


@torch.no_grad()
def load_safetensors(model: nn.Module, files: list[str],
                     source_name: Callable[[str], str | None] | None = None,
                     tied: Sequence[list[str]] = (), sources: Sources | None = None) -> int:
    """Copy every parameter and persistent buffer of `model` from `files`, this rank's
    slices only; returns the bytes read. Missing or mis-shaped tensors are one
    `CheckpointError` naming them. `source_name` maps a model name to its name in the
    files, None for a tensor the files do not hold (a LoRA model's adapters). `tied`:
    groups of names of one tensor of the whole model, of which `model` may hold one (the
    last pipeline stage's copy of a tied LM head: the files hold the embedding's name).
    `sources`: the files' keys -> where each model name is among them (its family's
    `checkpoint_sources`: renamed, or a `ConvertedWeight` built from several tensors,
    whole, then sliced); None, or a None answer: under its own name."""
    where = _index(files)
    located = sources(list(where)) if sources is not None else None

    def find(name: str) -> str | ConvertedWeight | None:
        return (name if name in where else None) if located is None else located.get(name)

    also = {n: group for group in tied for n in group}
    names_of: dict[int, list[str]] = defaultdict(list)  # tied weights: one tensor, several names
    tensors: dict[int, torch.Tensor] = {}
    for fqn, t in model.state_dict(keep_vars=True).items():
        for alias in also.get(fqn, [fqn]):
            name = source_name(alias) if source_name is not None else alias
            if name is not None:
                names_of[id(t)].append(name)
                tensors[id(t)] = t
    hits = {key: next(((n, s) for n in names for s in [find(n)] if s is not None), None)
            for key, names in names_of.items()}
    missing = [names_of[key][0] for key, hit in hits.items() if hit is None]
    if missing:
        raise CheckpointError(f"{Path(files[0]).parent}: the weights lack {missing[:3]} "
                              f"({len(missing)} tensors of the model in all)")
    found = {key: hit for key, hit in hits.items() if hit is not None}  # (name, where it is): every one
    read = 0
    done: set[int] = set()
    for key, target in tensors.items():
        if key in done:
            continue
        source = found[key][1]
        if isinstance(source, str):
            read += _read_slice(target, where[source], source)
            continue
        # Built whole once, copied into every tensor of the model it makes, then dropped.
        takers = {k: (name, tensors[k]) for k, (name, s) in found.items() if s is source}
        read += _fill_converted(source, takers, where)
        done.update(takers)
    return read


def _read_slice(target: torch.Tensor, file: str, key: str) -> int:
    """This rank's slice of the checkpoint tensor `key` into `target`; bytes read."""
    from safetensors import safe_open

    # One mapping per tensor: the pages read are released when it closes, so the
    # resident file pages never add up to the whole file (measured: a 311M-parameter
    # load peaked at 2.0x the weights with one mapping per file, 1.1x like this).
    with safe_open(file, framework="pt", device="cpu") as handle:
        source = handle.get_slice(key)
        if list(source.get_shape()) != list(target.shape):
            raise CheckpointError(f"{file}: {key} has shape {source.get_shape()}, the model "
                                  f"expects {list(target.shape)}")
        part = local_slice(target)
        data = source[part] if part is not None else source[:]
    _copy_local(target, data)
    return data.numel() * data.element_size()


def _fill_converted(source: ConvertedWeight, takers: dict[int, tuple[str, torch.Tensor]],
                    where: dict[str, str]) -> int:
    """Build `source` whole from its checkpoint tensors and copy this rank's slice of
    what it makes into each of `takers` (name, tensor); bytes read."""
    from safetensors import safe_open

    read = 0

    def load(key: str) -> torch.Tensor:
        nonlocal read
        with safe_open(where[key], framework="pt", device="cpu") as handle:
            tensor = handle.get_tensor(key)
        read += tensor.numel() * tensor.element_size()
        return tensor

    made = source.build(load)
    first = where[source.sources[0]]
    for name, target in takers.values():
        if name not in made:
            raise CheckpointError(f"{first}: {name} is not among what {source.sources[0]} and the rest convert to "
                                  f"({sorted(made)[:3]})")
        whole = made.pop(name)
        if list(whole.shape) != list(target.shape):
            raise CheckpointError(f"{first}: {name}, built from {source.sources[0]} and {len(source.sources) - 1} "
                                  f"more, has shape {list(whole.shape)}, the model expects {list(target.shape)}")
        part = local_slice(target)
        _copy_local(target, whole[part] if part is not None else whole)
        del whole
    return read


def _copy_local(target: torch.Tensor, data: torch.Tensor) -> None:
    local = target.to_local() if hasattr(target, "to_local") else target
    local.copy_(data.to(local.dtype))
