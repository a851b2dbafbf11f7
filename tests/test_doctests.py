"""Every module's docstring examples run (doctest), not only one module's: an example
that drifts from the code fails here."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import raytrain_platform

MODULES = sorted(m.name for m in pkgutil.walk_packages(raytrain_platform.__path__, "raytrain_platform.")
                 if not m.name.endswith("__main__"))


def test_modules_are_found():
    assert len(MODULES) > 60 and "raytrain_platform.models.family" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
