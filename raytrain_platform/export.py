"""Export a checkpoint for serving: one consolidated ``model.safetensors`` (loads
without running code), the ``config.yaml`` it was trained with, and ``export.json``
(step, metrics, source). Works for unsharded (none/ddp) and sharded (fsdp, DCP)
checkpoints; shards are consolidated in this one process, no process group, no Ray.
Also a Hugging Face folder (``--format hf``) or a PEFT adapter folder (``--format peft``).
The model is read by raytrain_platform/inference.py; this module writes it out, whole
or not at all.

    rtp export runs/quickstart --out exported/

>>> from raytrain_platform import export_checkpoint                  # doctest: +SKIP
>>> export_checkpoint("runs/quickstart")                             # doctest: +SKIP
PosixPath('runs/quickstart/export')
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch import nn

from raytrain_platform.config import JobConfig
from raytrain_platform.core.checkpoint import WEIGHTS_FILE, write_state
from raytrain_platform.core.rundir import CONFIG_FILE, STATE_FILE, write_json
from raytrain_platform.errors import ConfigError, folder_problem
from raytrain_platform.inference import EXPORT_INFO_FILE, load_model_for_inference
from raytrain_platform.models.registry import get_family
from raytrain_platform.units import parse_size

__all__ = ["export_checkpoint"]


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike | None = None, *,
                      format: str = "safetensors", max_shard_size: str = "5GB",
                      trust_builder: bool = False) -> Path:
    """Export the checkpoint of `path` (a run directory: its latest checkpoint; or a
    checkpoint directory) into `out` (default: ``export/`` in its run directory).

    ``format="safetensors"``: ``model.safetensors`` (the family's key names) +
    ``config.yaml`` + ``export.json``, what ``rtp serve`` reads. ``format="hf"`` (hf
    models): a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` load, plus ``export.json``. `trust_builder`: see
    `load_model_for_inference`."""
    if format not in ("safetensors", "hf", "peft"):
        raise ConfigError("--format", format, "one of ['safetensors', 'hf', 'peft']")
    if format == "hf":
        parse_size("--max-shard-size", max_shard_size)
    if out is not None:  # checked before anything is loaded or written
        _check_out(Path(out), Path(path), flag="--out")
    model, cfg, info = load_model_for_inference(path, merge_adapters=format != "peft", trust_builder=trust_builder)
    family = get_family(cfg.model.name)
    ckpt = Path(info["source"])
    target = Path(out) if out is not None else ckpt.parent / "export"
    if out is None:  # a given --out was checked above
        _check_out(target, ckpt, flag="the default export folder")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        final = target.resolve()  # a symlinked folder: what it points to is replaced, the link kept
        staging = _staging(final)
    except OSError as exc:  # changed since `_check_out` looked
        raise ConfigError("--out" if out is not None else "the default export folder", str(target),
                          f"a folder that can be created and written ({_reason(exc)})") from None
    try:
        if format == "peft":
            _write_peft(model, cfg, staging)
        elif format == "hf":
            family.export_hf(model, cfg.model.kwargs, str(staging), tokenizer=getattr(cfg.data, "tokenizer", None),
                             max_shard_size=max_shard_size)
        else:
            state = family.export_state_dict(model.state_dict(), cfg.model.kwargs)
            write_state(staging / WEIGHTS_FILE, state, kind="export")
            # A LoRA run's adapters are merged in: the export is a plain model of its family.
            (staging / CONFIG_FILE).write_text(cfg.replace({"model.lora": None}).to_yaml())
        write_json(staging / EXPORT_INFO_FILE, {**info, "format": format})
        _swap_in(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _staging(final: Path) -> Path:
    """Where the export is written first: beside `final`, to be swapped in whole; inside
    it where its parent takes no new folder (a folder the user may write in, under one
    they may not)."""
    name = f".{final.name}.exporting-{os.getpid()}"
    try:
        staging = final.parent / name
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError:
        staging = final / name
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    return staging


def _swap_in(staging: Path, target: Path) -> None:
    """`staging`, written whole, becomes `target`; an earlier export there is replaced as
    a whole, so none of its files (a single ``model.safetensors`` beside a new sharded
    index, which loaders prefer) outlives it. A failed export leaves `target` as it was.
    A `target` that cannot be renamed (a mount point) or that holds `staging` gets the
    staged files in place of its own instead."""
    if staging.parent != target.parent:
        return _replace_contents(staging, target)
    old = target.parent / f".{target.name}.replaced-{os.getpid()}"
    try:
        if target.exists():
            target.rename(old)
    except OSError:  # EBUSY: a mounted volume
        return _replace_contents(staging, target)
    try:
        staging.rename(target)
    except BaseException:
        if old.exists():
            old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _replace_contents(staging: Path, target: Path) -> None:
    """`target`'s entries (an earlier export's: `_check_out`) go, `staging`'s move in."""
    target.mkdir(exist_ok=True)
    for entry in target.iterdir():
        if entry == staging:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for entry in staging.iterdir():
        shutil.move(str(entry), str(target / entry.name))
    staging.rmdir()


def _check_out(target: Path, source: Path, *, flag: str) -> None:
    """An export never writes over what it did not write: `target` is a new or empty
    directory, or an earlier export (``export.json``), which is replaced as a whole;
    never the source or a folder holding it, and never inside a checkpoint directory.
    ``RUN/export`` is the default. It can be written: created (its nearest existing
    folder takes new entries) or, where it exists, staged beside or inside (`_staging`)."""
    try:
        t = target.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise ConfigError(flag, str(target), f"a folder that can be created and written ({_reason(exc)})") from None
    if t.exists() and not t.is_dir():
        raise ConfigError(flag, str(target), "a directory (this is a file)")
    ours = (t / EXPORT_INFO_FILE).is_file()
    foreign = t.is_dir() and not ours and any(t.iterdir())
    in_checkpoint = any((d / STATE_FILE).exists() for d in (t, *t.parents))
    if source.resolve().is_relative_to(t) or foreign or in_checkpoint:
        raise ConfigError(flag, str(target), "a directory outside the source that holds no run, checkpoint or "
                          "model of its own: a new or empty one, or an earlier export (replaced as a whole)")
    problem = _unwritable(t)
    if problem is not None:
        raise ConfigError(flag, str(target), f"a folder that can be created and written ({problem})")


def _reason(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__


def _unwritable(t: Path) -> str | None:
    """Why the export cannot be written at `t` (resolved), or None: an existing folder is
    staged beside it or else inside it; a new one needs its nearest existing parent to be
    a folder that takes new entries. Nothing is created."""
    if t.is_dir() and folder_problem(t.parent) is None:
        return None
    return folder_problem(t)


def _write_peft(model: nn.Module, cfg: JobConfig, target: Path) -> None:
    """A PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``peft.PeftModel.from_pretrained(base, DIR)`` loads over the base model."""
    from transformers import PreTrainedModel

    from raytrain_platform.models.lora import adapted_peft_config, adapter_state

    if cfg.model.lora is None:
        raise ConfigError("--format", "peft", "safetensors or hf for a run without model.lora (a PEFT "
                          "adapter directory holds LoRA adapters)")
    # A causal LM of transformers loads as PeftModelForCausalLM; another module as a PeftModel.
    task_type = "CAUSAL_LM" if isinstance(model, PreTrainedModel) else None
    config = adapted_peft_config(model, cfg.model.lora, base_path=cfg.model.kwargs.get("path"), task_type=task_type)
    config.save_pretrained(str(target))
    write_state(target / "adapter_model.safetensors", adapter_state(model), format="pt")
