"""Pretrained weights straight into shards: fill a module whose parameters are plain
tensors or DTensors (FSDP2 shards, TP slices, both) from safetensors files, each rank
reading only the slices it holds (``safe_open(...).get_slice``: the file is memory-
mapped, and only the pages of those slices are read, one tensor at a time). No rank
materialises a full tensor it does not keep.

Names are the module's own state-dict keys (Hugging Face's, for an hf model): a tied
weight (an LM head that is the embedding) is found under any of its names.

>>> # load_safetensors(model, ["/models/llama/model-00001-of-00002.safetensors", ...])
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from raytrain_platform.errors import CheckpointError
from raytrain_platform.parallel.ties import retie, shared_parameters

__all__ = ["load_safetensors", "local_slice", "materialize"]


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
    hooks = {name: list((p._post_accumulate_grad_hooks or {}).values())
             for name, p in model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)}
    model.to_empty(device=device)
    retie(model, tied)
    for name, p in model.named_parameters():
        if name in hooks:  # a new Parameter, or new storage under the old one's hook dict
            p._post_accumulate_grad_hooks = None  # type: ignore[assignment]
            for hook in hooks[name]:
                p.register_post_accumulate_grad_hook(hook)


def local_slice(target: torch.Tensor) -> tuple[slice, ...] | None:
    """The part of the full tensor this rank holds (None: all of it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
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


@torch.no_grad()
def load_safetensors(model: nn.Module, files: list[str],
                     source_name: Callable[[str], str | None] | None = None,
                     tied: Sequence[list[str]] = ()) -> int:
    """Copy every parameter and persistent buffer of `model` from `files`, this rank's
    slices only; returns the bytes read. Missing or mis-shaped tensors are one
    `CheckpointError` naming them. `source_name` maps a model name to its name in the
    files, None for a tensor the files do not hold (a LoRA model's adapters). `tied`:
    groups of names of one tensor of the whole model, of which `model` may hold one (the
    last pipeline stage's copy of a tied LM head: the files hold the embedding's name)."""
    from safetensors import safe_open

    where = _index(files)
    also = {n: group for group in tied for n in group}
    names_of: dict[int, list[str]] = defaultdict(list)  # tied weights: one tensor, several names
    tensors: dict[int, torch.Tensor] = {}
    for fqn, t in model.state_dict(keep_vars=True).items():
        for alias in also.get(fqn, [fqn]):
            name = source_name(alias) if source_name is not None else alias
            if name is not None:
                names_of[id(t)].append(name)
                tensors[id(t)] = t
    missing = [names[0] for names in names_of.values() if not any(n in where for n in names)]
    if missing:
        raise CheckpointError(f"{Path(files[0]).parent}: the weights lack {missing[:3]} "
                              f"({len(missing)} tensors of the model in all)")
    read = 0
    for key, target in tensors.items():
        name = next(n for n in names_of[key] if n in where)
        # One mapping per tensor: the pages read are released when it closes, so the
        # resident file pages never add up to the whole file (measured: a 311M-parameter
        # load peaked at 2.0x the weights with one mapping per file, 1.1x like this).
        with safe_open(where[name], framework="pt", device="cpu") as handle:
            source = handle.get_slice(name)
            if list(source.get_shape()) != list(target.shape):
                raise CheckpointError(f"{where[name]}: {name} has shape {source.get_shape()}, the model "
                                      f"expects {list(target.shape)}")
            part = local_slice(target)
            data = source[part] if part is not None else source[:]
        local = target.to_local() if hasattr(target, "to_local") else target
        local.copy_(data.to(local.dtype))
        read += data.numel() * data.element_size()
        del data
    return read
