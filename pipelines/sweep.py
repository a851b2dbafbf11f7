"""Entry point for a sweep as a `ray job submit` job:

    ray job submit --working-dir . -- python pipelines/sweep.py \
        --sweep pipelines/configs/sweep.yaml --set storage_path=/shared/sweeps

Inside a Ray job, RAY_ADDRESS is set, so the trials run on the job's cluster; submit
the same command again to resume an interrupted sweep.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain_platform.cli import job_entry  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(job_entry("sweep", "--sweep"))
