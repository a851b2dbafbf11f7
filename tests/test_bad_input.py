"""Bad input found by an audit (2026-12-04), each a one-line error, exit 2 from the CLI,
and nothing written over: checkpoints and exports with odd files, configs that are not
UTF-8, out-of-range seeds and counts, sizes that overflow, serve options that are not
finite, and an export aimed at the run it reads. No Ray: one tiny run, trained in this
process, is copied and damaged per case."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, mlp_config, train_in_process

from raytrain_platform.cli import main as rtp
from raytrain_platform.config import load_config
from raytrain_platform.core.rundir import latest_checkpoint
from raytrain_platform.errors import CheckpointError, ConfigError, DataError


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad_input") / "runs"
    return train_in_process(root, mlp_config(root, "clf", train={"max_steps": 2},
                                             run={"checkpoint_every": 0, "eval_every": 0}))


@pytest.fixture
def copy(run, tmp_path) -> Path:
    """A copy of the run, to damage."""
    return Path(shutil.copytree(run, tmp_path / "clf"))


def _one_line_exit_2(argv: list[str], capsys, needle: str) -> None:
    assert rtp(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, err


@pytest.mark.parametrize("argv,message", [
    (["train", "x.yaml", "--bogus"], "unrecognized arguments: --bogus (see rtp train --help)"),
    (["validate", "x.yaml", "--set"], "argument --set: expected one argument (see rtp validate --help)"),
    (["export"], "the following arguments are required: path (see rtp export --help)"),
    (["export", "r", "--format", "onnx"], "argument --format: invalid choice: 'onnx'"),
    (["make-data", "out", "--rows", "many"], "argument --rows: invalid int value: 'many'"),
    (["serve", "r", "--bogus"], "unrecognized arguments: --bogus (see rtp serve --help)"),
    (["doctor", "x.yaml", "--bogus"], "unrecognized arguments: --bogus (see rtp doctor --help)"),
    (["sweep"], "(see rtp sweep --help)"),
    (["nope"], "argument command: invalid choice: 'nope'"),
    ([], "the following arguments are required: command (see rtp --help)"),
])
def test_every_commands_argument_errors_are_one_line(capsys, argv, message):
    """argparse's own errors printed a usage block (2-4 lines) for every command but
    plan and serve, and an unknown flag a block for those too."""
    with pytest.raises(SystemExit) as exc:
        rtp(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


# ---- checkpoints and exports -------------------------------------------------------------

@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: --out is checked before."""
    import raytrain_platform.export as export

    def tripwire(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(export, "load_model_for_inference", tripwire)


@pytest.mark.parametrize("where", ["under_a_file", "/etc/passwd/x", "/proc/rtp-export"])
def test_an_out_folder_that_cannot_be_created_is_refused(tmp_path, capsys, no_load, where):
    if where.startswith("/") and not Path(where).parent.exists():
        pytest.skip(f"{Path(where).parent} is not on this system")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    source = tmp_path / "runs" / "clf"  # never read: --out is refused first (no_load)
    source.mkdir(parents=True)
    out = str(a_file / "x") if where == "under_a_file" else where
    _one_line_exit_2(["export", str(source), "--out", out], capsys,
                     f"--out = {out!r}: expected a folder that can be created and written (")
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


def _damage_state(ckpt: Path, state) -> None:
    data = json.loads((ckpt / "trainer_state.json").read_text())
    data.update(state)
    (ckpt / "trainer_state.json").write_text(json.dumps(data))


@pytest.mark.parametrize("damage,needle", [
    (lambda c: _damage_state(c, {"state": {"step": "60"}}), "state.step = '60', expected an integer >= 0"),
    (lambda c: _damage_state(c, {"state": {"step": 2.0}}), "state.step = 2.0"),
    (lambda c: _damage_state(c, {"metrics": [1, 2]}), "metrics is a list, expected an object"),
    (lambda c: (c / "trainer_state.json").write_bytes(b'{"state": "\xff"}'), "unreadable trainer state"),
    (lambda c: (c / "config.yaml").write_text(""), "unusable config (config = 'NoneType': expected a mapping"),
    (lambda c: (c / "config.yaml").write_text("- a\n- b\n"), "unusable config (config = 'list'"),
    (lambda c: (c / "config.yaml").write_bytes(b"model:\n\xff\n"), "expected a UTF-8 YAML file (byte 7 is not UTF-8)"),
])
def test_a_damaged_checkpoint_is_refused_in_one_line(copy, tmp_path, capsys, damage, needle):
    """The serving catalog would otherwise start, then answer every request with a 500."""
    from raytrain_platform.inference import load_model_for_inference

    ckpt = latest_checkpoint(copy)
    damage(ckpt)
    with pytest.raises(CheckpointError) as err:
        load_model_for_inference(ckpt)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    _one_line_exit_2(["export", str(ckpt), "--out", str(tmp_path / "out")], capsys, needle)
    assert not (tmp_path / "out").exists()


def test_an_export_with_an_infinite_step_is_refused(run, tmp_path, capsys):
    from raytrain_platform.export import export_checkpoint
    from raytrain_platform.inference import load_model_for_inference

    out = export_checkpoint(run, tmp_path / "exp")
    info = json.loads((out / "export.json").read_text())
    (out / "export.json").write_text(json.dumps({**info, "step": float("inf")}))  # json writes Infinity
    with pytest.raises(CheckpointError, match="export.json: unreadable"):
        load_model_for_inference(out)


def test_an_export_never_writes_over_the_run_it_reads(run, copy, tmp_path, capsys):
    """`--out` at the checkpoint, inside it, or at a run directory would replace their
    config.yaml and weights (a LoRA checkpoint lost its adapters that way): refused
    before anything is read, and the checkpoint stays byte for byte."""
    ckpt = latest_checkpoint(copy)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    hf_model = tmp_path / "base_model"  # a Hugging Face folder that is not an export: a base's weights
    hf_model.mkdir()
    (hf_model / "config.json").write_text("{}")
    weights = tmp_path / "weights"  # any files an export did not write: replaced as a whole otherwise
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"precious")
    for source, out in [(copy, ckpt), (ckpt, ckpt), (copy, ckpt / "sub"), (ckpt, copy), (copy, run),
                        (copy, copy.parent), (copy, hf_model), (copy, weights)]:
        _one_line_exit_2(["export", str(source), "--out", str(out)], capsys,
                         "expected a directory outside the source that holds no run, checkpoint or model")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before
    assert latest_checkpoint(copy) == ckpt
    (tmp_path / "a_file").write_text("x")
    _one_line_exit_2(["export", str(copy), "--out", str(tmp_path / "a_file")], capsys, "a directory (this is a file)")
    assert (weights / "model.safetensors").read_bytes() == b"precious"
    # The default (RUN/export), a re-export over an earlier export, and an empty folder are fine.
    assert rtp(["export", str(copy)]) == 0 and rtp(["export", str(copy), "--out", str(copy / "export")]) == 0
    assert (copy / "export" / "model.safetensors").is_file()
    (tmp_path / "empty").mkdir()
    assert rtp(["export", str(copy), "--out", str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "export.json").is_file()
    (tmp_path / "link").symlink_to(copy / "export")  # the export it points to is replaced, the link kept
    assert rtp(["export", str(copy), "--out", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and (copy / "export" / "export.json").is_file()
    assert not [p.name for p in (*copy.iterdir(), *tmp_path.iterdir()) if p.name.startswith(".")]


def test_an_export_staged_inside_its_folder_replaces_the_earlier_one_in_place(tmp_path):
    """Where `--out` cannot be swapped whole (a mounted volume; a parent the user may not
    write in), the export is staged inside it and its files take the earlier export's
    place: none of the earlier files is left (a model.safetensors beside a new index)."""
    from raytrain_platform.export import _swap_in

    out = tmp_path / "volume"
    out.mkdir()
    for name in ("model.safetensors", "export.json", "config.json"):
        (out / name).write_text("old")
    (out / "sub").mkdir()
    staging = out / ".volume.exporting-1"
    staging.mkdir()
    for name in ("model.safetensors.index.json", "model-00001-of-00002.safetensors", "export.json"):
        (staging / name).write_text("new")
    _swap_in(staging, out)
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model-00001-of-00002.safetensors",
                                                     "model.safetensors.index.json"]
    assert all(p.read_text() == "new" for p in out.iterdir())


def test_a_bad_shard_size_is_refused_before_anything_is_written(run, tmp_path, capsys):
    _one_line_exit_2(["export", str(run), "--format", "hf", "--max-shard-size", "abc", "--out", str(tmp_path / "o")],
                     capsys, "--max-shard-size = 'abc': expected a size like 80GiB")
    assert not (tmp_path / "o").exists()


# ---- configs -------------------------------------------------------------------------------

def test_a_config_file_that_is_not_utf8_or_has_odd_keys(tmp_path, capsys):
    (tmp_path / "bin.yaml").write_bytes(b"model:\n\xff\n")
    _one_line_exit_2(["validate", str(tmp_path / "bin.yaml")], capsys, "expected a UTF-8 YAML file (byte 7")
    (tmp_path / "keys.yaml").write_text("1: a\nfoo: b\n")
    _one_line_exit_2(["validate", str(tmp_path / "keys.yaml")], capsys, "no such section")


@pytest.mark.parametrize("patch,field,needle", [
    ({"data": {"seed": -1}}, "data.seed", "an integer from 0 to 2**32 - 1"),
    ({"data": {"shuffle_seed": 2**32}}, "data.shuffle_seed", "an integer from 0 to 2**32 - 1"),
    ({"train": {"seed": 10**20}}, "train.seed", "an integer from 0 to 2**32 - 1"),
    ({"run": {"name": "abc\n"}}, "run.name", "1-128 characters"),
    ({"model": {"name": "gpt", "kwargs": {"dropout": "x"}}}, "model.kwargs.dropout", "a number in [0, 1)"),
    ({"model": {"name": "gpt", "kwargs": {"init_std": float("inf")}}}, "model.kwargs.init_std",
     "a finite number > 0"),
    ({"model": {"name": "gpt", "kwargs": {"bias": "maybe"}}}, "model.kwargs.bias", "true or false"),
    ({"model": {"name": "mlp", "kwargs": {"dropout": None}}}, "model.kwargs.dropout", "a number in [0, 1)"),
    ({"model": {"name": "mlp", "lora": {"alpha": float("nan")}}}, "model.lora.alpha", "a finite number > 0"),
    ({"scaling": {"memory_budget": "1e400GB"}}, "scaling.memory_budget", "a size like 80GiB"),
    # read for parquet only: a jsonl run ignored it and held out val_fraction instead
    ({"data": {"source": "synthetic", "val_path": "val/"}}, "data.val_path", "null for data.source synthetic"),
])
def test_values_the_run_would_fail_on_later_are_refused_up_front(tmp_path, patch, field, needle):
    cfg = mlp_config(tmp_path, "c", **patch)
    if patch.get("model", {}).get("name") == "gpt":
        cfg["data"] = {"source": "synthetic", "batch_size": 4, "num_samples": 64}
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert err.value.field == field and needle in str(err.value) and "\n" not in str(err.value), str(err.value)


# ---- plan, sizes, serve options ------------------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (["--nodes", "99999999999999999999"], "--nodes = '99999999999999999999': expected an integer from 1 to 1,000,000"),
    (["--global-batch", "1000001"], "--global-batch = '1000001'"),
    (["--device-mem", "1e400GB"], "--device-mem = '1e400GB'"),
])
def test_rtp_plan_refuses_counts_it_could_not_finish_and_sizes_that_overflow(capsys, flags, needle):
    """A count of 1e20 nodes made the guide enumerate divisors for minutes; 1e400GB
    overflowed to a traceback."""
    base = {"--model": "gpt", "--global-batch": "8", "--device-mem": "80GB"}
    base.update(dict(zip(flags[::2], flags[1::2])))
    _one_line_exit_2(["plan", *[x for kv in base.items() for x in kv]], capsys, needle)


@pytest.mark.parametrize("key,value,needle", [
    ("cpus_per_replica", "inf", "cpus_per_replica = 'inf': expected a number >= 0.01"),
    ("upscale_delay_s", float("inf"), "upscale_delay_s = inf"),
    ("max_ongoing_requests", 10**31, "expected an integer >= 1 and <= 2147483647"),
])
def test_serve_options_must_be_finite(run, key, value, needle):
    from raytrain_platform.serve.options import parse_serve_args

    with pytest.raises(ConfigError) as err:
        parse_serve_args({"checkpoint": str(run), key: value})
    assert needle in str(err.value), str(err.value)


def test_a_checkpoint_config_is_read_as_yaml_only(copy, tmp_path):
    """A run's config.yaml whose value is a Python tag is refused (safe_load); read
    with an unsafe loader it would run the command."""
    from raytrain_platform.inference import load_model_for_inference

    ckpt, marker = latest_checkpoint(copy), tmp_path / "ran"
    config = ckpt / "config.yaml"
    text = config.read_text()
    assert text.count("name: clf") == 1
    config.write_text(text.replace("name: clf", f"name: !!python/object/apply:os.system ['touch {marker}']"))
    with pytest.raises(CheckpointError, match="unusable config.*could not determine a constructor"):
        load_model_for_inference(ckpt)
    assert not marker.exists()


def test_a_dangling_symlink_in_a_text_folder_is_named(tmp_path, capsys):
    from conftest import ROOT

    (tmp_path / "a.txt").write_text("some text " * 200)
    (tmp_path / "b.txt").symlink_to(tmp_path / "gone.txt")
    _one_line_exit_2(["validate", str(ROOT / "pipelines/configs/quickstart.yaml"), "--set", f"data.path={tmp_path}",
                      "--set", 'data.glob="*.txt"'], capsys, f"{tmp_path / 'b.txt'}: cannot be read")


@pytest.mark.parametrize("patch,needle", [
    ({"max_position_embeddings": "256"}, "whose max_position_embeddings is an integer >= 1 (it is '256')"),
    ({"num_key_value_heads": 1.5}, "whose num_key_value_heads is an integer >= 1 (it is 1.5)"),
    ({"architectures": 5}, "whose architectures is a list of names (it is 5)"),
])
def test_an_hf_config_json_with_wrong_types_is_named(tmp_path, patch, needle):
    """Values the checks compare (seq_len against max positions, tp against kv heads)
    were TypeErrors; a null is still 'not given'."""
    from raytrain_platform.models.hf import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "head_dim": None, **patch}))
    with pytest.raises(ConfigError) as err:
        read_hf_config(str(tmp_path))
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("weight_map", [{"a": 1}, {"a": None}, ["model-1.safetensors"]])
def test_a_safetensors_index_with_a_wrong_weight_map_is_named(tmp_path, weight_map):
    from raytrain_platform.models.hf import weight_files

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigError, match="weight_map: expected an object of tensor name -> shard file name"):
        weight_files(str(tmp_path))


def _parquet(folder: Path, labels: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    n = len(labels)
    pq.write_table(pa.table({"f0": [0.5] * n, "f1": [1.5] * n, "label": labels}), folder / "part-0.parquet")
    return folder


def _tabular(tmp_path: Path, data: Path, task: str) -> dict:
    return mlp_config(tmp_path, "tab", model={"name": "mlp", "kwargs": {"hidden_sizes": [8], "task": task}},
                      data={"source": "parquet", "path": str(data), "label_column": "label", "batch_size": 4,
                            "val_fraction": 0.0})


def test_a_class_index_that_would_make_a_huge_model_is_refused(tmp_path, capsys):
    """A label of 2**40 made a model with 2**40 outputs (70 trillion parameters)."""
    data = _parquet(tmp_path / "huge", [0, 1, 2**40] + [1] * 13)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_tabular(tmp_path, data, "classification")))
    _one_line_exit_2(["validate", str(tmp_path / "c.yaml")], capsys,
                     "data.label_column = 'label': class indices below 1,000,000 (found 1099511627776")


def test_nan_regression_labels_are_named_where_they_are(tmp_path):
    from raytrain_platform.data import sources

    data = _parquet(tmp_path / "nan", [0.5, float("nan")] + [1.0] * 14)
    spec = sources.SourceSpec.from_config(load_config(_tabular(tmp_path, data, "regression")))
    features = sources.describe(spec).feature_columns
    with pytest.raises(DataError, match=r"part-0.parquet: row group 0 has NaN or infinite labels \('label'\)"):
        list(sources.iter_source(spec, "train", features))


def _parquet_with_a_null(folder: Path, column: str, *, statistics: bool = True) -> Path:
    """16 rows of classification data whose `column` is null in row 5."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    cols = {"f0": [0.5] * 16, "f1": [1.5] * 16, "label": [0, 1] * 8}
    cols[column] = [None if i == 5 else v for i, v in enumerate(cols[column])]
    pq.write_table(pa.table(cols), folder / "part-0.parquet", write_statistics=statistics)
    return folder / "part-0.parquet"


@pytest.mark.parametrize("field,column", [("path", "label"), ("path", "f1"), ("val_path", "label"),
                                          ("val_path", "f0")])
def test_a_null_label_or_feature_is_named_before_ray(tmp_path, capsys, field, column):
    """A null class index became INT64_MIN and training failed in cross_entropy with an
    IndexError naming no file; data.val_path's labels were not checked at all."""
    cfg = _tabular(tmp_path, _parquet(tmp_path / "ok", [0, 1] * 8), "classification")
    bad = _parquet_with_a_null(tmp_path / "bad", column)
    cfg["data"][field] = str(bad.parent)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    _one_line_exit_2(["validate", str(tmp_path / "c.yaml")], capsys,
                     f"data.{field}: {bad}: row group 0: column {column!r} has 1 null value(s)")


def test_a_null_label_in_a_file_without_statistics_is_named_as_it_is_read(tmp_path):
    """Row-group statistics are optional: the read names the file, row group and column."""
    from raytrain_platform.data import sources

    bad = _parquet_with_a_null(tmp_path / "bad", "label", statistics=False)
    spec = sources.SourceSpec.from_config(load_config(_tabular(tmp_path, bad.parent, "classification")))
    with pytest.raises(DataError, match="^" + re.escape(f"{bad}: row group 0: column 'label' has 1 null value(s)")):
        list(sources.iter_source(spec, "train", ("f0", "f1")))


def test_val_path_class_indices_are_checked_too(tmp_path, capsys):
    """Only data.path's labels were read: a negative index in data.val_path failed the
    first evaluation, and a larger one got no output of the model."""
    from raytrain_platform.data import sources

    cfg = _tabular(tmp_path, _parquet(tmp_path / "ok", [0, 1] * 8), "classification")
    cfg["data"]["val_path"] = str(_parquet(tmp_path / "wide", [0, 1, 6] + [1] * 13))
    assert sources.describe(sources.SourceSpec.from_config(load_config(cfg))).num_classes == 7
    cfg["data"]["val_path"] = str(_parquet(tmp_path / "negative", [0, -1] + [1] * 14))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    _one_line_exit_2(["validate", str(tmp_path / "c.yaml")], capsys,
                     f"class indices must be >= 0 (found -1 in {tmp_path / 'negative' / 'part-0.parquet'})")


def test_synthetic_data_is_bounded(tmp_path):
    with pytest.raises(ConfigError, match=r"data.num_samples = 10000000000000: expected an integer from 1 to "):
        load_config(mlp_config(tmp_path, "s", data={"source": "synthetic", "batch_size": 4,
                                                   "num_samples": 10**13}))


@pytest.mark.parametrize("field", ["path", "val_path"])
def test_a_path_pyarrow_cannot_read_names_its_field(tmp_path, capsys, field):
    """One reader of local paths and URIs (`sources.filesystem`) for Parquet and JSONL;
    the message names the field that holds the bad URI (it said data.path for both)."""
    cfg = _tabular(tmp_path, _parquet(tmp_path / "ok", [0, 1] * 8), "classification")
    cfg["data"][field] = "nope://bucket/x"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    _one_line_exit_2(["validate", str(tmp_path / "c.yaml")], capsys,
                     f"data.{field} = 'nope://bucket/x': not a readable path or filesystem URI")


def test_a_jsonl_uri_pyarrow_cannot_read_is_one_error():
    from raytrain_platform.data.jsonl import jsonl_files

    with pytest.raises(DataError, match=r"^data.path = 'nope://bucket/x': not a readable path or filesystem URI"):
        jsonl_files("nope://bucket/x")


@pytest.mark.parametrize("argv", [["--config=pipelines/configs/quickstart.yaml"],
                                  ["--config", "pipelines/configs/quickstart.yaml"]])
def test_a_job_entry_takes_its_file_flag_either_way(argv, capsys):
    """`python pipelines/train.py --config=FILE` (the form of many job launchers) was
    refused, naming rtp train's positional CONFIG."""
    from raytrain_platform.cli import job_entry

    assert job_entry("validate", "--config", [*argv, "--set", "train.max_steps=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: train.max_steps = 0") and len(err.splitlines()) == 1, err


def test_a_job_entry_without_its_file_flag_names_it(capsys):
    from raytrain_platform.cli import job_entry

    for argv in (["--set", "train.lr=1"], ["--config", "--set", "train.lr=1"]):
        assert job_entry("train", "--config", argv) == 2
        assert capsys.readouterr().err.strip() == ("error: the following arguments are required: --config FILE "
                                                    "(see rtp train --help, whose CONFIG it is)")


def test_resuming_a_checkpoint_of_the_earlier_split_says_so(copy):
    """Checkpoints written before the split was dealt by file name (no `val_split` in
    their layout) resumed silently, validating on samples they trained on. The drivers
    (`rtp train`'s, and rank 0 under torchrun) say it on resume."""
    from raytrain_platform.core.checkpoint import read_state, split_changed_warning

    ckpt = latest_checkpoint(copy)
    text = load_config(ROOT / "pipelines" / "configs" / "quickstart.yaml")  # bytes of text files
    assert split_changed_warning(ckpt, read_state(ckpt), text) is None  # written now: nothing to say
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["layout"].pop("val_split")
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    warning = split_changed_warning(ckpt, read_state(ckpt), text)
    assert warning.startswith(f"warning: {ckpt} was written before the validation split") and "\n" not in warning
    # synthetic rows: the split is as it was
    assert split_changed_warning(ckpt, read_state(ckpt), load_config(copy / "config.yaml")) is None
