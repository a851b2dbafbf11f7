"""The one registry of model families, by name. Importing it is cheap (no torch): the
config layer validates ``model.name`` and ``model.kwargs`` through it.

An unknown name lists the known ones, and the import-path form of a user builder:

>>> family_names()
['gpt', 'hf', 'mlp']
>>> get_family("resnet")
Traceback (most recent call last):
...
raytrain_platform.errors.ConfigError: model.name = 'resnet': expected one of ['gpt', 'hf', 'mlp'] or an import path 'pkg.module:build_fn'

A new family: a `ModelFamily` subclass in its own module under models/, added here.
"""

from __future__ import annotations

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.builtin import GPTFamily, MLPFamily
from raytrain_platform.models.family import ModelFamily
from raytrain_platform.models.hf import HFFamily
from raytrain_platform.models.user import IMPORT_PATH, UserFamily

__all__ = ["FAMILIES", "family_names", "get_family"]

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (GPTFamily(), HFFamily(), MLPFamily())}


def family_names() -> list[str]:
    return sorted(FAMILIES)


def get_family(name: object) -> ModelFamily:
    """The family of ``model.name``: a registered name, or a user builder's import path."""
    if isinstance(name, str) and name in FAMILIES:
        return FAMILIES[name]
    if isinstance(name, str) and IMPORT_PATH.match(name):
        return UserFamily(name)
    raise ConfigError("model.name", name, f"one of {family_names()} or an import path 'pkg.module:build_fn'")
