"""What every config section's checks share: one-line errors and the limits that other
layers read too (data/generate.py, data/mixture.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from raytrain_platform.errors import ConfigError

__all__ = ["REQUIRED", "MAX_SYNTHETIC", "MAX_MIX_SOURCES", "SEED_LIMIT", "SEED_ALLOWED", "check_field"]

REQUIRED: Any = dataclasses.MISSING  # a field's default where the config must set it
MAX_SYNTHETIC = 100_000_000
MAX_MIX_SOURCES = 256  # data/mixture.py's MAX_SOURCES: sample ids keep 8 bits for the source
SEED_LIMIT = 2**32  # numpy's and every generator's range; torch takes it too
SEED_ALLOWED = "an integer from 0 to 2**32 - 1"


def check_field(ok: bool, path: str, value: object, allowed: str) -> None:
    """`ConfigError` (path, value, what is allowed) unless `ok`."""
    if not ok:
        raise ConfigError(path, value, allowed)
