"""The served models: each checkpoint loaded once up front (so a missing, partial,
unsafe or mismatched one is a clear `CheckpointError` at start-up, never a crash on
the first request), described as plain data for ``GET /v1/models`` and the replicas.

>>> from raytrain_platform.serve.options import parse_serve_args
>>> catalog = load_catalog(parse_serve_args({"checkpoint": "runs/quickstart"}))  # doctest: +SKIP
>>> catalog["quickstart"]["task"], catalog["quickstart"]["step"]                     # doctest: +SKIP
('lm', 60)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from raytrain_platform.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

    from raytrain_platform.serve.options import ServeOptions

__all__ = ["load_catalog", "load_served_model", "describe"]


def load_served_model(model_id: str, path: str) -> tuple["nn.Module", dict]:
    """``(model, description)`` of one checkpoint, weights loaded without running code;
    errors name the model id."""
    from raytrain_platform.export import load_model_for_inference

    try:
        model, _cfg, info = load_model_for_inference(path, servable=True)
    except CheckpointError as exc:
        raise CheckpointError(f"model {model_id!r}: {exc}") from None
    return model, describe(model_id, info)


def describe(model_id: str, info: dict) -> dict:
    """What ``GET /v1/models`` shows, and what a replica needs to check a request
    before loading the model: its endpoint, task and input shape (from its family)."""
    from raytrain_platform.models.registry import get_family

    name, kwargs, task = info["model"]["name"], info["model"]["kwargs"], info["model"]["task"]
    spec = get_family(name).serving(kwargs, task)
    return {"id": model_id, "model": {"name": name, "kwargs": kwargs}, "task": task,
            "endpoint": spec.endpoint, "inputs": spec.inputs, "context_len": spec.context_len,
            "checkpoint": info["source"], "step": info["step"], "metrics": _finite(info["metrics"]),
            "num_params": info["num_params"]}


def _finite(metrics: dict) -> dict:
    """NaN or infinite metrics (a diverged run) as null: JSON has no NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def load_catalog(options: "ServeOptions") -> dict[str, dict]:
    """Load every checkpoint of `options` once (then drop it) and describe it, by model id."""
    return {spec.name: load_served_model(spec.name, spec.path)[1] for spec in options.checkpoints}
