"""Config validation: every bad value is one line naming the field, before any Ray."""

import re
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, mlp_config
from raytrain_platform.config import JobConfig, load_config
from raytrain_platform.errors import ConfigError


def test_valid_config_round_trips(tmp_path):
    cfg = JobConfig.from_dict(mlp_config(tmp_path, "ok"))
    again = JobConfig.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg
    assert cfg.model.kwargs["hidden_sizes"] == [32]


def test_python_objects_and_overrides(tmp_path):
    cfg = load_config(mlp_config(tmp_path, "ok"), ["train.lr=3e-4", "model.kwargs.dropout=0.1",
                                                  "scaling.use_gpu=false"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.model.kwargs["dropout"] == 0.1
    assert load_config(cfg).train.lr == cfg.train.lr


BAD = [
    ({"train": {"lr": -1}}, "train.lr = -1"),
    ({"train": {"lr": "fast"}}, "train.lr = 'fast'"),
    ({"train": {"max_steps": None, "epochs": None}}, "train.max_steps"),
    ({"train": {"grad_accum_steps": 0}}, "train.grad_accum_steps = 0"),
    ({"train": {"optimizer": "adam"}}, "train.optimizer = 'adam'"),
    ({"train": {"lrr": 0.1}}, "train.lrr"),
    ({"parallel": {"strategy": "zero3"}}, "parallel.strategy = 'zero3'"),
    ({"parallel": {"strategy": "none"}, "scaling": {"num_workers": 2}}, "scaling.num_workers = 2"),
    ({"scaling": {"use_gpu": "yes"}}, "scaling.use_gpu = 'yes'"),
    ({"scaling": {"num_workers": 0}}, "scaling.num_workers = 0"),
    ({"data": {"batch_size": 0}}, "data.batch_size = 0"),
    ({"data": {"source": "csv"}}, "data.source = 'csv'"),
    ({"data": {"val_fraction": 1.5}}, "data.val_fraction = 1.5"),
    ({"data": {"cache_path": ""}}, "data.cache_path = ''"),
    ({"run": {"name": "bad name!"}}, "run.name = 'bad name!'"),
    ({"run": {"keep_checkpoints": 0}}, "run.keep_checkpoints = 0"),
    ({"model": {"name": "resnet"}}, "model.name = 'resnet'"),
    ({"model": {"name": "gpt", "kwargs": {"n_embd": 30, "n_head": 4}}}, "model.kwargs.n_embd = 30"),
    ({"model": {"name": "gpt", "kwargs": {"layers": 2}}}, "model.kwargs.layers"),
    ({"scaling": {"torch_threads": 2**31}}, "scaling.torch_threads = 2147483648"),  # torch: an overflow
    ({"model": {"name": "mlp", "task": "regression"}}, "model.kwargs.task chooses it"),
]


@pytest.mark.parametrize("patch,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_values_name_the_field(tmp_path, patch, needle):
    data = mlp_config(tmp_path, "bad")
    for section, values in patch.items():
        data[section] = {**data[section], **values}
        if section == "model":
            data[section] = values
    with pytest.raises(ConfigError) as err:
        JobConfig.from_dict(data)
    msg = str(err.value)
    assert needle in msg and "expected" in msg and "\n" not in msg


def test_unknown_section_and_missing_required(tmp_path):
    data = mlp_config(tmp_path, "x")
    data["trainer"] = {}
    with pytest.raises(ConfigError, match="no such section"):
        JobConfig.from_dict(data)
    data = mlp_config(tmp_path, "x")
    del data["run"]["name"]
    with pytest.raises(ConfigError, match=r"run.name = None: expected a value \(required\)"):
        JobConfig.from_dict(data)


def test_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(mlp_config(tmp_path, "x"), ["train.lr"])


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second `model:` section silently
    replaced the first. Merge keys (`<<: *base`) may still be overridden."""
    path = tmp_path / "c.yaml"
    text = yaml.safe_dump(mlp_config(tmp_path, "dup"), sort_keys=False)
    path.write_text(text + "model: {name: gpt}\n")
    with pytest.raises(ConfigError, match=r"line \d+: key 'model' is given twice \(first at line \d+\)") as err:
        load_config(str(path))
    assert "\n" not in str(err.value)
    path.write_text(text.replace("train:\n", "defaults: &d {lr: 0.5, seed: 3}\ntrain:\n  <<: *d\n", 1))
    with pytest.raises(ConfigError, match="no such section"):  # merged, then `defaults` is unknown
        load_config(str(path))


def test_overrides_into_an_empty_section_and_of_text_that_is_not_yaml(tmp_path):
    """`parallel:` left empty (null) refused every --set into it; `data.glob=**/*.txt`
    was refused as YAML (an alias)."""
    data = mlp_config(tmp_path, "o")
    data["parallel"] = None
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_config(str(path), ["parallel.ddp_bucket_cap_mb=10"]).parallel.ddp_bucket_cap_mb == 10
    assert load_config(str(path), ["data.glob=**/*.txt"]).data.glob == "**/*.txt"
    with pytest.raises(ConfigError, match=r"data.feature_columns = '\[a, b': expected a list"):
        load_config(str(path), ["data.feature_columns=[a, b"])


def _rtp(*args):
    return subprocess.run([sys.executable, "-m", "raytrain_platform", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_cli_validate_ok_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(mlp_config(tmp_path, "cli")))
    ok = _rtp("validate", str(path))
    assert ok.returncode == 0, ok.stderr
    assert "valid:" in ok.stdout and "training" in ok.stdout
    for args, needle in [((str(path), "--set", "train.lr=0"), "train.lr = 0"),
                         ((str(tmp_path / "missing.yaml"),), "an existing YAML file"),
                         ((str(path), "--set", "data.batch_size=1000"), "fewer than one optimizer step")]:
        bad = _rtp("validate", *args)
        assert bad.returncode == 2, bad
        assert needle in bad.stderr and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_bad_data_is_a_clear_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, strings, empty = tmp_path / "pq", tmp_path / "strings", tmp_path / "empty"
    for f in (folder, strings, empty):
        f.mkdir()
    pq.write_table(pa.table({"a": [1.0] * 40, "label": [0, 1] * 20}), folder / "part.parquet")
    pq.write_table(pa.table({"a": ["x"] * 40, "label": [0, 1] * 20}), strings / "part.parquet")
    pq.write_table(pa.table({"a": pa.array([], pa.float64()), "label": pa.array([], pa.int64())}),
                   empty / "part.parquet")
    cases = [({"source": "parquet", "path": str(tmp_path / "nope")}, "no such file or folder"),
             ({"source": "parquet", "path": str(folder), "label_column": "y"}, "no such column"),
             ({"source": "parquet", "path": str(folder), "feature_columns": ["b"]}, "'b' is not in"),
             ({"source": "parquet", "path": str(strings)}, "column 'a' has type string: expected a number"),
             ({"source": "parquet", "path": str(empty)}, "hold no rows"),
             ({"source": "parquet", "path": str(folder), "batch_size": 64, "val_fraction": 0.0},
              "fewer than one optimizer step needs"),
             ({"source": "text", "path": str(tmp_path / "none")}, "existing folder")]
    for data, needle in cases:
        cfg = mlp_config(tmp_path, "d", data=data)
        if data["source"] == "text":
            cfg["model"] = {"name": "gpt"}
        path = tmp_path / "d.yaml"
        path.write_text(yaml.safe_dump(cfg))
        bad = _rtp("validate", str(path))
        assert bad.returncode == 2 and needle in bad.stderr, (needle, bad.stderr)


def test_make_data_and_tabular_config(tmp_path):
    """`rtp make-data` writes the Parquet that pipelines/configs/tabular.yaml reads."""
    out = tmp_path / "tab"
    made = _rtp("make-data", str(out), "--rows", "3000", "--files", "3")
    assert made.returncode == 0, made.stderr
    assert len(list(out.glob("*.parquet"))) == 3
    ok = _rtp("validate", "pipelines/configs/tabular.yaml", "--set", f"data.path={out}")
    assert ok.returncode == 0, ok.stderr
    assert "mlp (classification) on parquet" in ok.stdout
    train_rows, val_rows = map(int, re.search(r"data: (\d+) training / (\d+) validation",
                                              ok.stdout).groups())
    assert train_rows + val_rows == 3000 and 100 < val_rows < 200  # val_fraction 0.05
    again = _rtp("make-data", str(out))
    assert again.returncode == 2 and "already holds .parquet files" in again.stderr
    bad = _rtp("make-data", str(tmp_path / "x"), "--classes", "1")
    assert bad.returncode == 2 and "--classes = 1" in bad.stderr
    uneven = _rtp("make-data", str(tmp_path / "nine"), "--rows", "9", "--files", "4")
    assert uneven.returncode == 0 and len(list((tmp_path / "nine").glob("*.parquet"))) == 4
    (tmp_path / "afile").write_text("x")
    clash = _rtp("make-data", str(tmp_path / "afile"))
    assert clash.returncode == 2 and f"({tmp_path / 'afile'} is a file)" in clash.stderr


def test_the_configuration_page_documents_every_config_key():
    """docs/configuration.md (generated from the fields' docstrings) names every key the config accepts."""
    import dataclasses

    from raytrain_platform.config.sections import SECTIONS

    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f"{section}.{f.name}" for section, cls in SECTIONS.items()
               for f in dataclasses.fields(cls) if f"`{section}.{f.name}`" not in page]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_too_little_data_names_the_data_parallel_ranks():
    """Under TP the ranks of one group share micro-batches: a step needs data-parallel
    ranks x batch x accumulation rows, and the message says how the ranks are counted."""
    from raytrain_platform.errors import DataError
    from raytrain_platform.resolve import resolve_job

    base = {"model": {"name": "gpt", "kwargs": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16}},
            "data": {"source": "synthetic", "num_samples": 12, "batch_size": 8, "val_fraction": 0.0},
            "train": {"max_steps": 1, "grad_accum_steps": 1}, "run": {"name": "small"},
            "scaling": {"num_workers": 2}}
    # 12 rows feed one TP 2 step (1 data-parallel rank x 8), not one DDP 2 step (2 x 8).
    assert resolve_job(load_config({**base, "parallel": {"tp_size": 2}})).global_batch == 8
    with pytest.raises(DataError, match=r"scaling\.num_workers \(2\) x data\.batch_size \(8\) x "
                                        r"train\.grad_accum_steps \(1\) = 16$"):
        resolve_job(load_config({**base, "parallel": {"strategy": "ddp"}}))
    base["data"]["num_samples"] = 6
    with pytest.raises(DataError, match=r"data-parallel ranks \(1: scaling\.num_workers 2 / \(tp_size x "
                                        r"pp_size\)\) x data\.batch_size \(8\) x train\.grad_accum_steps \(1\) = 8$"):
        resolve_job(load_config({**base, "parallel": {"tp_size": 2}}))


def test_the_checks_across_sections_report_in_a_fixed_order(tmp_path):
    """JobConfig's checks run layout, batch, GPU-only options, blocks, model and data, in
    that order: a config with several errors names the same one first on every release."""
    two_errors = mlp_config(tmp_path, "order", data={"source": "synthetic", "batch_size": "auto"},
                            parallel={"strategy": "fsdp", "mixed_precision": True},
                            scaling={"num_workers": 2, "use_gpu": False})
    with pytest.raises(ConfigError, match=r"^train.global_batch_size = None"):
        load_config(two_errors)
    two_errors["train"]["global_batch_size"] = 8  # the batch error mended: the next one shows
    with pytest.raises(ConfigError, match=r"^parallel.mixed_precision = True: .*GPU-only FSDP option"):
        load_config(two_errors)
