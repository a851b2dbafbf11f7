"""The sweep space: dotted config paths to values. A list is a grid axis; a mapping
``{choice|uniform|loguniform|randint: ...}`` is drawn at random. Trials are the grid
product, repeated `num_samples` times with fresh random draws (Tune's semantics).

Every trial's config is built and validated here, before Ray starts.

>>> space = parse_space({"train.lr": {"loguniform": [1e-4, 1e-2]}, "data.batch_size": [8, 16]})
>>> [sorted(t) for t in expand(space, num_samples=2, seed=0)][0]
['data.batch_size', 'train.lr']
>>> len(expand(space, num_samples=2, seed=0))
4
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

from raytrain_platform.errors import ConfigError

__all__ = ["Axis", "parse_space", "expand", "DISTRIBUTIONS"]

DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint")


@dataclass(frozen=True)
class Axis:
    path: str  # dotted config path, e.g. "train.lr"
    kind: str  # "grid" or one of DISTRIBUTIONS
    values: tuple  # grid/choice: the values; uniform/loguniform/randint: (low, high)

    def draw(self, rng: random.Random) -> Any:
        low_high = self.values
        if self.kind == "choice":
            return rng.choice(self.values)
        if self.kind == "uniform":
            return rng.uniform(*low_high)
        if self.kind == "loguniform":
            return math.exp(rng.uniform(math.log(low_high[0]), math.log(low_high[1])))
        return rng.randrange(*low_high)  # randint: [low, high), as in Tune


def _parse_axis(path: str, spec: Any) -> Axis:
    where = f"space.{path}"
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(where, spec, "a non-empty list of values (a grid axis)")
        return Axis(path, "grid", tuple(spec))
    if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in DISTRIBUTIONS):
        raise ConfigError(where, spec, "a list of values (grid) or one of "
                          "{choice: [...]}, {uniform: [lo, hi]}, {loguniform: [lo, hi]}, "
                          "{randint: [lo, hi]}")
    kind, args = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}.choice", args, "a non-empty list of values")
        return Axis(path, kind, tuple(args))
    numbers = isinstance(args, list) and len(args) == 2 and all(
        isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
    if not numbers or not args[0] < args[1]:
        raise ConfigError(f"{where}.{kind}", args, "two numbers [low, high] with low < high")
    if kind == "loguniform" and args[0] <= 0:
        raise ConfigError(f"{where}.{kind}", args, "a range of numbers > 0")
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}.{kind}", args, "two integers [low, high) with low < high")
    return Axis(path, kind, (args[0], args[1]))


def parse_space(space: Any) -> list[Axis]:
    """Check the shape of a space (not its values: those are checked per trial config)."""
    if not isinstance(space, dict) or not space:
        raise ConfigError("space", space, "a non-empty mapping of dotted config paths to values")
    axes = []
    for path, spec in space.items():
        parts = str(path).split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError("space", path, "dotted config paths like 'train.lr'")
        if parts[0] == "run" and parts[1] in ("name", "storage_path"):
            raise ConfigError(f"space.{path}", spec, "a field other than run.name and "
                              "run.storage_path (the sweep names and places each trial's run)")
        axes.append(_parse_axis(str(path), spec))
    return axes


def expand(axes: list[Axis], *, num_samples: int, seed: int) -> list[dict[str, Any]]:
    """The trials' overrides, in order: for each sample, the grid product (the first
    axis varies slowest), random axes drawn with a generator seeded by `seed`."""
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ConfigError("num_samples", num_samples, "an integer >= 1")
    if not isinstance(seed, int) or isinstance(seed, bool):  # null: other draws at each run
        raise ConfigError("seed", seed, "an integer (a rerun must draw the same trials to resume)")
    rng = random.Random(seed)
    grid = [a for a in axes if a.kind == "grid"]
    drawn = [a for a in axes if a.kind != "grid"]
    trials = []
    for _ in range(num_samples):
        for point in itertools.product(*(a.values for a in grid)):
            overrides = dict(zip((a.path for a in grid), point))
            overrides.update({a.path: a.draw(rng) for a in drawn})
            trials.append({a.path: overrides[a.path] for a in axes})  # in space order
    return trials
