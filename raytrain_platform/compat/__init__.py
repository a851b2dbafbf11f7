"""The private APIs of torch and Ray this package relies on, each in one place
(`torch_private`, `ray_private`) with what it is used for and why no public API does the
job. tests/test_compat.py resolves every one of them, so an upgrade that removes or
moves one fails there, by name, instead of a feature quietly going missing."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["resolve"]


def resolve(entry: str) -> Any:
    """The object a ``USED`` entry names: "module", or "module:attribute.attribute" where
    an attribute ending in "()" is called (an instance's attribute)."""
    module, _, path = entry.partition(":")
    found: Any = importlib.import_module(module)
    for attr in filter(None, path.split(".")):
        found = getattr(found, attr.removesuffix("()"))
        if attr.endswith("()"):
            found = found()
    return found
