"""LoRA runs in the engine: adapter initialisation that is the same in every layout,
and the identity of the frozen base an adapter checkpoint belongs to.

- `reset_adapters`: after a meta-device build (``to_empty``) the adapters hold
  garbage, and under FSDP2 they are DTensor shards. Each adapter's full initial value
  is drawn from a generator seeded by (run seed, parameter path), and each rank keeps
  its slice: one process, DDP and FSDP start from the same adapters (peft's own reset
  draws from the global generator, per rank and per shard).
- `base_identity`: a checkpoint of a LoRA run holds the adapters only, so it records
  which base they were trained on (path and a content hash), and `check_base` refuses
  a resume over another base with one line.

The content hash (`fingerprint`) reads each safetensors file's header (names, dtypes,
shapes) and 3 x 4 KiB of every tensor's bytes (start, middle, end): about 8 MiB for
the ~700 tensors of a 70B model, where hashing its 140 GB would take minutes on every
start; another fine-tune of the same architecture differs in those bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path

import torch
from torch import nn

from raytrain_platform.core.weights import local_slice
from raytrain_platform.errors import CheckpointError
from raytrain_platform.models.lora import is_adapter
from raytrain_platform.models.registry import get_family

__all__ = ["base_identity", "check_base", "fingerprint", "param_counts", "reset_adapters", "run_base",
           "trainable_share"]

_SAMPLE = 4096


@torch.no_grad()
def reset_adapters(model: nn.Module, seed: int) -> None:
    """peft's initialisation (A: kaiming-uniform with a = sqrt(5), i.e. U(+-1/sqrt(in));
    B: zeros, so the adapted model starts equal to the base), layout-independent."""
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        full = torch.zeros(p.shape, dtype=torch.float32)
        if ".lora_A." in f".{name}":
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            bound = 1.0 / (p.shape[1] ** 0.5)
            full.uniform_(-bound, bound, generator=gen)
        part = local_slice(p)
        local = p.to_local() if hasattr(p, "to_local") else p
        local.copy_((full[part] if part is not None else full).to(local.dtype))


def param_counts(model: nn.Module) -> dict[str, int]:
    """Parameters of the whole model and those that train (global counts: call it
    before the model is sharded, or on DTensors, whose numel is global)."""
    params = list(model.parameters())
    return {"num_params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad)}


def trainable_share(counts: dict) -> str:
    """``"; 6,144 of 1,181,696 parameters trainable (0.52%)"`` for a run that trains part of
    its model (LoRA), from `param_counts`' keys; ``""`` otherwise.

    >>> trainable_share({"num_params": 200, "trainable_params": 1})
    '; 1 of 200 parameters trainable (0.50%)'
    >>> trainable_share({"num_params": 200, "trainable_params": 200})
    ''
    """
    total, trained = counts.get("num_params"), counts.get("trainable_params")
    if not total or trained is None or trained >= total:
        return ""
    return f"; {trained:,} of {total:,} parameters trainable ({100 * trained / total:.2f}%)"


_MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size


def _data_offsets(header: bytes) -> dict[str, tuple[int, int]] | None:
    """Each tensor's (begin, end) byte offsets from a safetensors header; None for a
    header that is not one (not JSON, not an object of tensors with two offsets)."""
    try:
        entries = json.loads(header)
        offsets = {k: tuple(v["data_offsets"]) for k, v in entries.items() if k != "__metadata__"}
    except (ValueError, TypeError, AttributeError, KeyError):
        return None
    ok = all(len(o) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in o)
             and o[0] <= o[1] for o in offsets.values())
    return offsets if ok else None


def fingerprint(files: list[str]) -> str:
    """sha256 over each safetensors file's name, header and sampled tensor bytes."""
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda f: Path(f).name):
        with open(file, "rb") as f:
            head = f.read(8)
            (size,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            header = f.read(size) if 0 <= size <= _MAX_HEADER else b""
            digest.update(Path(file).name.encode() + header)
            offsets = _data_offsets(header)
            if offsets is None:
                raise CheckpointError(f"{file}: not a readable safetensors file (bad header)")
            for key, (begin, end) in sorted(offsets.items()):
                for at in sorted({begin, max(begin, (begin + end) // 2 - _SAMPLE // 2), max(begin, end - _SAMPLE)}):
                    f.seek(8 + size + at)
                    digest.update(f.read(min(_SAMPLE, end - at)))
    return digest.hexdigest()


def base_identity(*, model_name: str, kwargs: dict, seed: int, files: list[str] | None) -> dict:
    """What an adapter checkpoint records of its base: pretrained weights by their
    directory and `fingerprint`; a base initialised from the seed by model and seed."""
    if files:
        return {"path": str(Path(files[0]).parent), "sha256": fingerprint(files)}
    described = json.dumps({"model": model_name, "kwargs": kwargs, "seed": seed}, sort_keys=True, default=str)
    return {"path": None, "model": model_name, "seed": seed,
            "sha256": hashlib.sha256(described.encode()).hexdigest()}


def run_base(cfg) -> dict | None:
    """The base identity of the `JobConfig` `cfg` (None without ``model.lora``)."""
    m = cfg.model
    if m.lora is None:
        return None
    files = get_family(m.name).pretrained_files(m.kwargs)
    return base_identity(model_name=m.name, kwargs=m.kwargs, seed=cfg.train.seed, files=files)


def check_base(directory: str, recorded: dict | None, expected: dict | None) -> None:
    """A `CheckpointError` when a checkpoint cannot resume this run: its adapters were
    trained on another base, it is an adapter checkpoint and this run has no LoRA, or
    the other way round. `expected` is this run's `base_identity` (None: no LoRA)."""
    if expected is None:
        if recorded:
            raise CheckpointError(f"{directory}: holds LoRA adapters only (base {recorded.get('path')}); "
                                  "resume it with the model.lora it was trained with")
        return
    if recorded is None:
        raise CheckpointError(f"{directory}: not a LoRA adapter checkpoint (it records no base model); "
                              "resume it without model.lora, or start a new run")
    if recorded.get("sha256") != expected["sha256"]:
        was = recorded.get("path") or f"model {recorded.get('model')!r} seed {recorded.get('seed')}"
        now = expected.get("path") or f"model {expected.get('model')!r} seed {expected.get('seed')}"
        raise CheckpointError(f"{directory}: its LoRA adapters were trained on base {was} (sha256 "
                              f"{str(recorded.get('sha256'))[:12]}), not on this run's base {now} (sha256 "
                              f"{expected['sha256'][:12]}); resume over the same base weights")
