import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")


def mlp_config(tmp: Path, name: str, **sections) -> dict:
    cfg = {
        "model": {"name": "mlp", "kwargs": {"hidden_sizes": [32]}},
        "data": {"source": "synthetic", "batch_size": 8, "num_samples": 1024, "val_fraction": 0.1},
        "train": {"max_steps": 10, "lr": 0.05, "optimizer": "sgd", "grad_clip": 0.0, "seed": 3},
        "parallel": {"strategy": "none"},
        "scaling": {"num_workers": 1, "cpus_per_worker": 0.5, "torch_threads": 1},
        "run": {"name": name, "storage_path": str(tmp), "checkpoint_every": 5, "eval_every": 5,
                "eval_batches": 2},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg[section], **values}
    return cfg


@pytest.fixture(scope="module")
def ray_cluster():
    """One real local Ray per test module (start-up is the expensive part)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0"}})
    yield
    ray.shutdown()
