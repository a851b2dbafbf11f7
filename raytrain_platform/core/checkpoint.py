"""Checkpoints as directories. Nothing here unpickles arbitrary objects:

- ``model.safetensors``: the full model state (safetensors: plain tensors, no code),
- ``optimizer.pt``: ``optimizer.state_dict()``, read back with ``weights_only=True``,
- ``trainer_state.json``: step, data position, LR schedule state, the step's metrics,
- ``config.yaml``: the resolved job config.

Unsharded strategies (none, ddp) hold the full state on every rank, so rank 0
alone writes, and the checkpoint loads at any world size.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from raytrain_platform.errors import CheckpointError
from raytrain_platform.rundir import CONFIG_FILE, STATE_FILE, write_json

__all__ = ["TrainState", "save_checkpoint", "load_checkpoint", "read_state", "load_model_weights",
           "WEIGHTS_FILE", "OPTIM_FILE"]

WEIGHTS_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.pt"
FORMAT_VERSION = 1


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch the next micro-batch comes from
    batches_in_epoch: int = 0  # micro-batches this rank has consumed in `epoch`
    samples_seen: int = 0  # over all ranks


def save_checkpoint(directory: str | os.PathLike, *, par, optimizer: torch.optim.Optimizer,
                    state: TrainState, lr: float, config_yaml: str, metrics: dict,
                    is_rank0: bool) -> None:
    """Write this rank's part of a checkpoint into `directory` (unsharded: rank 0 only)."""
    if par.sharded:
        raise NotImplementedError("sharded checkpoints are written by the strategy's own saver")
    if not is_rank0:
        return
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in par.base.state_dict().items()}
    save_file(weights, str(d / WEIGHTS_FILE), metadata={"format": "raytrain_platform", "version": "1"})
    torch.save(optimizer.state_dict(), d / OPTIM_FILE)
    (d / CONFIG_FILE).write_text(config_yaml)
    # Written last: its presence marks the checkpoint complete.
    write_json(d / STATE_FILE, {"format_version": FORMAT_VERSION, "state": asdict(state),
                                "scheduler": {"step": state.step, "lr": lr},
                                "metrics": metrics, "sharded": False})


def read_state(directory: str | os.PathLike) -> dict:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a complete checkpoint (no {STATE_FILE})")
    try:
        data = json.loads(path.read_text())
        TrainState(**data["state"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable trainer state ({exc})") from None
    return data


def load_model_weights(directory: str | os.PathLike, model: torch.nn.Module) -> None:
    """Load safetensors weights into `model`; a mismatch names the keys."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} (partial checkpoint, or written "
                              "sharded: use `rtp export` first)")
    try:
        weights = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        detail = "; ".join(x for x in (
            f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else "",
            f"shape mismatch {wrong[:3]}" if wrong else "") if x)
        raise CheckpointError(f"{path}: checkpoint is for another model ({detail})")
    model.load_state_dict(weights)


def load_checkpoint(directory: str | os.PathLike, *, par, optimizer: torch.optim.Optimizer,
                    device: torch.device) -> TrainState:
    """Restore model and optimizer in place; returns the train state to continue from."""
    data = read_state(directory)
    if data.get("sharded"):
        raise CheckpointError(f"{directory}: a sharded checkpoint; its strategy must load it")
    load_model_weights(directory, par.base)
    optim_path = Path(directory) / OPTIM_FILE
    if not optim_path.is_file():
        raise CheckpointError(f"{directory}: no {OPTIM_FILE} (partial checkpoint)")
    try:
        optim_state = torch.load(optim_path, map_location=device, weights_only=True)
    except Exception as exc:  # refuses pickled code: weights_only allows tensors and plain data
        raise CheckpointError(f"{optim_path}: refused or unreadable ({str(exc).splitlines()[0]})") from None
    optimizer.load_state_dict(optim_state)
    return TrainState(**data["state"])
