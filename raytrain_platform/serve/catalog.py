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
from pathlib import Path
from typing import TYPE_CHECKING

from raytrain_platform.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

    from raytrain_platform.serve.options import ServeOptions

__all__ = ["load_catalog", "load_served_model", "describe"]


def load_served_model(model_id: str, path: str, *, trust_builder: bool = False) -> tuple["nn.Module", dict]:
    """``(model, description)`` of one checkpoint, weights loaded without running code;
    errors name the model id. A user builder's run needs `trust_builder` (the option)."""
    from raytrain_platform.inference import is_hf_directory, load_hf_directory, load_model_for_inference

    try:
        if is_hf_directory(Path(path)):
            model, info = load_hf_directory(Path(path))
        else:
            model, _cfg, info = load_model_for_inference(path, servable=True, trust_builder=trust_builder)
    except CheckpointError as exc:
        raise CheckpointError(f"model {model_id!r}: {exc}") from None
    return model, describe(model_id, info)


def describe(model_id: str, info: dict) -> dict:
    """What ``GET /v1/models`` shows, and what a replica needs to check a request
    before loading the model: its endpoint, task and input shape (from its family)."""
    from raytrain_platform.models.registry import get_family

    name, kwargs, task = info["model"]["name"], info["model"]["kwargs"], info["model"]["task"]
    spec = get_family(name).serving(kwargs, task)
    generate = spec.endpoint == "generate"
    # The family's context, else (a user LM) the tokens per sample it was trained on.
    context_len = spec.context_len or (info.get("seq_len") or 0 if generate else 0)
    return {"id": model_id, "model": {"name": name, "kwargs": kwargs}, "task": task,
            "endpoint": spec.endpoint, "inputs": spec.inputs, "context_len": context_len,
            "tokenizer": (info.get("tokenizer") or spec.tokenizer) if generate else None,
            "kv_cache": spec.kv_cache, "stop_token_ids": list(spec.stop_token_ids),
            "checkpoint": info["source"], "step": info["step"], "metrics": _finite(info["metrics"]),
            "num_params": info["num_params"], "created": _created(info["source"]),
            "lora": info.get("lora")}  # a LoRA run: replicas share its base (serve/adapters.py)


def _created(path: str) -> int:
    """When the checkpoint was written (Unix seconds): OpenAI's model ``created``."""
    try:
        return int(Path(path).stat().st_mtime)
    except OSError:
        return 0


def _finite(metrics: dict) -> dict:
    """NaN or infinite metrics (a diverged run) as null: JSON has no NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def load_catalog(options: "ServeOptions") -> dict[str, dict]:
    """Load every checkpoint of `options` once (then drop it) and describe it, by model id."""
    return {spec.name: load_served_model(spec.name, spec.path, trust_builder=options.trust_builder)[1]
            for spec in options.checkpoints}
