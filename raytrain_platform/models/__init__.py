"""Plain ``nn.Module``s and their builders. Nothing here imports Ray or torch.distributed.

>>> from raytrain_platform.config import ModelConfig
>>> cfg = ModelConfig(name="gpt", kwargs={"n_layer": 1, "n_embd": 32})
>>> sum(p.numel() for p in build_model(cfg).parameters()) == GPTSpec(**cfg.kwargs).num_params()
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.specs import BUILTIN_MODELS, GPTSpec, MLPSpec

if TYPE_CHECKING:
    from torch import nn

    from raytrain_platform.config import ModelConfig

__all__ = ["build_model", "gpt_spec", "load_user_builder"]


def gpt_spec(kwargs: dict) -> GPTSpec:
    return GPTSpec(**kwargs)


def load_user_builder(import_path: str):
    """``"pkg.module:build_fn"`` -> the function; a clear `ConfigError` if it is not there."""
    module_name, _, fn_name = import_path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("model.name", import_path, f"an importable module ({exc})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError("model.name", import_path,
                          f"a callable '{fn_name}' in module '{module_name}'")
    return fn


def build_model(cfg: "ModelConfig") -> "nn.Module":
    """Build the model on the CPU with its configured initialisation (seed first)."""
    from torch import nn

    if cfg.name == "gpt":
        from raytrain_platform.models.gpt import GPT

        return GPT(GPTSpec(**cfg.kwargs))
    if cfg.name == "mlp":
        from raytrain_platform.models.mlp import MLP

        return MLP(MLPSpec(**cfg.kwargs))
    assert cfg.name not in BUILTIN_MODELS
    model = load_user_builder(cfg.name)(**cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError("model.name", cfg.name,
                          f"a function returning torch.nn.Module (it returned {type(model).__name__})")
    return model
