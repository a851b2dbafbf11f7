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

import json
import os
from pathlib import Path

import torch
import yaml
from torch import nn

from raytrain_platform.config import JobConfig, load_config
from raytrain_platform.core.checkpoint import WEIGHTS_FILE, read_state, read_weights, write_state
from raytrain_platform.core.sharded import load_full_model_state
from raytrain_platform.errors import CheckpointError, ConfigError
from raytrain_platform.models.registry import get_family
from raytrain_platform.core.rundir import CONFIG_FILE, STATE_FILE, latest_checkpoint, write_json

__all__ = ["export_checkpoint", "load_model_for_inference", "EXPORT_INFO_FILE"]

EXPORT_INFO_FILE = "export.json"


def _find_checkpoint(path: Path) -> Path:
    if (path / STATE_FILE).is_file():
        return path
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
    raise CheckpointError(f"{path}: not a checkpoint directory (no {STATE_FILE}), a run "
                          f"directory with a complete checkpoint, nor an export (no {EXPORT_INFO_FILE})")


def _load_job_config(ckpt: Path) -> JobConfig:
    path = ckpt / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {CONFIG_FILE} (partial checkpoint)")
    try:
        return load_config(yaml.safe_load(path.read_text()))
    except (ConfigError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{path}: unusable config ({exc})") from None


def _read_export_info(directory: Path) -> dict:
    try:
        info = json.loads((directory / EXPORT_INFO_FILE).read_text())
        return {"step": int(info["step"]), "metrics": dict(info.get("metrics") or {})}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{directory / EXPORT_INFO_FILE}: unreadable ({exc})") from None


def load_model_for_inference(path: str | os.PathLike, *, servable: bool = False
                             ) -> tuple[nn.Module, JobConfig, dict]:
    """The model a run directory (its latest checkpoint), a checkpoint (sharded or not)
    or an export holds, its weights loaded without running code, in eval mode on the CPU.

    Returns ``(model, config, info)``; `info` holds ``source``, ``step``, ``metrics``,
    ``sharded_source``, ``model`` (name, kwargs, task) and ``num_params``. With `servable`,
    a model its family cannot serve is refused before the model is built.
    A missing, partial or mismatched checkpoint is a `CheckpointError`.

    >>> model, cfg, info = load_model_for_inference("runs/quickstart")   # doctest: +SKIP
    >>> info["step"], cfg.model.name                                      # doctest: +SKIP
    (60, 'gpt')
    """
    src = Path(path)
    if not src.exists():
        raise CheckpointError(f"{src}: no such file or directory")
    is_export = (src / EXPORT_INFO_FILE).is_file() and not (src / STATE_FILE).is_file()
    ckpt = src if is_export else _find_checkpoint(src)
    if is_export:
        step_metrics, sharded = _read_export_info(ckpt), False
    else:
        state = read_state(ckpt)
        step_metrics = {"step": state["state"]["step"], "metrics": state.get("metrics", {})}
        sharded = bool(state.get("sharded"))
    cfg = _load_job_config(ckpt)
    family = get_family(cfg.model.name)
    if servable:  # asked before the model is built: no user code imported for a refusal
        try:
            family.serving(cfg.model.kwargs, cfg.model.task)
        except ConfigError as exc:
            raise CheckpointError(f"{ckpt}: model.name = {cfg.model.name!r}: not servable "
                                  f"(expected {exc.allowed})") from None
    torch.manual_seed(cfg.train.seed)
    model = family.build(cfg.model.kwargs)  # plain, on the CPU: the full tensors DCP fills in
    weights = load_full_model_state(ckpt, model) if sharded else read_weights(ckpt, model)
    model.load_state_dict(weights)  # names and shapes checked once more, against the model
    model.eval()
    info = {"source": str(ckpt.resolve()), **step_metrics, "sharded_source": sharded,
            "model": {"name": cfg.model.name, "kwargs": cfg.model.kwargs, "task": cfg.model.task},
            "num_params": sum(p.numel() for p in model.parameters())}
    return model, cfg, info


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike | None = None, *,
                      format: str = "safetensors", max_shard_size: str = "5GB") -> Path:
    """Export the checkpoint of `path` (a run directory: its latest checkpoint; or a
    checkpoint directory) into `out` (default: ``export/`` in its run directory).

    ``format="safetensors"``: ``model.safetensors`` (the family's key names) +
    ``config.yaml`` + ``export.json``, what ``rtp serve`` reads. ``format="hf"`` (hf
    models): a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` load, plus ``export.json``."""
    if format not in ("safetensors", "hf"):
        raise ConfigError("--format", format, "one of ['safetensors', 'hf']")
    model, cfg, info = load_model_for_inference(path)
    family = get_family(cfg.model.name)
    ckpt = Path(info["source"])
    target = Path(out) if out is not None else ckpt.parent / "export"
    target.mkdir(parents=True, exist_ok=True)
    if format == "hf":
        family.export_hf(model, cfg.model.kwargs, str(target), tokenizer=getattr(cfg.data, "tokenizer", None),
                         max_shard_size=max_shard_size)
    else:
        state = family.export_state_dict(model.state_dict(), cfg.model.kwargs)
        write_state(target / WEIGHTS_FILE, state, kind="export")
        (target / CONFIG_FILE).write_text(cfg.to_yaml())
    write_json(target / EXPORT_INFO_FILE, {**info, "format": format})
    return target
