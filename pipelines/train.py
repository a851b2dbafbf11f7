"""Entry point for `ray job submit`:

    ray job submit --working-dir . -- python pipelines/train.py \
        --config pipelines/configs/quickstart.yaml --set run.storage_path=/shared/runs

Inside a Ray job, RAY_ADDRESS is set, so the run uses the job's cluster.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain_platform.cli import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--config" in argv:  # `--config FILE` reads better in a job command line
        i = argv.index("--config")
        argv = argv[:i] + [argv[i + 1]] + argv[i + 2:]
    raise SystemExit(main(["train", *argv]))
