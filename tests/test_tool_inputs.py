"""Bad input to the writing tools (`python -m raytrain_platform.tools.tiny_llm` and
`rtp make-data`): one line on stderr naming the flag and what it allows, exit 2, and
nothing written. No torch model, no Ray: each test refuses before any real work."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from raytrain_platform.cli import main as rtp
from raytrain_platform.tools import tiny_llm


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


# ---------------------------------------------------------------- tiny_llm

SMALL = ["--samples", "5", "--layers", "1", "--hidden", "16", "--heads", "2", "--kv-heads", "1"]


def test_tiny_llm_refuses_a_negative_intermediate_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    assert tiny_llm.main([str(out), "--intermediate", "-5", "--samples", "5"]) == 2
    assert one_line(capsys) == "tiny_llm: error: --intermediate = -5: expected an integer >= 1"
    assert not out.exists()  # not even the tokenizer


def test_tiny_llm_refuses_a_zero_intermediate(tmp_path, capsys):
    out = tmp_path / "out"
    assert tiny_llm.main([str(out), "--intermediate", "0", *SMALL]) == 2
    assert "--intermediate = 0: expected an integer >= 1" in one_line(capsys)
    assert not out.exists()


def test_tiny_llm_intermediate_defaults_to_twice_hidden_only_when_absent(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(tiny_llm, "make_all", lambda out, **kw: seen.append(kw) or {})
    assert tiny_llm.main([str(tmp_path / "a"), *SMALL]) == 0
    assert tiny_llm.main([str(tmp_path / "b"), *SMALL, "--intermediate", "24"]) == 0
    assert [kw["intermediate_size"] for kw in seen] == [32, 24]


@pytest.mark.parametrize("where", ["out", "out/model", "out/data"])
def test_tiny_llm_refuses_a_file_in_the_way_before_writing(tmp_path, capsys, where):
    out = tmp_path / "out"
    if where != "out":
        out.mkdir()
    (tmp_path / where).write_text("keep")
    assert tiny_llm.main([str(out), *SMALL]) == 2
    err = one_line(capsys)
    assert f"out = '{out}': expected a folder that can be created and written ({tmp_path / where} is a file)" in err
    assert (tmp_path / where).read_text() == "keep"
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted({"out", os.path.basename(where)})


def test_tiny_llm_refuses_a_path_under_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("keep")
    assert tiny_llm.main([str(tmp_path / "afile" / "out"), *SMALL]) == 2
    assert f"({tmp_path / 'afile'} is a file, so it cannot be created)" in one_line(capsys)


def test_tiny_llm_refuses_a_model_larger_than_the_memory_before_writing(tmp_path, capsys):
    """--hidden 1000000 used to run until the machine ran out of memory building it."""
    out = tmp_path / "out"
    assert tiny_llm.main([str(out), *SMALL[:4], "--hidden", "1000000", "--heads", "2", "--kv-heads", "1"]) == 2
    err = one_line(capsys)
    assert err.startswith("tiny_llm: error: --hidden, --layers, --intermediate = '") and \
        "parameters': expected a model whose build and save fit the memory available (about " in err, err
    assert not out.exists()


def test_tiny_llm_refuses_a_folder_it_may_not_write(capsys):
    """/proc takes no new entries, for root too (root passes every permission check,
    so a chmod 555 folder would not show it)."""
    assert tiny_llm.main(["/proc/rtp-tiny-llm", *SMALL]) == 2
    assert one_line(capsys) == ("tiny_llm: error: out = '/proc/rtp-tiny-llm': expected a folder that can be created and "
                                "written (/proc is not writable (No such file or directory))")
    assert not Path("/proc/rtp-tiny-llm").exists()


@pytest.mark.parametrize("exc, code", [
    pytest.param(PermissionError(errno.EACCES, "Permission denied", "{out}/model/vocab.json"), 2, id="eacces"),
    pytest.param(OSError(errno.EROFS, "Read-only file system", "{out}/data/chat.jsonl"), 2, id="erofs"),
    pytest.param(OSError(errno.ENOSPC, "No space left on device"), 1, id="enospc"),  # a failed run, not bad input
])
def test_tiny_llm_an_os_error_while_writing_is_one_line(tmp_path, capsys, monkeypatch, exc, code):
    out = tmp_path / "out"
    if exc.filename:
        exc.filename = exc.filename.format(out=out)

    def fail(*args, **kw):
        raise exc

    monkeypatch.setattr(tiny_llm, "make_all", fail)
    assert tiny_llm.main([str(out), *SMALL]) == code
    assert f"tiny_llm: error: cannot write {exc.filename or out}: {exc.strerror}" == one_line(capsys)


def test_tiny_llm_a_failure_part_way_takes_back_the_folders_it_made(tmp_path, capsys, monkeypatch):
    """The tokenizer was already in out/model/ when the model failed to write: a
    half-written folder stayed."""
    out = tmp_path / "out"

    def fail(model_dir, **kw):
        assert (model_dir / "tokenizer.json").is_file()  # the tokenizer came first
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiny_llm, "make_model", fail)
    assert tiny_llm.main([str(out), *SMALL]) == 1
    assert one_line(capsys).startswith("tiny_llm: error: cannot write")
    assert not out.exists()
    (out / "model").mkdir(parents=True)  # folders the user had are left
    assert tiny_llm.main([str(out), *SMALL]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["model"]


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--heads", "3"], "--heads = 3: expected a divisor of --hidden (64)", id="heads-divisor"),
    pytest.param(["--kv-heads", "3"], "--kv-heads = 3: expected a divisor of --heads (4)", id="kv-heads-divisor"),
    pytest.param(["--hidden", "0"], "--hidden = 0: expected an integer >= 1", id="hidden"),
    pytest.param(["--layers", "-1"], "--layers = -1: expected an integer >= 1", id="layers"),
    pytest.param(["--heads", "0"], "--heads = 0: expected an integer >= 1", id="heads"),
    pytest.param(["--kv-heads", "0"], "--kv-heads = 0: expected an integer >= 1", id="kv-heads"),
    pytest.param(["--samples", "0"], "--samples = 0: expected an integer >= 1", id="samples"),
    pytest.param(["--max-shard-size", "big"], "--max-shard-size = 'big': expected a size like 200KB",
                 id="max-shard-size"),
])
def test_tiny_llm_messages_name_the_flags(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert tiny_llm.main([str(out), *argv]) == 2
    assert one_line(capsys).startswith(f"tiny_llm: error: {message}")
    assert not out.exists()


def test_tiny_llm_too_many_samples_names_the_flag(tmp_path, capsys, monkeypatch):
    from raytrain_platform.errors import ConfigError

    def few(n):  # this machine's stdlib, as if it held 3 docstrings (the real scan takes seconds)
        raise ConfigError("samples", n, "at most 3: the docstrings this machine's standard library holds")

    monkeypatch.setattr(tiny_llm, "_qa_pairs", few)
    assert tiny_llm.main([str(tmp_path / "out"), "--samples", "10"]) == 2
    assert one_line(capsys).startswith("tiny_llm: error: --samples = 10: expected at most 3: ")
    assert not (tmp_path / "out").exists()


def test_tiny_llm_python_api_names_its_parameters(tmp_path):
    from raytrain_platform.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^intermediate_size = 0: expected an integer >= 1$"):
        tiny_llm.make_all(tmp_path / "out", samples=5, intermediate_size=0)
    with pytest.raises(ConfigError, match=r"^num_heads = 3: expected a divisor of hidden_size \(64\)$"):
        tiny_llm.make_all(tmp_path / "out", samples=5, num_heads=3)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- rtp make-data


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--seed", "-1"], "--seed = -1: expected an integer from 0 to 2**32 - 1", id="seed-negative"),
    pytest.param(["--seed", str(2**32)], f"--seed = {2**32}: expected an integer from 0 to 2**32 - 1",
                 id="seed-too-big"),
    pytest.param(["--rows", "10000000000000000000", "--files", "1"],
                 "--rows = 10000000000000000000: expected an integer from 1 to 100,000,000", id="rows-overflow"),
    pytest.param(["--rows", "100000001", "--files", "1"],
                 "--rows = 100000001: expected an integer from 1 to 100,000,000", id="rows-over-cap"),
    pytest.param(["--rows", "0"], "--rows = 0: expected an integer from 1 to 100,000,000", id="rows-zero"),
    pytest.param(["--features", "0"], "--features = 0: expected an integer from 1 to 10,000", id="features-zero"),
    pytest.param(["--features", "10001", "--rows", "2", "--files", "1"],
                 "--features = 10001: expected an integer from 1 to 10,000", id="features-over-cap"),
    pytest.param(["--classes", "1"], "--classes = 1: expected an integer from 2 to 10,000", id="classes-one"),
    pytest.param(["--classes", "10001", "--rows", "2", "--files", "1"],
                 "--classes = 10001: expected an integer from 2 to 10,000", id="classes-over-cap"),
    pytest.param(["--files", "0"], "--files = 0: expected an integer from 1 to 10,000", id="files-zero"),
    pytest.param(["--files", "10001", "--rows", "20000"], "--files = 10001: expected an integer from 1 to 10,000",
                 id="files-over-cap"),
    pytest.param(["--files", "5", "--rows", "4"], "--files = 5: expected at most --rows (4)", id="files-over-rows"),
])
def test_make_data_refuses_bad_numbers_before_writing(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert rtp(["make-data", str(out), *argv]) == 2
    assert one_line(capsys) == f"error: {message}"
    assert not out.exists()


def test_make_data_refuses_a_path_under_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("keep")
    assert rtp(["make-data", str(tmp_path / "afile" / "out"), "--rows", "4", "--files", "1"]) == 2
    assert f"({tmp_path / 'afile'} is a file, so it cannot be created)" in one_line(capsys)


def test_make_data_refuses_a_folder_it_may_not_write(capsys):
    """/proc takes no new entries, for root too (see the tiny_llm case)."""
    assert rtp(["make-data", "/proc/rtp-make-data", "--rows", "4", "--files", "1"]) == 2
    assert one_line(capsys) == ("error: out = '/proc/rtp-make-data': expected a folder that can be created and "
                                "written (/proc is not writable (No such file or directory))")
    assert not Path("/proc/rtp-make-data").exists()


@pytest.mark.parametrize("error, code", [
    pytest.param(PermissionError(errno.EACCES, "Permission denied"), 2, id="eacces"),
    pytest.param(OSError(errno.ENOSPC, "No space left on device"), 1, id="enospc"),  # a failed run, not bad input
])
def test_make_data_a_failed_write_is_one_line_and_takes_back_what_it_wrote(tmp_path, capsys, monkeypatch,
                                                                           error, code):
    import pyarrow.parquet as pq

    real = pq.write_table
    calls = []

    def write_then_fail(table, path, **kw):
        calls.append(path)
        if len(calls) == 2:
            error.filename = str(path)
            raise error
        real(table, path, **kw)

    monkeypatch.setattr(pq, "write_table", write_then_fail)
    out = tmp_path / "new" / "out"
    assert rtp(["make-data", str(out), "--rows", "8", "--files", "3"]) == code
    err = one_line(capsys)
    assert error.strerror in err and (code == 1 or err.startswith("error: out = "))
    assert len(calls) == 2 and not (tmp_path / "new").exists()  # the first file and both folders: gone


def test_make_data_writes_at_the_bounds(tmp_path, capsys):
    out = tmp_path / "out"
    assert rtp(["make-data", str(out), "--rows", "3", "--files", "3", "--classes", "2", "--features", "1",
                "--seed", str(2**32 - 1)]) == 0
    assert len(list(out.glob("*.parquet"))) == 3
    assert "wrote 3 rows" in capsys.readouterr().out
