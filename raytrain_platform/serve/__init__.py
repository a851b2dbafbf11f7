"""Ray Serve endpoints for trained checkpoints: `rtp serve`, ``serve run
pipelines.serve:app checkpoint=PATH``, or a config from ``rtp serve --write-config``.

Ray and torch load on first use (``app``), so ``rtp`` stays fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from raytrain_platform.serve.builder import app

        return app
    raise AttributeError(f"module 'raytrain_platform.serve' has no attribute {name!r}")
