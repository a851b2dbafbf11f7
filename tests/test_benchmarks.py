"""Benchmarks are not timed in tests; their --smoke mode runs here so they don't rot."""

import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_train_vs_loop_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/train_vs_loop.py", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Ray Data from Parquet vs in-memory loop") == 2
    assert "quickstart data wait" in proc.stdout
