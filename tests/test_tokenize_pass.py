"""The tokenizing pass (data/tokenize_pass.py) and its dataset (data/prepared.py): the
windows equal those of the readers it replaced, in this process and on Ray, at any block
size; a rerun reads what a pass wrote; its key follows what the windows depend on; bad
records and an unwritable cache path are one line. Across nodes: tests/test_cluster.py.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from conftest import ROOT  # noqa: E402
from raytrain_platform.data import jsonl  # noqa: E402
from raytrain_platform.data.prepared import find_manifest  # noqa: E402
from raytrain_platform.data.sources import SourceSpec, describe, iter_source  # noqa: E402
from raytrain_platform.errors import DataError  # noqa: E402
from raytrain_platform.tools import tiny_llm  # noqa: E402

TODAY = json.loads((Path(__file__).parent / "data" / "windows-5ebb169.json").read_text())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """What the windows of 5ebb169 were read from: the tiny tokenizer, 300 records in
    each format, and the prompt_completion records in two files of a folder."""
    out = tmp_path_factory.mktemp("corpus")
    tiny_llm.make_tokenizer(out / "tok")
    data = tiny_llm.make_instruction_jsonl(out / "data", n=300)
    lines = Path(data["prompt_completion"]).read_text().splitlines(True)
    (out / "two" / "sub").mkdir(parents=True)
    (out / "two" / "a.jsonl").write_text("".join(lines[:170]))
    (out / "two" / "sub" / "b.jsonl").write_text("".join(lines[170:]))
    return {"tok": out / "tok", "two": out / "two", **{k: Path(v) for k, v in data.items()}}


def cases(corpus: dict, cache: Path) -> dict[str, SourceSpec]:
    common = dict(task="lm", tokenizer=str(corpus["tok"]), cache_root=str(cache))
    out = {f"jsonl-{fmt}-{packing}": SourceSpec(kind="jsonl", val_fraction=0.1, seq_len=65, path=str(corpus[fmt]),
                                               format=fmt, packing=packing, **common)
           for fmt in ("text", "prompt_completion", "chat") for packing in ("concat", "documents")}
    out["jsonl-folder"] = SourceSpec(kind="jsonl", val_fraction=0.2, seq_len=33, path=str(corpus["two"]),
                                     format="prompt_completion", packing="documents", **common)
    stdlib = sysconfig.get_paths()["stdlib"]
    for name, glob, most in (("json", "json/**/*.py", None), ("email", "email/**/*.py", 40)):
        out[f"text-{name}"] = SourceSpec(kind="text", val_fraction=0.1, seq_len=129, path=stdlib, glob=glob,
                                         max_files=most, **common)
    return out


def fingerprint(spec: SourceSpec, *, on_ray: bool) -> dict[str, list]:
    """Each split's [windows, sha256 of its arrays whole, in sorted key order]."""
    spec = dataclasses.replace(spec, prepared=describe(spec, on_ray=on_ray).prepared)
    out = {}
    for split in ("train", "val"):
        parts = list(iter_source(spec, split))
        digest = hashlib.sha256()
        for key in sorted(parts[0]) if parts else []:
            digest.update(key.encode())
            digest.update(np.ascontiguousarray(np.concatenate([p[key] for p in parts])).tobytes())
        out[split] = [sum(len(p["sample_id"]) for p in parts), digest.hexdigest()]
    return out


def test_the_windows_are_those_of_the_readers_before_in_this_process(corpus, tmp_path, monkeypatch):
    """Windows, masks, position ids, sample ids and splits of every format, packing and
    source: byte for byte those of 5ebb169's readers, in one block per file and in many."""
    for block in (None, 3000):
        if block:
            monkeypatch.setattr(jsonl, "BLOCK_BYTES", block)
        for name, spec in cases(corpus, tmp_path / f"cache-{block}").items():
            assert fingerprint(spec, on_ray=False) == TODAY[name], (name, block)


@pytest.mark.ray
@pytest.mark.extended  # the same windows in this process, by default; here through Ray Data's tasks
def test_the_windows_are_those_of_the_readers_before_on_ray(ray_cluster, corpus, tmp_path, monkeypatch):
    """The same through Ray Data's tasks (a file's byte ranges tokenized side by side)."""
    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 3000)  # the driver cuts the ranges; the tasks read them
    all_cases = cases(corpus, tmp_path / "cache")
    for name in ("jsonl-chat-documents", "jsonl-prompt_completion-concat", "jsonl-folder", "text-email"):
        assert fingerprint(all_cases[name], on_ray=True) == TODAY[name], name


@pytest.mark.ray
def test_a_bad_record_on_ray_names_its_file_and_line(ray_cluster, corpus, tmp_path, monkeypatch):
    """A task does not know the lines before its range: the driver adds them up."""
    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 2048)
    lines = corpus["chat"].read_text().splitlines()
    lines[250] = "{not json"
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    spec = dataclasses.replace(cases(corpus, tmp_path / "cache")["jsonl-chat-concat"], path=str(tmp_path / "bad.jsonl"))
    with pytest.raises(DataError, match="not valid JSON") as exc:
        describe(spec, on_ray=True)
    assert str(exc.value).startswith(f"{tmp_path / 'bad.jsonl'}:251: ") and "\n" not in str(exc.value)
    assert find_manifest(str(tmp_path / "cache")) is None and not list((tmp_path / "cache").glob("*/manifest.json"))


def test_a_rerun_reads_what_a_pass_wrote_and_the_key_follows_the_inputs(corpus, tmp_path, capsys):
    spec = cases(corpus, tmp_path / "cache")["jsonl-chat-documents"]
    first = describe(spec, on_ray=False)
    assert "tokenized 300 documents" in capsys.readouterr().err
    again = describe(spec, on_ray=False)
    assert again == first and "written before" in capsys.readouterr().err  # nothing tokenized
    manifest = find_manifest(first.prepared)
    assert manifest.windows == {"train": first.num_train, "val": first.num_val}
    assert manifest.content["truncated"] == first.truncated and manifest.content["documents"] == 300
    # What the windows depend on: another seq_len, packing, split or tokenizer, or the file changed.
    others = [dataclasses.replace(spec, seq_len=33), dataclasses.replace(spec, packing="concat"),
              dataclasses.replace(spec, val_fraction=0.2)]
    assert len({describe(s, on_ray=False).prepared for s in [spec, *others]}) == 4
    data = tmp_path / "chat.jsonl"
    data.write_bytes(corpus["chat"].read_bytes())
    mine = dataclasses.replace(spec, path=str(data))
    before = describe(mine, on_ray=False)
    with data.open("a") as f:
        f.write(corpus["chat"].read_text().splitlines()[0] + "\n")
    after = describe(mine, on_ray=False)
    assert after.prepared != before.prepared and after.num_train + after.num_val >= before.num_train + before.num_val
    capsys.readouterr()


def test_an_unfinished_pass_is_written_again(corpus, tmp_path, capsys):
    """A pass that stopped (no manifest.json) left files that are not a dataset."""
    spec = cases(corpus, tmp_path / "cache")["jsonl-text-concat"]
    info = describe(spec, on_ray=False)
    manifest = Path(info.prepared) / "manifest.json"
    manifest.unlink()
    again = describe(spec, on_ray=False)
    assert "tokenized 300 documents" in capsys.readouterr().err and manifest.exists()
    assert (again.num_train, again.num_val) == (info.num_train, info.num_val)


def test_rtp_validate_refuses_a_cache_path_it_cannot_write_before_tokenizing(corpus, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = {"model": {"name": "user_models:tiny_llama", "task": "lm", "kwargs": {"vocab_size": 512, "max_positions": 64}},
           "data": {"source": "jsonl", "path": str(corpus["chat"]), "format": "chat", "tokenizer": str(corpus["tok"]),
                    "cache_path": str(blocker / "datasets"), "batch_size": 2, "seq_len": 64},
           "train": {"max_steps": 1}, "run": {"name": "c", "storage_path": str(tmp_path / "runs")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}  # user_models
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "validate", str(tmp_path / "c.yaml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith(f"error: data.cache_path = '{blocker / 'datasets'}': expected a folder or pyarrow URI "
                          "this process can write") and len(err.splitlines()) == 1, err
    assert "tokenizing" not in proc.stderr and blocker.read_text() == "not a folder"


def _chat_rows(corpus: dict) -> list[dict]:
    return [json.loads(line) for line in corpus["chat"].read_text().splitlines()]


def _same(a: SourceSpec, b: SourceSpec, splits=("train", "val")) -> None:
    for split in splits:
        got, want = (dataclasses.replace(s, prepared=describe(s, on_ray=False).prepared) for s in (a, b))
        got, want = list(iter_source(got, split)), list(iter_source(want, split))
        assert len(got) == len(want) and got, split
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and all(np.array_equal(g[k], w[k]) for k in g), split


def test_alpaca_and_sharegpt_records_pack_as_the_chat_records_they_are(corpus, tmp_path):
    """The same conversations as alpaca and as ShareGPT records, in files of the same name
    (the split hashes it): the windows of the chat file, both splits, ids included."""
    rows = _chat_rows(corpus)
    shapes = {"chat": rows,
              "alpaca": [{"instruction": r["messages"][0]["content"], "output": r["messages"][1]["content"]}
                         for r in rows],
              "sharegpt": [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]],
                                               "value": m["content"]} for m in r["messages"]]} for r in rows]}
    assert all(len(r["messages"]) == 2 and r["messages"][0]["role"] == "user" for r in rows)
    specs = {}
    for fmt, records in shapes.items():
        (tmp_path / fmt).mkdir()
        path = tmp_path / fmt / "records.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        specs[fmt] = SourceSpec(kind="jsonl", task="lm", val_fraction=0.2, seq_len=65, path=str(path), format=fmt,
                                tokenizer=str(corpus["tok"]), packing="documents", cache_root=str(tmp_path / "cache"))
    _same(specs["alpaca"], specs["chat"])
    _same(specs["sharegpt"], specs["chat"])


def test_a_hugging_face_dataset_and_parquet_records_pack_as_their_jsonl(corpus, tmp_path):
    """A `datasets` save_to_disk folder and a Parquet file of the chat records: the
    windows of the JSONL (all training: the split hashes the file's name, which differs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    rows = _chat_rows(corpus)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pq" / "part-0.parquet", row_group_size=64)
    common = dict(task="lm", val_fraction=0.0, seq_len=65, format="chat", tokenizer=str(corpus["tok"]),
                  packing="documents", cache_root=str(tmp_path / "cache"))
    reference = SourceSpec(kind="jsonl", path=str(corpus["chat"]), **common)
    _same(SourceSpec(kind="hf_dataset", path=str(tmp_path / "hf"), **common), reference, splits=("train",))
    _same(SourceSpec(kind="parquet", path=str(tmp_path / "pq"), **common), reference, splits=("train",))
    bad = [dict(r) for r in rows]
    bad[40] = {"messages": [{"role": "user", "content": "only a question"}]}
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "pq" / "part-0.parquet", row_group_size=64)
    with pytest.raises(DataError, match="role 'assistant'") as exc:
        describe(SourceSpec(kind="parquet", path=str(tmp_path / "pq"), **common), on_ray=False)
    assert str(exc.value).startswith(f"{tmp_path / 'pq' / 'part-0.parquet'}: row 41: ") and "\n" not in str(exc.value)


def _mixture_config(corpus: dict, tmp: Path, name: str, **train) -> dict:
    from conftest import job_config

    return job_config(tmp, name, dict(
        model={"name": "user_models:tiny_llama", "task": "lm", "kwargs": {"vocab_size": 512, "max_positions": 64}},
        data={"source": "jsonl", "format": "chat", "tokenizer": str(corpus["tok"]), "batch_size": 4, "seq_len": 16,
              "val_fraction": 0.1, "cache_path": str(tmp / "datasets"),
              "sources": [{"path": str(corpus["chat"]), "weight": 0.98},
                          {"path": str(corpus["text"]), "format": "text", "weight": 0.02}]},
        train={"max_steps": 6, "lr": 3e-3, "lr_schedule": "constant", "seed": 0, **train},
        run={"checkpoint_every": 3, "eval_every": 3}))


def test_a_mixture_draws_by_weight_every_window_of_every_source(corpus, tmp_path):
    """Two sources at 98% and 2%, tokenized each by its own pass: over the first 10,000
    windows of the epoch the small source's share is within 1% of 2%; the epoch holds
    every window of both (the small one cycled); ids say the source; validation is each
    source's own split, in order."""
    from raytrain_platform.config import load_config
    from raytrain_platform.data.mixture import local_id, source_of
    from raytrain_platform.resolve import resolve_job

    job = resolve_job(load_config(_mixture_config(corpus, tmp_path, "mix")))
    spec = SourceSpec.from_config(job.config, prepared=job.data.prepared)
    train = {k: np.concatenate([b[k] for b in iter_source(spec, "train")]) for k in ("sample_id", "tokens")}
    assert len(train["sample_id"]) == job.data.num_train >= 10_000
    source = source_of(train["sample_id"])
    assert abs((source[:10_000] == 1).mean() - 0.02) < 0.01
    parts = [dataclasses.replace(p, prepared=describe(p, on_ray=False).prepared) for p in spec.parts]
    for k, part in enumerate(parts):
        own = np.concatenate([b["sample_id"] for b in iter_source(part, "train")])
        drawn = local_id(train["sample_id"][source == k])
        assert set(drawn.tolist()) == set(own.tolist())  # every window, at least once
        assert np.array_equal(drawn[:len(own)], own)  # in the source's order
    val = np.concatenate([b["sample_id"] for b in iter_source(spec, "val")])
    own_val = [np.concatenate([b["sample_id"] for b in iter_source(p, "val")]) for p in parts]
    assert np.array_equal(local_id(val), np.concatenate(own_val)) and len(val) == job.data.num_val
    assert source_of(val).tolist() == [0] * len(own_val[0]) + [1] * len(own_val[1])


@pytest.mark.extended  # three torchrun launches
def test_a_resumed_mixture_run_continues_the_same_sequence(corpus, tmp_path):
    """Under torchrun: 3 steps, then the same run resumed to 6, trains on what 6 steps in
    one go train on (the same losses at steps 4 to 6: the data, not only the count)."""
    from conftest import torchrun_metrics

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    whole = torchrun_metrics(_mixture_config(corpus, tmp_path / "a", "whole"), tmp_path / "whole.yaml", 1, env=env)
    torchrun_metrics(_mixture_config(corpus, tmp_path / "b", "resumed", max_steps=3), tmp_path / "r3.yaml", 1,
                     env=env)
    resumed = torchrun_metrics(_mixture_config(corpus, tmp_path / "b", "resumed"), tmp_path / "r6.yaml", 1, env=env)
    losses = {r["step"]: r["loss"] for r in whole if "loss" in r}
    again = {r["step"]: r["loss"] for r in resumed if "loss" in r}
    assert [s for s in again if s > 3] == [4, 5, 6]
    assert all(again[s] == losses[s] for s in (4, 5, 6)), (again, losses)


@pytest.mark.ray
def test_ray_data_reads_a_mixture_in_the_same_order(ray_cluster, corpus, tmp_path):
    """The read tasks (a piece per 64 chunks of positions; one task over all of them for a
    dealt split) give the Ray-free reader's sequence."""
    from raytrain_platform.config import load_config
    from raytrain_platform.data.ray_data import _source_dataset, ingest_options
    from raytrain_platform.resolve import resolve_job

    job = resolve_job(load_config(_mixture_config(corpus, tmp_path, "mix")))
    spec = SourceSpec.from_config(job.config, prepared=job.data.prepared)
    for split, one_task in (("train", False), ("train", True), ("val", False)):
        want = np.concatenate([b["sample_id"] for b in iter_source(spec, split)])
        ds = _source_dataset(spec, split, (), rows=4 if one_task else None, one_task=one_task)
        ds.context.execution_options = ingest_options()
        got = np.concatenate([b["sample_id"] for b in ds.iter_batches(batch_size=None, batch_format="numpy")])
        assert np.array_equal(got, want), (split, one_task)
