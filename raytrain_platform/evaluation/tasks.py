"""lm-evaluation-harness tasks, found and checked before any model is loaded: names in
the ``--include`` folders (lm_eval's ``TaskManager(include_path=...)``), task YAML files,
or lm_eval's own tasks (their data comes from the Hugging Face hub: offline by default
here, so only what its cache holds).

>>> check_tasks([], [])
Traceback (most recent call last):
...
raytrain_platform.errors.ConfigError: --tasks = []: expected at least one task name or task YAML file
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from raytrain_platform.errors import ConfigError, UserError, first_line

__all__ = ["INSTALL_HINT", "check_loadable", "check_tasks", "offline_by_default", "require_lm_eval"]

INSTALL_HINT = "pip install 'raytrain_platform[eval]' (lm-evaluation-harness with its API models)"
_SHOWN = 12  # task names listed in an error


def offline_by_default() -> None:
    """No hub access unless the user asked for it: models and data are local files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def require_lm_eval() -> None:
    """A UserError (one line, exit 2) when lm_eval or its API models' packages are missing."""
    try:
        import aiohttp  # noqa: F401 - local-completions' client
        import lm_eval  # noqa: F401
        import tenacity  # noqa: F401 - local-completions' retries
    except ImportError as exc:
        raise UserError(f"rtp eval needs lm-evaluation-harness ({exc.name} is not installed): {INSTALL_HINT}") from None
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines echo every argument


def _is_yaml(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml"))


def _manager(include: list[str], *, defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None, include_defaults=defaults)


def check_tasks(tasks: list[str], include: list[str], *, fields: tuple[str, str] = ("--tasks", "--include")) -> Any:
    """The `TaskManager` that knows every one of `tasks` (names or YAML files), or a
    ConfigError naming the first it does not (as `fields`: the flags, or the config's
    fields). lm_eval's own task index is read only when a name is not in the `include`
    folders (it takes seconds)."""
    tasks_field, include_field = fields
    if not tasks:
        raise ConfigError(tasks_field, tasks, "at least one task name or task YAML file")
    for folder in include:
        if not Path(folder).is_dir():
            raise ConfigError(include_field, folder, "a folder of lm_eval task YAML files (no such folder)")
    for spec in tasks:
        if _is_yaml(spec) and not Path(spec).is_file():
            raise ConfigError(tasks_field, spec, "a task name or an existing task YAML file (no such file)")
    require_lm_eval()
    offline_by_default()
    manager = _manager(include, defaults=False)
    names = [t for t in tasks if not _is_yaml(t)]
    if any(name not in manager.all_tasks for name in names):
        local = manager.all_tasks
        manager = _manager(include, defaults=True)
        for name in names:
            if name not in manager.all_tasks:
                shown = ", ".join(local[:_SHOWN]) + (", ..." if len(local) > _SHOWN else "")
                where = f"the {include_field} folders ({shown})" if local else f"an {include_field} folder"
                raise ConfigError(tasks_field, name, f"a task of {where} or of lm_eval, or a task YAML file")
    return manager


def check_loadable(manager: Any, tasks: list[str], *, field: str = "--tasks") -> None:
    """Each task built once and its data read (a local JSONL through ``dataset_path:
    json``): a task whose YAML or data fails is a ConfigError naming it, before any model
    is loaded. (lm_eval builds them again to evaluate: a local file reads in no time.)"""
    for spec in tasks:
        try:
            manager.load([spec])
        except Exception as exc:  # lm_eval's and datasets' own errors, of many types
            raise ConfigError(field, spec, f"a task whose YAML and data load ({first_line(exc)[:300]})") from None
