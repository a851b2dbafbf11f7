"""Model families: plain ``nn.Module``s and what the platform needs to know of them
(models/family.py). Nothing here imports Ray or torch.distributed.

>>> from raytrain_platform.models.specs import GPTSpec
>>> kw = {"n_layer": 1, "n_embd": 32}
>>> sum(p.numel() for p in build_model("gpt", kw).parameters()) == GPTSpec(**kw).num_params()
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrain_platform.models.family import ModelFamily, PipelineLayout, ServingSpec, find_blocks
from raytrain_platform.models.registry import FAMILIES, family_names, get_family
from raytrain_platform.models.user import load_user_builder

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ModelFamily", "PipelineLayout", "ServingSpec", "FAMILIES", "build_model", "family_names",
           "find_blocks", "get_family", "load_user_builder"]


def build_model(model: Any, kwargs: dict | None = None, *, device: str | None = None) -> "nn.Module":
    """The model of a ``model`` config section (anything with ``.name`` and ``.kwargs``),
    or of family `model` with `kwargs`, initialised on `device` (default CPU)."""
    name, kw = (model, kwargs or {}) if isinstance(model, str) else (model.name, model.kwargs)
    family = get_family(name)
    return family.build(family.resolve_kwargs(kw), device=device)
