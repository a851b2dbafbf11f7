"""What a Serve deployment of checkpoints is configured with, parsed and checked before
Ray starts. The same options come from `rtp serve` flags, from ``serve run
pipelines.serve:app key=value`` (strings) and from a Serve config's ``args`` (YAML
values). No torch or Ray here.

>>> opts = parse_serve_args({"checkpoint": "runs/a,b=runs/b", "max_batch_size": "16"})
>>> [spec.name for spec in opts.checkpoints], opts.max_batch_size
(['a', 'b'], 16)
>>> parse_serve_args({"checkpoint": "runs/a", "max_batch_size": "0"})
Traceback (most recent call last):
...
raytrain_platform.errors.ConfigError: max_batch_size = '0': expected an integer >= 1 and <= 4096
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from raytrain_platform.errors import ConfigError
from raytrain_platform.core.rundir import STATE_FILE, latest_checkpoint
from raytrain_platform.serve.auth import digests, keys_from_env

__all__ = ["CheckpointSpec", "ServeOptions", "parse_serve_args", "option_fields", "MODEL_ID_PATTERN"]

MODEL_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._@/-]{0,127}"
_EXPORT_INFO = "export.json"  # raytrain_platform.inference.EXPORT_INFO_FILE, without importing torch
_HF_CONFIG = "config.json"  # a Hugging Face model folder (inference.HF_CONFIG_FILE)
INT_OPTION_MAX = 2**31 - 1  # what Serve and its C++ core take as a count


@dataclass(frozen=True)
class CheckpointSpec:
    """One served model: the id requests name it by, and its checkpoint (absolute)."""

    name: str
    path: str


def _opt(default: Any, help: str, minimum: float | None = None, maximum: float | None = None) -> Any:
    return field(default=default, metadata={"help": help, "min": minimum, "max": maximum})


@dataclass
class ServeOptions:
    """Every knob of a served deployment; the defaults suit a laptop."""

    checkpoints: list[CheckpointSpec] = field(default_factory=list)
    num_replicas: int = _opt(1, "replicas when not autoscaling", 1)
    min_replicas: int = _opt(0, "autoscaling: fewest replicas (with max_replicas)", 0)
    max_replicas: int = _opt(0, "autoscaling: most replicas; 0 = no autoscaling, num_replicas fixed", 0)
    target_ongoing_requests: float = _opt(2.0, "autoscaling: requests in flight per replica to aim for", 0.01)
    upscale_delay_s: float = _opt(30.0, "autoscaling: how long load must call for more replicas "
                                        "before one is added, seconds", 0.0)
    downscale_delay_s: float = _opt(600.0, "autoscaling: how long load must call for fewer replicas "
                                           "before one is removed, seconds", 0.0)
    look_back_period_s: float = _opt(30.0, "autoscaling: window the requests in flight are averaged "
                                           "over, seconds (keep it above Serve's 10 s metrics push)", 1.0)
    max_ongoing_requests: int = _opt(64, "requests a replica takes at once (the rest queue); "
                                         "at least max_batch_size for full batches", 1)
    cpus_per_replica: float = _opt(1.0, "CPUs reserved per replica (also its torch threads)", 0.01)
    use_gpu: bool = _opt(False, "one GPU per replica, the models on it")
    trust_builder: bool = _opt(False, "serve runs whose model.name is a Python import path (a user "
                                      "builder): loading them imports and calls the code their config names")
    max_batch_size: int = _opt(32, "requests per dynamic batch (serve.batch); 1 = no batching", 1, 4096)
    batch_wait_timeout_s: float = _opt(0.005, "longest wait for a batch to fill, seconds", 0.0, 10.0)
    max_models_per_replica: int = _opt(3, "models a replica keeps loaded (LRU)", 1)
    max_batch_rows: int = _opt(1024, "feature rows per /v1/predict request", 1)
    max_prompt_bytes: int = _opt(4096, "UTF-8 bytes per /v1/generate prompt", 1)
    max_new_tokens: int = _opt(256, "largest max_new_tokens a request may ask for", 1)
    max_body_bytes: int = _opt(1 << 20, "request body size limit, bytes (larger: 413)", 64)
    # API keys (serve/auth.py), as SHA-256 digests: the keys themselves never reach the
    # deployment's arguments. `api_key_env` names the variable they came from, which is
    # what a written config records.
    api_key_digests: tuple[bytes, ...] = field(default=(), repr=False)
    api_key_env: str | None = None

    def to_args(self) -> dict:
        """The builder arguments (`parse_serve_args` input) that give these options back
        (API keys as the variable they are read from, never the keys)."""
        args = {f.name: getattr(self, f.name) for f in option_fields()}
        args["checkpoint"] = [f"{spec.name}={spec.path}" for spec in self.checkpoints]
        if self.api_key_env:
            args["api_key_env"] = self.api_key_env
        return args


_NOT_OPTIONS = ("checkpoints", "api_key_digests", "api_key_env")  # set another way than a flag of their own


def option_fields() -> list[dataclasses.Field]:
    """The tunable options (every field but the checkpoints and API keys), with help and bounds."""
    return [f for f in dataclasses.fields(ServeOptions) if f.name not in _NOT_OPTIONS]


def _parse_value(f: dataclasses.Field, value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    lo, hi = f.metadata["min"], f.metadata["max"]
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f.name, value, "true or false")
    what = "an integer" if kind == "int" else "a number"
    if kind == "int" and hi is None:
        hi = INT_OPTION_MAX
    bounds = " and ".join(f"{op} {x:g}" if kind == "float" else f"{op} {x}"
                          for op, x in ((">=", lo), ("<=", hi)) if x is not None)
    try:
        if isinstance(value, bool) or (kind == "int" and isinstance(value, float)):
            raise ValueError
        number = int(value) if kind == "int" else float(value)
    except (TypeError, ValueError):
        raise ConfigError(f.name, value, f"{what} {bounds}".strip()) from None
    if not math.isfinite(number) or (lo is not None and number < lo) or (hi is not None and number > hi):
        raise ConfigError(f.name, value, f"{what} {bounds}".strip())
    return number


def _split_specs(value: Any) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise ConfigError("checkpoint", value, "a path, NAME=PATH, or a list (comma-separated) of them")
    items = [x.strip() for x in items if x.strip()]
    if not items:
        raise ConfigError("checkpoint", value, "at least one run directory, checkpoint or export")
    return items


def _is_model_dir(path: Path) -> bool:
    return ((path / STATE_FILE).is_file() or (path / _EXPORT_INFO).is_file()
            or (path / _HF_CONFIG).is_file() or latest_checkpoint(path) is not None)


def _expand(name: str | None, path: Path) -> list[CheckpointSpec]:
    """A run directory, checkpoint or export is one model (default id: its run's folder
    name); a folder of run directories (a sweep's trials) is one model per run."""
    if path.is_dir() and not _is_model_dir(path):
        runs = sorted(p for p in path.iterdir() if p.is_dir() and _is_model_dir(p))
        if runs:
            prefix = f"{name}/" if name else ""
            return [CheckpointSpec(prefix + run.name, str(run.resolve())) for run in runs]
    if name is None:
        in_run = (path / STATE_FILE).is_file() or (path / _EXPORT_INFO).is_file()
        name = (path.resolve().parent if in_run else path.resolve()).name
    return [CheckpointSpec(name, str(path.resolve()))]


def parse_checkpoints(value: Any) -> list[CheckpointSpec]:
    specs: list[CheckpointSpec] = []
    for item in _split_specs(value):
        name: str | None  # None: no NAME=, derived from the path
        name, sep, path = item.partition("=")
        if not sep:
            name, path = None, item
        elif not re.fullmatch(MODEL_ID_PATTERN, name):
            raise ConfigError("checkpoint", item, f"NAME=PATH with NAME matching {MODEL_ID_PATTERN}")
        specs += _expand(name, Path(path).expanduser())
    seen: set[str] = set()
    for spec in specs:
        if not re.fullmatch(MODEL_ID_PATTERN, spec.name):
            raise ConfigError("checkpoint", spec.path, f"a model id matching {MODEL_ID_PATTERN} "
                              f"(derived {spec.name!r}); name it with NAME=PATH")
        if spec.name in seen:
            raise ConfigError("checkpoint", spec.name, "distinct model ids; name the checkpoints "
                              "with NAME=PATH")
        seen.add(spec.name)
    return specs


def parse_serve_args(args: Mapping[str, Any]) -> ServeOptions:
    """Builder arguments (strings or typed values) -> checked `ServeOptions`.
    ``checkpoint`` is required; unknown keys are errors that list the known ones.
    ``api_key_env``: the environment variable holding the API keys (read here, where the
    application is built; unset or empty is an error, never an open endpoint)."""
    if not isinstance(args, Mapping):
        raise ConfigError("args", args, "a mapping of option names to values")
    known = {f.name: f for f in option_fields()}
    for key in args:
        if key not in ("checkpoint", "api_key_env") and key not in known:
            raise ConfigError(key, args[key], f"a known option: checkpoint, api_key_env, {', '.join(known)}")
    if "checkpoint" not in args:
        raise ConfigError("checkpoint", None, "a run directory, checkpoint or export to serve")
    values = {key: _parse_value(known[key], value) for key, value in args.items() if key in known}
    env = args.get("api_key_env")
    if env is not None and not isinstance(env, str):
        raise ConfigError("api_key_env", env, "an environment variable name")
    keys = digests(keys_from_env(env)) if env else ()
    opts = ServeOptions(checkpoints=parse_checkpoints(args["checkpoint"]), api_key_digests=keys,
                        api_key_env=env or None, **values)
    if opts.max_replicas and opts.min_replicas > opts.max_replicas:
        raise ConfigError("min_replicas", opts.min_replicas, f"<= max_replicas ({opts.max_replicas})")
    return opts
