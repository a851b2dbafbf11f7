"""Checkpoints as directories. Nothing here unpickles arbitrary objects.

Unsharded strategies (none, ddp) hold the full state on every rank; rank 0 writes:

- ``model.safetensors``: the full model state (safetensors: plain tensors, no code),
- ``optimizer.pt``: the full optimizer state keyed by parameter name (FQN), read back
  with ``weights_only=True``.

Sharded strategies (fsdp) write ``sharded/`` with torch.distributed.checkpoint:
every rank its own shard, optimizer state included (see core/sharded.py).

Both also hold ``config.yaml`` and ``trainer_state.json`` (step, data position and
the world size and micro-batch it was counted in, the step's metrics), written last
as the completeness marker. Either format loads into any strategy at any world size:
full tensors are sharded on load, shards are read into full tensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from raytrain_platform.errors import CheckpointError, first_line
from raytrain_platform.core.rundir import CONFIG_FILE, STATE_FILE, write_json
from raytrain_platform.data.sources import SourceSpec, VAL_SPLIT, split_by_file

__all__ = ["TrainState", "save_checkpoint", "load_checkpoint", "read_state", "load_model_weights",
           "read_weights", "write_weights", "write_state", "split_changed_warning", "WEIGHTS_FILE", "OPTIM_FILE"]

WEIGHTS_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.pt"
FORMAT_VERSION = 2  # 2: optimizer state keyed by parameter name; data layout recorded
# torch.distributed.checkpoint (and with it DTensor and FSDP) is imported where a
# checkpoint is written or read, not with this module: the first step of a DDP run, and
# a Serve replica reading safetensors, do without the second or so it costs to import.


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch the next micro-batch comes from
    batches_in_epoch: int = 0  # micro-batches this rank has consumed in `epoch`
    samples_seen: int = 0  # over all ranks


def save_checkpoint(directory: str | os.PathLike, *, wrapped, optimizer: torch.optim.Optimizer,
                    state: TrainState, lr: float, config_yaml: str, metrics: dict,
                    is_rank0: bool, world_size: int = 1, batch_size: int = 0, split: bool = True,
                    base: dict | None = None) -> None:
    """Write this rank's part of a checkpoint into `directory`. Called on every rank
    (sharded saves are collective); `world_size`, `batch_size` (per-rank micro-batch)
    and `split` (whether the ranks share out the micro-batches, or each reads them all)
    say what unit `state.batches_in_epoch` counts, so a resume can rescale it. With
    `base` (a LoRA run's frozen base, core/adapters.py), only the trainable adapters
    are written, and the base's identity is recorded beside them."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from raytrain_platform.core.sharded import save_sharded

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if wrapped.sharded:
        save_sharded(d, module=wrapped.module, optimizer=optimizer, adapters_only=base is not None)
    else:
        # Parameter names, not positions: the same file then loads into an FSDP model.
        optim_state = get_optimizer_state_dict(wrapped.base, optimizer)
        if is_rank0:
            keep = _trainable(wrapped.base) if base is not None else None
            write_state(d / WEIGHTS_FILE, {k: v for k, v in wrapped.base.state_dict().items()
                                           if keep is None or k in keep}, version=str(FORMAT_VERSION))
            torch.save(optim_state, d / OPTIM_FILE)
    if not is_rank0:
        return
    (d / CONFIG_FILE).write_text(config_yaml)
    # Written last (after the collective save, so every shard is on disk): marks it complete,
    # with the size of each file beside it. A copy to storage (Ray uploads the directory)
    # may land this file before the others are whole; rundir.list_checkpoints checks them.
    files = {str(f.relative_to(d)): f.stat().st_size for f in sorted(d.rglob("*"))
             if f.is_file() and f.name != STATE_FILE}
    write_json(d / STATE_FILE, {"format_version": FORMAT_VERSION, "state": asdict(state),
                                "layout": {"world_size": world_size, "batch_size": batch_size, "split": split,
                                           "val_split": VAL_SPLIT},
                                "scheduler": {"step": state.step, "lr": lr},
                                "metrics": metrics, "sharded": bool(wrapped.sharded), "files": files,
                                **({"base": base} if base is not None else {})})


def _trainable(model: torch.nn.Module) -> set[str]:
    """Names of the parameters that train (a LoRA model's adapters)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def write_weights(path: str | os.PathLike, model: torch.nn.Module, **metadata: str) -> None:
    """`model`'s full state as safetensors (plain tensors: loading it runs no code)."""
    write_state(path, model.state_dict(), **metadata)


def write_state(path: str | os.PathLike, state: dict[str, torch.Tensor], **metadata: str) -> None:
    """A full state dict as safetensors. Tied weights (an LM head sharing the embedding,
    as in Llama 3.2 1B) are stored under each name: safetensors refuses shared memory,
    and loading copies the same values into the one shared parameter."""
    weights, seen = {}, set()
    for k, v in state.items():
        t = v.detach().contiguous().cpu()
        ptr = t.untyped_storage().data_ptr()
        weights[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(weights, str(path), metadata={"format": "raytrain_platform", **metadata})


def read_state(directory: str | os.PathLike) -> dict:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a complete checkpoint (no {STATE_FILE})")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        TrainState(**data["state"])
        bad = [k for k, v in data["state"].items() if type(v) is not int or v < 0]
        if bad:
            raise TypeError(f"state.{bad[0]} = {data['state'][bad[0]]!r}, expected an integer >= 0")
        if not isinstance(data.get("metrics", {}), dict):
            raise TypeError(f"metrics is a {type(data['metrics']).__name__}, expected an object")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON, UTF-8, shape
        raise CheckpointError(f"{path}: unreadable trainer state ({first_line(exc)})") from None
    return data


def load_model_weights(directory: str | os.PathLike, model: torch.nn.Module) -> None:
    """Load safetensors weights into `model`; a mismatch names the keys."""
    model.load_state_dict(read_weights(directory, model))


def read_weights(directory: str | os.PathLike, model: torch.nn.Module,
                 keys: set[str] | None = None, *, whole: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The safetensors weights of `directory`, checked against `model`'s names and
    (global) shapes, or only the names in `keys` (a LoRA checkpoint's adapters); a
    mismatch names the keys. With `whole` (the unsplit model's names), `model` is a
    pipeline rank's stages: the file must hold the whole model, and only `model`'s
    tensors are returned."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} (partial checkpoint, or written "
                              "sharded: use `rtp export` first)")
    try:
        weights = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from None
    expected = {k: v for k, v in model.state_dict().items() if keys is None or k in keys}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - (set(expected) if whole is None else whole))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        detail = "; ".join(x for x in (
            f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else "",
            f"shape mismatch {wrong[:3]}" if wrong else "") if x)
        raise CheckpointError(f"{path}: checkpoint is for another model ({detail})")
    return weights if whole is None else {k: weights[k] for k in expected}


def load_checkpoint(directory: str | os.PathLike, *, wrapped, optimizer: torch.optim.Optimizer,
                    device: torch.device, world_size: int = 1, batch_size: int = 0, split: bool = True,
                    epoch_rows: int = 0, base: dict | None = None) -> TrainState:
    """Restore model and optimizer in place, whatever format the checkpoint has and
    whatever strategy and world size `wrapped` has; returns the train state to continue
    from, its data position converted to this world size and micro-batch. With `base`
    (a LoRA run), only the adapters are read, after checking they were trained on it."""
    data = read_state(directory)
    from raytrain_platform.core.adapters import check_base

    check_base(str(directory), data.get("base"), base)
    if data.get("sharded"):
        from raytrain_platform.core.sharded import load_sharded

        tied = wrapped.pipeline.tied if wrapped.pipeline is not None else None
        load_sharded(directory, module=wrapped.module, optimizer=optimizer, adapters_only=base is not None,
                     optim_aliases=tied.optim_aliases() if tied is not None else None)
    else:
        _load_unsharded(directory, data, wrapped=wrapped, optimizer=optimizer, device=device,
                        adapters_only=base is not None)
    return _map_position(directory, data, world_size=world_size, batch_size=batch_size,
                         epoch_rows=epoch_rows, split=split)


def _load_unsharded(directory, data: dict, *, wrapped, optimizer, device, adapters_only: bool = False) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    stage = wrapped.pipeline is not None  # a pipeline rank reads its stages' part of the whole model
    weights = read_weights(directory, wrapped.base, keys=_trainable(wrapped.base) if adapters_only else None,
                           whole=wrapped.pipeline.whole if stage else None)
    optim_path = Path(directory) / OPTIM_FILE
    if not optim_path.is_file():
        raise CheckpointError(f"{directory}: no {OPTIM_FILE} (partial checkpoint)")
    try:
        optim_state = torch.load(optim_path, map_location=device, weights_only=True)
    except Exception as exc:  # refuses pickled code: weights_only allows tensors and plain data
        raise CheckpointError(f"{optim_path}: refused or unreadable ({str(exc).splitlines()[0]})") from None
    if data.get("format_version", 1) < 2:  # optimizer state keyed by position
        if wrapped.sharded:
            raise CheckpointError(f"{directory}: format 1 checkpoint; resume it with the "
                                  "strategy that wrote it (none/ddp)")
        wrapped.base.load_state_dict(weights)
        optimizer.load_state_dict(optim_state)
        return
    tied = wrapped.pipeline.tied if stage else None
    for name, first in (tied.optim_aliases() if tied is not None else {}).items():
        if first in optim_state.get("state", {}):  # the last stage's copy of a tied head: the one state
            optim_state["state"][name] = optim_state["state"][first]
    if wrapped.sharded:  # full tensors in, each rank keeps its shard
        full = StateDictOptions(full_state_dict=True, strict=not adapters_only,
                                ignore_frozen_params=adapters_only)
        # torch annotates an invariant dict[str, ValueType] where any tensor mapping is read
        set_model_state_dict(wrapped.module, weights, options=full)  # type: ignore[arg-type]
        set_optimizer_state_dict(wrapped.module, optimizer, optim_state, options=full)
    else:
        wrapped.base.load_state_dict(weights, strict=not adapters_only)
        set_optimizer_state_dict(wrapped.base, optimizer, optim_state)


def split_changed_warning(directory: str | os.PathLike, state: dict, cfg: Any) -> str | None:
    """The warning for resuming a checkpoint (its `read_state`) written before the
    validation split was dealt by file name (no ``val_split`` in its layout), where this
    run's split is (`split_by_file`): its validation split now holds samples it trained
    on. None where nothing changed. The driver says it; the run goes on."""
    if "val_split" in (state.get("layout") or {}) or not split_by_file(SourceSpec.from_config(cfg)):
        return None
    return (f"warning: {directory} was written before the validation split was dealt by file name: this "
            "run's validation split holds samples it trained on, so its val_loss reads low (a new run does not)")


def _map_position(directory, data: dict, *, world_size: int, batch_size: int,
                  epoch_rows: int, split: bool = True) -> TrainState:
    """Micro-batch j of an epoch goes to rank j % world (with `split`; unsplit, every
    rank reads every micro-batch, as one process would): a rank's count times the rows
    per round is the epoch's position in rows, which the new layout must divide.
    `epoch_rows` is what the new layout reads per epoch (per rank, unsplit): at or past
    it, the next epoch starts. A layout that does not say (written before it recorded
    `split`) is taken to be split as the resuming run is."""
    state = TrainState(**data["state"])
    layout = data.get("layout")
    if not layout:  # format 1 (no layout recorded): resumed as written
        return state
    was_split = layout.get("split", split)
    same = (layout["world_size"], layout["batch_size"], was_split) == (world_size, batch_size, split)
    if not batch_size or same:
        return state
    rows = state.batches_in_epoch * (layout["world_size"] if was_split else 1) * layout["batch_size"]
    if epoch_rows and rows >= epoch_rows:
        state.epoch, state.batches_in_epoch = state.epoch + 1, 0
        return state
    per_round = (world_size if split else 1) * batch_size
    if rows % per_round:
        raise CheckpointError(
            f"{directory}: data position {rows} rows into epoch {state.epoch} (written by "
            f"{_round(layout['world_size'], 'batch', layout['batch_size'], was_split)}) is not a whole "
            f"number of rounds of {_round(world_size, 'data.batch_size', batch_size, split)} = {per_round} rows")
    state.batches_in_epoch = rows // per_round
    return state


def _round(world: int, name: str, batch: int, split: bool) -> str:
    return f"{world} worker(s) x {name} {batch}" if split else f"{name} {batch} (unsplit: every worker reads it)"
