"""`rtp export --out` aimed where no folder can be made (under a file, in /proc): one
line, exit 2, before the model is loaded, and nothing there changed; a new nested
folder still works. No Ray: one tiny run, trained in this process, for the export that
succeeds."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import mlp_config, train_in_process

from raytrain_platform.cli import main as rtp


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export_errors") / "runs"
    return train_in_process(root, mlp_config(root, "clf", train={"max_steps": 2},
                                             run={"checkpoint_every": 0, "eval_every": 0}))


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: --out is checked before."""
    import raytrain_platform.export as export

    def tripwire(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(export, "load_model_for_inference", tripwire)


def _one_line_exit_2(argv: list[str], capsys, *needles: str) -> str:
    assert rtp(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert all(n in err for n in needles), err
    return err


@pytest.mark.parametrize("where", ["under_a_file", "/etc/passwd/x", "/proc/rtp-export"])
def test_an_out_folder_that_cannot_be_created_is_refused(tmp_path, capsys, no_load, where):
    if where.startswith("/") and not Path(where).parent.exists():
        pytest.skip(f"{Path(where).parent} is not on this system")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    source = tmp_path / "runs" / "clf"  # never read: --out is refused first (no_load)
    source.mkdir(parents=True)
    out = str(a_file / "x") if where == "under_a_file" else where
    err = _one_line_exit_2(["export", str(source), "--out", out], capsys,
                           f"--out = {out!r}: expected a folder that can be created and written (")
    assert "export failed" not in err
    assert a_file.read_text() == "keep me" and not Path(out).exists()


def test_an_export_into_new_nested_folders_still_works(run, tmp_path, capsys):
    """The check creates nothing; the export makes the missing folders, and a second
    export replaces the first as a whole."""
    out = tmp_path / "new" / "deeper" / "exp"
    assert rtp(["export", str(run), "--out", str(out)]) == 0
    (out / "stale.bin").write_text("from the first export")
    assert rtp(["export", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "export.json", "model.safetensors"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["exp"]  # no staging folder left
