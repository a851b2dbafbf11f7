"""`rtp sweep SWEEP.yaml [--set KEY=VALUE ...]`: a sweep file is the base config (inline,
or a path relative to the sweep file) plus the space and the search settings.

    name: tabular-lr                 # sweep directory <storage_path>/<name>/; rerun = resume
    base: tabular.yaml               # or an inline config mapping
    space:
      train.lr: {loguniform: [1.0e-4, 1.0e-2]}
      data.batch_size: [32, 64]
    metric: val_loss                 # or throughput (samples/s, max), or any reported metric
    scheduler: asha                  # fifo (default) | asha | {asha: {grace_period: 20}}
    num_samples: 2

``--set`` takes a sweep key (``--set num_samples=4``) or a base config field
(``--set train.max_steps=50``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


from raytrain_platform.config import add_set_flag, parse_override, read_yaml
from raytrain_platform.errors import ConfigError

__all__ = ["SWEEP_KEYS", "add_sweep_arguments", "load_sweep_file", "run_sweep"]

# sweep-file key -> sweep() keyword (base and space are positional)
SWEEP_KEYS = {"name": "name", "base": None, "space": None, "metric": "metric", "mode": "mode",
              "num_samples": "num_samples", "scheduler": "scheduler",
              "max_concurrent": "max_concurrent", "seed": "seed", "storage_path": "storage_path"}


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_file", metavar="SWEEP.yaml", help="the sweep file (base config + space)")
    add_set_flag(p, help="override a sweep key (num_samples=4) or a base config field "
                         "(train.max_steps=50); repeatable")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: $RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("--verbose", action="store_true", help="show Ray's own logs too")


def _read_yaml(path: Path, what: str) -> Any:
    return read_yaml(path, what)


def load_sweep_file(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The sweep file as `sweep()` keyword arguments (``base_config`` and ``space``
    included); `overrides` split between sweep keys and base config fields."""
    path = Path(path)
    data = _read_yaml(path, "sweep file")
    if not isinstance(data, dict):
        raise ConfigError("sweep file", str(path), f"a mapping with keys {sorted(SWEEP_KEYS)}")
    unknown = sorted(set(data) - set(SWEEP_KEYS))
    if unknown:
        raise ConfigError(unknown[0], data[unknown[0]], f"a sweep key; keys are {sorted(SWEEP_KEYS)}")
    for key in ("base", "space"):
        if key not in data:
            raise ConfigError(key, None, "a value (required in a sweep file)")
    base = data["base"]
    if isinstance(base, str):
        base = _read_yaml(path.parent / base, "base")
    if not isinstance(base, dict):
        raise ConfigError("base", data["base"], "a config mapping or the path of a config YAML")
    kwargs: dict[str, Any] = {kw: data[key] for key, kw in SWEEP_KEYS.items() if kw and key in data}
    config_overrides = []
    for text in overrides or []:
        key, value = parse_override(text)
        kw = SWEEP_KEYS.get(key)  # None: a base config field
        if kw:
            kwargs[kw] = value
        else:
            config_overrides.append(text)
    return {"base_config": base, "space": data["space"], "overrides": config_overrides, **kwargs}


def run_sweep(args: argparse.Namespace) -> int:
    from raytrain_platform.tune.sweep import sweep

    kwargs = load_sweep_file(args.sweep_file, args.overrides)
    result = sweep(**kwargs, address=args.address, verbose=args.verbose)
    if result.best_trial:
        return 0
    # No trial finished: bad input (2) when every trial that ran was refused for it.
    ran = result.trials[result.trials["status"] != "not run"]
    return 2 if len(ran) and (ran["status"] == "invalid").all() else 1
