"""The package type-checks: mypy over raytrain_platform/ with the settings in
pyproject.toml ([tool.mypy]: torch and Ray, pinned by constraints-cpu.txt, are checked
against their own types; the unpinned Hugging Face, MLflow and TensorBoard packages
count as Any). A None that reaches arithmetic, an ``auto`` batch size used as a number,
a wrong argument to a Ray or torch API: each fails here, before a run finds it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_clean(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy_cache")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mypy found problems:\n{out[-6000:]}"
    assert "Success: no issues found" in out, out
