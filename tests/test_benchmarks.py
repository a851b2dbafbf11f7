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


def test_serve_bench_smoke():
    proc = subprocess.run([sys.executable, "benchmarks/serve_bench.py", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| mlp-small | on | 4 | 16 |" in proc.stdout and "| gpt | off | 1 | 4 |" in proc.stdout
    assert "batching gives" in proc.stdout


def test_strategies_smoke():
    """The strategy benchmark still runs: one layout of each kind, 3 steps each."""
    proc = subprocess.run([sys.executable, "benchmarks/strategies.py", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "MiB" in line]
    assert len(rows) == 3, proc.stdout  # none, tp2, pp2 1f1b
