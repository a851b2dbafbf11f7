"""examples/sweep.ipynb, executed headless (nbclient + ipykernel) in a temp folder:
its sweep runs on the notebook's own embedded Ray and shows the table and the plot."""

import base64
from pathlib import Path

import pytest

from conftest import ROOT

# The notebook runs a whole sweep (~75 s on 2 cores); rtp sweep itself is tested by default
# in test_sweep.py, so this example runs with the extended tests (pytest -m extended).
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(600)]


def test_sweep_notebook_runs_and_shows_table_and_plot(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "sweep.ipynb", as_version=4)
    NotebookClient(nb, timeout=480, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "sweep 'notebook-sweep': 2 trial(s)" in text  # the progress lines
    assert "trial_000" in text and "trial_001" in text and "done" in text
    tables = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("trial_000" in t and "val_loss" in t and "done" in t for t in tables)
    images = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert images and base64.b64decode(images[0])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best: trial_00" in text and "name: notebook-sweep-best" in text
    sweep_dir = Path(tmp_path) / "sweeps" / "notebook-sweep"
    assert (sweep_dir / "results.csv").read_text().count("\ntrial_") == 2
    assert (sweep_dir / "best_config.yaml").is_file() and (sweep_dir / "sweep.png").is_file()
