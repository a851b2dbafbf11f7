"""Sizes and counts as people write them ("80GiB", "24GB", "6.7B"), parsed with a
one-line `ConfigError` naming the field when they are not. No torch, no Ray.

>>> parse_size("--device-mem", "80GiB"), parse_size("--device-mem", "24GB")
(85899345920, 24000000000)
>>> parse_count("--params", "6.7B"), parse_count("--params", "125e6")
(6700000000, 125000000)
>>> format_size(60 * 2**20), format_size(3 * 2**30)
('60 MiB', '3.0 GiB')
"""

from __future__ import annotations

import math
import re

from raytrain_platform.errors import ConfigError

__all__ = ["parse_size", "parse_count", "format_size", "SIZE_HELP"]

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
SIZE_HELP = "a size like 80GiB or 24GB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"


def parse_size(field: str, text: str) -> int:
    match = re.fullmatch(_NUMBER + r"\s*([A-Za-z]*)", str(text).strip())
    unit = match.group(2).lower() if match else None
    size = float(match.group(1)) * _SIZE_UNITS[unit] if match and unit in _SIZE_UNITS else 0.0
    if not 0 < size < math.inf:
        raise ConfigError(field, text, SIZE_HELP + ", > 0")
    return int(size)


def parse_count(field: str, text: str) -> int:
    match = re.fullmatch(_NUMBER + r"\s*([kKmMbBtT]?)", str(text).strip())
    if match is None or not 1 <= float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()] < math.inf:
        raise ConfigError(field, text, "a count >= 1 like 125M, 7B or 6.7e9")
    return int(float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()])


def format_size(n: int) -> str:
    """Bytes for a person: GiB, or MiB below 1 GiB (small CPU budgets), KiB below 1 MiB,
    bytes below 1 KiB.

    >>> format_size(300 * 2**10), format_size(1)
    ('300 KiB', '1 B')
    """
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} B"
