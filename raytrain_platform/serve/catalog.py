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

__all__ = ["SERVABLE_MODELS", "load_catalog", "load_served_model", "describe"]

SERVABLE_MODELS = ("gpt", "mlp")


def load_served_model(model_id: str, path: str) -> tuple["nn.Module", dict]:
    """``(model, description)`` of one checkpoint, weights loaded without running code;
    errors name the model id."""
    from raytrain_platform.export import load_model_for_inference

    try:
        model, _cfg, info = load_model_for_inference(path, models=SERVABLE_MODELS)
    except CheckpointError as exc:
        raise CheckpointError(f"model {model_id!r}: {exc}") from None
    return model, describe(model_id, info)


def describe(model_id: str, info: dict) -> dict:
    """What ``GET /v1/models`` shows, and what a replica needs to check a request
    before loading the model: its kind, task and input shape."""
    kwargs = info["model"]["kwargs"]
    if info["model"]["name"] == "gpt":
        inputs = {"block_size": kwargs["block_size"], "vocab_size": kwargs["vocab_size"]}
        task = "lm"
    else:
        task = kwargs["task"]
        inputs = {"num_features": kwargs["input_dim"], "num_outputs": kwargs["num_outputs"]}
    return {"id": model_id, "model": info["model"], "task": task, "inputs": inputs,
            "checkpoint": info["source"], "step": info["step"], "metrics": _finite(info["metrics"]),
            "num_params": info["num_params"]}


def _finite(metrics: dict) -> dict:
    """NaN or infinite metrics (a diverged run) as null: JSON has no NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def load_catalog(options: "ServeOptions") -> dict[str, dict]:
    """Load every checkpoint of `options` once (then drop it) and describe it, by model id."""
    return {spec.name: load_served_model(spec.name, spec.path)[1] for spec in options.checkpoints}
