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
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from raytrain_platform.config import JobConfig, load_config, read_yaml
from raytrain_platform.core.checkpoint import WEIGHTS_FILE, read_state, read_weights, write_state
from raytrain_platform.core.sharded import load_full_model_state, load_saved_tensors
from raytrain_platform.core.weights import load_safetensors
from raytrain_platform.errors import CheckpointError, ConfigError, first_line, folder_problem
from raytrain_platform.models.lora import ADAPTER, is_adapter, merge_lora
from raytrain_platform.models.registry import get_family
from raytrain_platform.models.user import IMPORT_PATH
from raytrain_platform.units import parse_size
from raytrain_platform.core.rundir import CONFIG_FILE, STATE_FILE, latest_checkpoint, write_json

__all__ = ["export_checkpoint", "load_model_for_inference", "load_hf_directory", "is_hf_directory",
           "EXPORT_INFO_FILE", "attach_adapters", "load_lora_base", "read_adapters"]

EXPORT_INFO_FILE = "export.json"
HF_CONFIG_FILE = "config.json"  # a Hugging Face folder's model config


def _find_checkpoint(path: Path) -> Path:
    if (path / STATE_FILE).is_file():
        return path
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
    raise CheckpointError(f"{path}: not a checkpoint directory (no {STATE_FILE}), a run "
                          f"directory with a complete checkpoint, nor an export (no {EXPORT_INFO_FILE})")


TRUST_HINT = "--trust-builder (trust_builder=True)"


def _load_job_config(ckpt: Path, *, trust_builder: bool = False) -> JobConfig:
    """The run's config. A run whose ``model.name`` is a Python import path (a user
    builder) names code that building its model imports and calls: refused unless the
    caller trusts the directory (`trust_builder`), as `transformers` refuses remote code.
    A run directory from elsewhere could otherwise name any installed function."""
    path = ckpt / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {CONFIG_FILE} (partial checkpoint)")
    try:
        raw = read_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError("config", type(raw).__name__, "a mapping of sections (model, data, train, ...)")
        cfg = load_config(raw)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: unusable config ({first_line(exc)})") from None
    if IMPORT_PATH.match(cfg.model.name) and not trust_builder:
        raise CheckpointError(f"{path}: model.name {cfg.model.name!r} is a Python import path: loading "
                              f"this run imports and calls it; pass {TRUST_HINT} if you trust this "
                              "run directory")
    return cfg


def _read_export_info(directory: Path) -> dict:
    try:
        info = json.loads((directory / EXPORT_INFO_FILE).read_text())
        step, metrics = info["step"], info.get("metrics") or {}
        if type(step) is not int or step < 0 or not isinstance(metrics, dict):
            raise ValueError(f"step {step!r} (expected an integer >= 0) or metrics not an object")
        return {"step": step, "metrics": metrics}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{directory / EXPORT_INFO_FILE}: unreadable ({exc})") from None


def load_model_for_inference(path: str | os.PathLike, *, servable: bool = False, merge_adapters: bool = True,
                             trust_builder: bool = False) -> tuple[nn.Module, JobConfig, dict]:
    """The model a run directory (its latest checkpoint), a checkpoint (sharded or not)
    or an export holds, its weights loaded without running code, in eval mode on the CPU.

    Returns ``(model, config, info)``; `info` holds ``source``, ``step``, ``metrics``,
    ``sharded_source``, ``model`` (name, kwargs, task) and ``num_params``. With `servable`,
    a model its family cannot serve is refused before the model is built.
    A missing, partial or mismatched checkpoint is a `CheckpointError`. A LoRA run's
    adapters are merged into its base (`merge_adapters`, the default), or kept apart.
    A run of a user builder (``model.name: "pkg.module:fn"``) is loaded only with
    `trust_builder`: building it imports and calls what its config names.

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
    cfg = _load_job_config(ckpt, trust_builder=trust_builder)
    family = get_family(cfg.model.name)
    if servable:  # asked before the model is built: no user code imported for a refusal
        try:
            family.serving(cfg.model.kwargs, cfg.model.resolved_task)
        except ConfigError as exc:
            raise CheckpointError(f"{ckpt}: model.name = {cfg.model.name!r}: not servable "
                                  f"(expected {exc.allowed})") from None
    torch.manual_seed(cfg.train.seed)
    model = family.build(cfg.model.kwargs)  # plain, on the CPU: the full tensors DCP fills in
    if cfg.model.lora is not None and not is_export:  # the base from its own files, then the adapters
        model = _load_adapters(model, cfg, ckpt, sharded=sharded, merge=merge_adapters)
    else:
        weights = load_full_model_state(ckpt, model) if sharded else read_weights(ckpt, model)
        model.load_state_dict(weights)  # names and shapes checked once more, against the model
    model.eval()
    info = {"source": str(ckpt.resolve()), **step_metrics, "sharded_source": sharded,
            "model": {"name": cfg.model.name, "kwargs": cfg.model.kwargs, "task": cfg.model.task},
            "num_params": sum(p.numel() for p in model.parameters()),
            # A LoRA run: its adapters and base (serve/adapters.py shares one base among runs).
            "lora": None if cfg.model.lora is None or is_export else {**cfg.model.lora, "base": state.get("base")},
            # What serving reads text with, and (lm) the context it was trained on.
            "tokenizer": cfg.data.tokenizer or family.default_tokenizer(cfg.model.kwargs),
            "seq_len": cfg.data.seq_len}
    return model, cfg, info


def is_hf_directory(path: Path) -> bool:
    """A Hugging Face model folder (``rtp export --format hf``, or a downloaded one):
    a ``config.json`` and no training config."""
    return (path / HF_CONFIG_FILE).is_file() and not (path / CONFIG_FILE).is_file()


def load_hf_directory(path: Path) -> tuple[nn.Module, dict]:
    """The causal LM of a Hugging Face folder through the hf family: its checks
    (no remote code, safetensors only), its build, the weights read with the same safe
    loader as training. Step and metrics come from ``export.json`` when
    ``rtp export`` wrote one (else step 0)."""
    family = get_family("hf")
    try:
        kwargs = family.resolve_kwargs({"path": str(path)})
        family.precheck(kwargs, block_class=None, needs_blocks=None)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: not a servable Hugging Face model ({exc})") from None
    step_metrics = _read_export_info(path) if (path / EXPORT_INFO_FILE).is_file() else {"step": 0, "metrics": {}}
    model = family.build(kwargs)
    load_safetensors(model, family.pretrained_files(kwargs) or [])
    model.eval()
    info = {"source": str(path.resolve()), **step_metrics, "sharded_source": False,
            "model": {"name": family.name, "kwargs": kwargs, "task": "lm"},
            "num_params": sum(p.numel() for p in model.parameters()), "tokenizer": kwargs["path"],
            "seq_len": None}
    return model, info


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


def _load_adapters(model: nn.Module, cfg: JobConfig, ckpt: Path, *, sharded: bool, merge: bool) -> nn.Module:
    """A LoRA run's model: `model` (its base, built with the run's seed) gets the
    pretrained base weights (if any) from their own files, checked to be the base the
    adapters were trained on, then its adapters from the checkpoint; merged or not."""
    from raytrain_platform.models.lora import apply_lora

    assert cfg.model.lora is not None, "called for LoRA runs only"
    load_lora_base(model, cfg, ckpt)
    model = apply_lora(model, cfg.model.lora, model_name=cfg.model.name)
    attach_adapters(model, read_adapters(ckpt, sharded=sharded), ckpt=ckpt)
    return merge_lora(model) if merge else model


def load_lora_base(model: nn.Module, cfg: JobConfig, ckpt: Path) -> None:
    """Fill `model` (the family's plain build, seeded by the run's seed) with the
    pretrained base weights, after checking they are the base `ckpt`'s adapters were
    trained on (a `CheckpointError` naming both otherwise)."""
    from raytrain_platform.core.adapters import base_identity, check_base

    m = cfg.model
    files = get_family(m.name).pretrained_files(m.kwargs)
    check_base(str(ckpt), read_state(ckpt).get("base"),
               base_identity(model_name=m.name, kwargs=m.kwargs, seed=cfg.train.seed, files=files))
    if files:
        load_safetensors(model, files)


def read_adapters(ckpt: Path, *, sharded: bool) -> dict[str, torch.Tensor]:
    """The adapter tensors of a LoRA checkpoint, by the trained model's own names."""
    if sharded:
        return load_saved_tensors(ckpt)
    try:
        return load_file(str(ckpt / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{ckpt / WEIGHTS_FILE}: not a valid safetensors file ({exc})") from None


def attach_adapters(model: nn.Module, adapters: dict[str, torch.Tensor], *, ckpt: Path,
                    adapter: str = ADAPTER) -> None:
    """Copy `adapters` (saved as adapter ``default``) into `model`'s adapter `adapter`;
    the names must be exactly the model's adapters (a `CheckpointError` otherwise)."""
    own = {name.replace(f".{ADAPTER}.", f".{adapter}."): name for name in adapters}
    expected = {n for n, _ in model.named_parameters() if is_adapter(n) and f".{adapter}." in n}
    if set(own) != expected:
        diff = sorted(set(own) ^ expected)[:3]
        raise CheckpointError(f"{ckpt}: its adapters do not fit this model's model.lora (differ: {diff})")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, source in own.items():
            if params[name].shape != adapters[source].shape:
                raise CheckpointError(f"{ckpt}: {source} has shape {list(adapters[source].shape)}, the "
                                      f"model {list(params[name].shape)}")
            params[name].copy_(adapters[source])


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
