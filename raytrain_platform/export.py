"""Export a checkpoint for serving: one consolidated ``model.safetensors`` (loads
without running code), the ``config.yaml`` it was trained with, and ``export.json``
(step, metrics, source). Works for unsharded (none/ddp) and sharded (fsdp, DCP)
checkpoints; shards are consolidated in this one process, no process group, no Ray.

    rtp export runs/quickstart --out exported/

>>> from raytrain_platform import export_checkpoint                  # doctest: +SKIP
>>> export_checkpoint("runs/quickstart")                             # doctest: +SKIP
PosixPath('runs/quickstart/export')
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from raytrain_platform.config import load_config
from raytrain_platform.core.checkpoint import WEIGHTS_FILE, read_state, read_weights, write_weights
from raytrain_platform.core.sharded import load_full_model_state
from raytrain_platform.errors import CheckpointError, ConfigError
from raytrain_platform.models import build_model
from raytrain_platform.rundir import CONFIG_FILE, STATE_FILE, latest_checkpoint, write_json

__all__ = ["export_checkpoint", "EXPORT_INFO_FILE"]

EXPORT_INFO_FILE = "export.json"


def _find_checkpoint(path: Path) -> Path:
    if (path / STATE_FILE).is_file():
        return path
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
    raise CheckpointError(f"{path}: not a checkpoint directory (no {STATE_FILE}) nor a run "
                          "directory with a complete checkpoint")


def _load_job_config(ckpt: Path):
    path = ckpt / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {CONFIG_FILE} (partial checkpoint)")
    try:
        return load_config(yaml.safe_load(path.read_text()))
    except (ConfigError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{path}: unusable config ({exc})") from None


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.yaml`` + ``export.json`` into `out`
    (default: ``export/`` next to the checkpoint, i.e. in its run directory).

    `path` is a run directory (its latest checkpoint is used) or a checkpoint directory."""
    ckpt = _find_checkpoint(Path(path))
    state = read_state(ckpt)
    cfg = _load_job_config(ckpt)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)  # plain, on the CPU: the full tensors DCP fills in
    if state.get("sharded"):
        weights = load_full_model_state(ckpt, model)
    else:
        weights = read_weights(ckpt, model)
    model.load_state_dict(weights)  # names and shapes checked once more, against the model
    target = Path(out) if out is not None else ckpt.parent / "export"
    target.mkdir(parents=True, exist_ok=True)
    write_weights(target / WEIGHTS_FILE, model, kind="export")
    (target / CONFIG_FILE).write_text(cfg.to_yaml())
    write_json(target / EXPORT_INFO_FILE, {
        "source": str(ckpt.resolve()), "step": state["state"]["step"],
        "metrics": state.get("metrics", {}), "sharded_source": bool(state.get("sharded")),
        "model": {"name": cfg.model.name, "kwargs": cfg.model.kwargs},
        "num_params": sum(p.numel() for p in model.parameters())})
    return target
