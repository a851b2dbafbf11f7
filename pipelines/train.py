"""Entry point for `ray job submit`:

    ray job submit --working-dir . -- python pipelines/train.py \
        --config pipelines/configs/quickstart.yaml --set run.storage_path=/shared/runs

Inside a Ray job, RAY_ADDRESS is set, so the run uses the job's cluster.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain_platform.cli import job_entry  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(job_entry("train", "--config"))
