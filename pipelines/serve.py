"""Entry point for Ray Serve's own CLI (an application builder taking arguments):

    serve run pipelines.serve:app checkpoint=runs/quickstart
    serve run pipelines.serve:app checkpoint=mlp=runs/tabular,gpt=runs/quickstart max_batch_size=16

Options are those of `rtp serve` (see docs/serving.md); `rtp serve --write-config`
writes the same as a config for `serve deploy`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain_platform.serve.builder import app  # noqa: E402

__all__ = ["app"]
