"""What an evaluation reads and where its results go: a run directory, a checkpoint or an
export -> a Hugging Face folder for lm_eval (exported first, into a temporary folder,
unless it is one already), the step it holds, and the run it belongs to.

- a run directory (its latest checkpoint) or a checkpoint: exported with
  ``rtp export --format hf`` into a temporary folder; results in the run directory.
- a Hugging Face folder (``rtp export --format hf``): read as it is; results in the run
  it was exported from (``export.json``'s source) while that run exists, else beside it.
- a safetensors export (``rtp export``): exported again as a Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from raytrain_platform.config import JobConfig
from raytrain_platform.core.rundir import CONFIG_FILE, STATE_FILE
from raytrain_platform.errors import CheckpointError, ConfigError

__all__ = ["EvalTarget", "exports_hf", "prepared_target"]

_ARG = "RUN_OR_EXPORT"


@dataclass
class EvalTarget:
    """A model folder lm_eval reads, with what the results are filed under."""

    model_dir: Path  # a Hugging Face folder
    source: str  # what was asked for, resolved
    step: int  # the checkpoint's optimizer step (0 for a folder of unknown origin)
    run_dir: Path | None  # the run it belongs to: its eval/ folder, its trackers
    results_dir: Path  # the run directory, else the export folder
    config: JobConfig | None  # the run's config (its run.tracking), when known


def _run_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint directory lies in, if it is one."""
    run = checkpoint.parent
    return run if (run / CONFIG_FILE).is_file() and (checkpoint / STATE_FILE).is_file() else None


def _run_config(run_dir: Path | None) -> JobConfig | None:
    if run_dir is None:
        return None
    from raytrain_platform.config import load_config

    try:
        return load_config(str(run_dir / CONFIG_FILE))
    except Exception:  # noqa: BLE001 - an unreadable config only costs the tracking
        return None


def _exported_from(folder: Path) -> tuple[int, Path | None]:
    """The step and source run ``rtp export`` recorded in ``export.json`` (0, None without)."""
    from raytrain_platform.inference import EXPORT_INFO_FILE, read_export_info

    if not (folder / EXPORT_INFO_FILE).is_file():
        return 0, None
    step = read_export_info(folder)["step"]
    source = json.loads((folder / EXPORT_INFO_FILE).read_text()).get("source")
    return step, _run_of(Path(source)) if isinstance(source, str) else None


def exports_hf(model_name: str) -> bool:
    """Whether runs of `model_name`'s family export as Hugging Face folders (lm_eval's input)."""
    from raytrain_platform.models.family import ModelFamily
    from raytrain_platform.models.registry import get_family

    return type(get_family(model_name)).export_hf is not ModelFamily.export_hf


def _check_exportable(path: Path, trust_builder: bool) -> tuple[Path, int]:
    """The checkpoint `path` holds and its step, for a family that writes Hugging Face
    folders; a one-line error otherwise, before any weight is read."""
    from raytrain_platform.core.checkpoint import read_state
    from raytrain_platform.inference import EXPORT_INFO_FILE, find_checkpoint, load_job_config, read_export_info

    is_export = (path / EXPORT_INFO_FILE).is_file() and not (path / STATE_FILE).is_file()
    ckpt = path if is_export else find_checkpoint(path)
    cfg = load_job_config(ckpt, trust_builder=trust_builder)
    if not exports_hf(cfg.model.name):
        raise ConfigError(_ARG, str(path), f"a run of a Hugging Face model (lm_eval reads a Hugging Face "
                          f"folder; model.name {cfg.model.name!r} exports none)")
    step = read_export_info(ckpt)["step"] if is_export else read_state(ckpt)["state"]["step"]
    return ckpt, step


@contextlib.contextmanager
def prepared_target(path: str | Path, *, trust_builder: bool = False) -> Iterator[EvalTarget]:
    """The `EvalTarget` of `path`; a run or checkpoint is exported into a temporary
    folder that is removed when the block ends."""
    from raytrain_platform.inference import is_hf_directory

    src = Path(path).expanduser()
    if not src.is_dir():
        raise ConfigError(_ARG, str(path), "a run directory, checkpoint or export (no such folder)")
    src = src.resolve()
    if is_hf_directory(src):
        step, run_dir = _exported_from(src)
        yield EvalTarget(src, str(src), step, run_dir, run_dir or src, _run_config(run_dir))
        return
    try:
        ckpt, step = _check_exportable(src, trust_builder)
    except CheckpointError as exc:
        raise ConfigError(_ARG, str(path), f"a run directory, checkpoint or export ({exc})") from None
    from raytrain_platform.export import export_checkpoint

    run_dir = _run_of(ckpt)
    with tempfile.TemporaryDirectory(prefix="rtp-eval-") as tmp:
        model_dir = export_checkpoint(ckpt, Path(tmp) / "model", format="hf", trust_builder=trust_builder)
        yield EvalTarget(model_dir, str(src), step, run_dir, run_dir or src, _run_config(run_dir))
