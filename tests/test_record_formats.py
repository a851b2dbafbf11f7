"""The alpaca and sharegpt record formats (`data/encode.py`) and records read from tables
(`data/tables.py`: a `datasets` save_to_disk folder, Arrow and Parquet files), with a real
tokenizer (tools/tiny_llm's, which has a ChatML template), real text (the standard
library's docstrings) and the real `datasets` library: no Ray, no mocks, no hub."""

import os

# Before transformers and datasets are imported: nothing in this file may reach a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import json  # noqa: E402
import pickle  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")

import pyarrow.parquet as pq  # noqa: E402

from raytrain_platform.config import load_config  # noqa: E402
from raytrain_platform.data.encode import (  # noqa: E402
    RecordSpec, check_record, encode_record, encode_records, record_spec, tokenizer_for_format)
from raytrain_platform.data.tables import (  # noqa: E402
    check_table_files, table_blocks, table_files, table_records, table_schema)
from raytrain_platform.errors import ConfigError, DataError  # noqa: E402
from raytrain_platform.tools import tiny_llm  # noqa: E402

END = "<|im_end|>\n"  # the tiny template's end of a turn


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    tiny_llm.make_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    tok = tokenizer_for_format(str(tok_dir), "alpaca")
    assert tok.chat_template  # the test's premise: a real chat template renders the turns
    return tok


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> list[tuple[str, str]]:
    """(question, answer) pairs from the standard library's docstrings."""
    paths = tiny_llm.make_instruction_jsonl(tmp_path_factory.mktemp("qa"), n=60)
    return [(m[0]["content"], m[1]["content"]) for m in
            (json.loads(line)["messages"] for line in paths["chat"].read_text().splitlines())]


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def alpaca_rows(pairs) -> list[dict]:
    """Alpaca records: with an input and a system prompt, with an empty input, without
    either, with a system prompt only. (The first has every field: `Dataset.from_list`
    and `pa.Table.from_pylist` take their columns from the first row.)"""
    rows = []
    for i, (q, a) in enumerate(pairs):
        row = {"instruction": q, "output": a}
        if i % 4 == 0:
            row["input"] = pairs[i - 1][1][:80]
        elif i % 4 == 1:
            row["input"] = ""
        if i % 4 in (0, 3):
            row["system"] = "Answer from the documentation."
        rows.append(row)
    return rows


def sharegpt_rows(pairs) -> list[dict]:
    """ShareGPT records of one or two exchanges, some with a system turn, some with the
    user/assistant names of `from`."""
    rows = []
    for i in range(0, len(pairs) - 1, 2):
        (q1, a1), (q2, a2) = pairs[i], pairs[i + 1]
        human, gpt = ("user", "assistant") if i % 4 else ("human", "gpt")
        turns = [{"from": human, "value": q1}, {"from": gpt, "value": a1}]
        if i % 3 == 0:
            turns = [{"from": "system", "value": "Be exact."}, *turns, {"from": human, "value": q2},
                     {"from": gpt, "value": a2}]
        rows.append({"conversations": turns})
    return rows


# The formats of one document per record (preference pairs: tests/test_preference_data.py).
FORMATS = ("text", "prompt_completion", "chat", "alpaca", "sharegpt")


def rows_of(fmt: str, pairs) -> list[dict]:
    if fmt == "alpaca":
        return alpaca_rows(pairs)
    if fmt == "sharegpt":
        return sharegpt_rows(pairs)
    if fmt == "chat":
        rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for q, a in pairs]
        rows[1]["messages"][0]["name"] = "reader"  # in a table, every other message gets a null name
        return rows
    if fmt == "prompt_completion":
        return [{"prompt": q + "\n", "completion": a} for q, a in pairs]
    return [{"text": a} for _, a in pairs]


# ---------------------------------------------------------------- formats


def test_alpaca_is_the_chat_record_built_by_hand_and_trains_on_the_output(tok, pairs):
    chat = RecordSpec("chat")
    rows = alpaca_rows(pairs[:12])
    for row in rows:
        user = row["instruction"] + ("\n" + row["input"] if row.get("input") else "")  # LLaMA-Factory's join
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        if "system" in row:
            messages.insert(0, {"role": "system", "content": row["system"]})
        ids, mask = encode_record(tok, row, RecordSpec("alpaca"))
        assert (ids, mask) == encode_record(tok, {"messages": messages}, chat)
        # The mask is one run: exactly the output's tokens and the turn's end.
        ones = [i for i, m in enumerate(mask) if m]
        assert ones == list(range(ones[0], ones[-1] + 1))
        assert tok.decode([ids[i] for i in ones]) == row["output"] + END
        assert tok.decode(ids[:ones[0]]).endswith("<|im_start|>assistant\n") and ids[-1] == tok.eos_token_id
    assert {len(r) for r in rows} == {2, 3, 4}  # every shape was tried
    # Tokenized together, each record gets its own tokens.
    assert encode_records(tok, rows, RecordSpec("alpaca")) == [encode_record(tok, r, RecordSpec("alpaca"))
                                                             for r in rows]


def test_sharegpt_is_the_chat_record_built_by_hand_and_trains_on_the_gpt_turns(tok, pairs):
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    rows = sharegpt_rows(pairs[:12])
    assert {t["from"] for r in rows for t in r["conversations"]} == set(roles)
    for row in rows:
        messages = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
        ids, mask = encode_record(tok, row, RecordSpec("sharegpt"))
        assert (ids, mask) == encode_record(tok, {"messages": messages}, RecordSpec("chat"))
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        assert trained == "".join(t["value"] + END for t in row["conversations"] if t["from"] in ("gpt", "assistant"))
    assert encode_records(tok, rows, RecordSpec("sharegpt")) == [encode_record(tok, r, RecordSpec("sharegpt"))
                                                               for r in rows]


def test_field_names_are_configurable(tok):
    spec = RecordSpec("alpaca", instruction_field="q", input_field="ctx", output_field="a", system_field="sys")
    renamed = {"q": "Sum?", "ctx": "1 2", "a": "3", "sys": "Be brief."}
    plain = {"instruction": "Sum?", "input": "1 2", "output": "3", "system": "Be brief."}
    assert encode_record(tok, renamed, spec) == encode_record(tok, plain, RecordSpec("alpaca"))
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    assert (encode_record(tok, {"turns": turns}, RecordSpec("sharegpt", conversations_field="turns"))
            == encode_record(tok, {"conversations": turns}, RecordSpec("sharegpt")))


def test_a_token_spec_reads_its_format_and_field_names(tok_dir):
    from raytrain_platform.data.specs import TokenSpec

    spec = TokenSpec(path="x.jsonl", format="chat", tokenizer=str(tok_dir), seq_len=9, val_fraction=0.0,
                     messages_field="m")
    assert record_spec(spec) == RecordSpec("chat", messages_field="m")
    with pytest.raises(DataError, match="expected a field 'm'"):
        check_record({"messages": []}, spec)


BAD_RECORDS = [
    ("alpaca", {"output": "a"}, "expected a string field 'instruction' \\(data.format alpaca\\), got missing"),
    ("alpaca", {"instruction": "q", "output": None}, "'output' \\(data.format alpaca\\), got NoneType"),
    ("alpaca", {"instruction": "q", "output": "a", "input": 3}, "optional string field 'input'.*got int"),
    ("alpaca", {"instruction": "q", "output": "a", "system": ["x"]}, "optional string field 'system'.*got list"),
    ("alpaca", {"instruction": "q \ud800", "output": "a"}, "field 'instruction': a lone surrogate"),
    ("alpaca", ["q", "a"], "expected a JSON object, got list"),
    ("sharegpt", {"messages": []}, "expected a field 'conversations' \\(data.format sharegpt\\)"),
    ("sharegpt", {"conversations": []}, "a non-empty list of .*\"from\" one of human, user, gpt, assistant, system"),
    ("sharegpt", {"conversations": [{"from": "bot", "value": "x"}]},
     "\"from\" one of human, user, gpt, assistant, system; message 0 is {\"from\": \"bot\""),
    ("sharegpt", {"conversations": [{"from": "human", "value": 1}]}, "message 0 is"),
    ("sharegpt", {"conversations": [{"from": ["gpt"], "value": "a"}]}, "message 0 is"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}]}, "at least one message from 'gpt'"),
    ("sharegpt", {"conversations": [{"from": "gpt", "value": "a \udc00"}]}, "message 0 'value': a lone surrogate"),
]


@pytest.mark.parametrize("fmt,record,match", BAD_RECORDS)
def test_bad_records_are_one_line(fmt, record, match):
    with pytest.raises(DataError, match=match) as exc:
        check_record(record, RecordSpec(fmt))
    one_line(exc)


def test_a_tokenizer_without_a_chat_template_is_refused_for_the_chat_formats(tok_dir, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(tok_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    assert tokenizer_for_format(str(plain), "text").eos_token_id is not None
    for fmt in ("chat", "alpaca", "sharegpt"):
        with pytest.raises(ConfigError, match=f"data.tokenizer = .*chat_template for data.format {fmt}$") as exc:
            tokenizer_for_format(str(plain), fmt)
        one_line(exc)
    with pytest.raises(ConfigError, match="data.format = 'csv'.*alpaca, sharegpt"):
        RecordSpec("csv")


# ---------------------------------------------------------------- tables


def write_jsonl(path: Path, rows: list[dict]) -> list[dict]:
    """The rows as a JSONL file, and what a reader of that file gets back."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_table(kind: str, path: str, spec: RecordSpec, rows: int = 7) -> list[dict]:
    """Every record of a table source, in order; each file's rows numbered from 0 on."""
    out = []
    for file in table_files(kind, path):
        indices = []
        for first, block in table_blocks(kind, file, rows):
            assert block.num_rows <= rows
            for index, record, size in table_records(file, first, block, spec):
                indices.append(index)
                out.append(record)
                assert size > 0
        assert indices == list(range(len(indices)))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_save_to_disk_folder_gives_the_records_of_the_same_jsonl(pairs, tmp_path, fmt):
    datasets = pytest.importorskip("datasets")
    rows = rows_of(fmt, pairs)
    expected = write_jsonl(tmp_path / "same.jsonl", rows)
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=3)
    files = table_files("hf_dataset", str(folder))
    assert [Path(f).name for f in files] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    spec = RecordSpec(fmt)
    check_table_files("hf_dataset", files, spec)
    assert read_table("hf_dataset", str(folder), spec) == expected
    assert read_table("hf_dataset", str(folder), spec, rows=1000) == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_parquet_files_give_the_records_of_the_same_jsonl(pairs, tmp_path, fmt):
    rows = rows_of(fmt, pairs)
    expected = write_jsonl(tmp_path / "same.jsonl", rows)
    half = len(rows) // 2
    folder = tmp_path / "pq"
    (folder / "b").mkdir(parents=True)
    # Sorted by path: a-0 before b/0; row groups of 4 rows, blocks of 7 cross them.
    schema = pa.Table.from_pylist(rows).schema
    pq.write_table(pa.Table.from_pylist(rows[:half], schema), folder / "a-0.parquet", row_group_size=4)
    pq.write_table(pa.Table.from_pylist(rows[half:], schema), folder / "b" / "0.parquet", row_group_size=4)
    spec = RecordSpec(fmt)
    assert read_table("parquet", str(folder), spec) == expected
    uri = f"file://{folder}"  # a URI stays a URI any process can open
    assert table_files("parquet", uri) == [f"{uri}/a-0.parquet", f"{uri}/b/0.parquet"]
    assert read_table("parquet", uri, spec) == expected


def test_blocks_are_slices_of_the_rows_asked_for_and_picklable(pairs, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = rows_of("alpaca", pairs)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    (file,) = table_files("hf_dataset", str(tmp_path / "one"))
    blocks = list(table_blocks("hf_dataset", file, 16, columns=["output", "instruction", "nope"]))
    assert [(first, b.num_rows) for first, b in blocks] == [(0, 16), (16, 16), (32, 16), (48, 12)]
    assert blocks[0][1].column_names == ["instruction", "output"]  # the file's order; absent ones skipped
    again = [pickle.loads(pickle.dumps(b)) for _, b in blocks]
    assert [t.to_pylist() for t in again] == [b.to_pylist() for _, b in blocks]
    assert [r for t in again for r in t.to_pylist()] == [{"instruction": r["instruction"], "output": r["output"]}
                                                         for r in rows]


def test_arrow_files_of_either_ipc_format_and_a_dataset_dicts_train_split(pairs, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = rows_of("text", pairs)
    table = pa.Table.from_pylist(rows)
    folder = tmp_path / "arrows"
    folder.mkdir()
    with pa.ipc.new_file(folder / "b.arrow", table.schema) as w:  # the file format
        w.write_table(table.slice(30), max_chunksize=8)
    with pa.ipc.new_stream(folder / "a.arrow", table.schema) as w:  # the stream format
        w.write_table(table.slice(0, 30), max_chunksize=8)
    assert read_table("hf_dataset", str(folder), RecordSpec("text")) == rows
    assert table_schema("hf_dataset", str(folder / "b.arrow")).names == ["text"]
    dd = tmp_path / "dict"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:5]),
                          "train": datasets.Dataset.from_list(rows[5:])}).save_to_disk(str(dd))
    assert read_table("hf_dataset", str(dd), RecordSpec("text")) == rows[5:]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:5])}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(DataError, match=r"without a 'train' split \(its splits are \['test'\]\)") as exc:
        table_files("hf_dataset", str(tmp_path / "no_train"))
    one_line(exc)


def bad_parquet(tmp_path: Path, rows: list[dict], schema=None) -> str:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def test_bad_tables_name_file_column_and_row(tmp_path):
    def records(path: str, fmt: str) -> list:
        return [r for first, block in table_blocks("parquet", path, 2)
                for r in table_records(path, first, block, RecordSpec(fmt))]

    path = bad_parquet(tmp_path, [{"body": "x", "id": 1}])
    for read in (lambda: records(path, "text"), lambda: check_table_files("parquet", [path], RecordSpec("text"))):
        with pytest.raises(DataError) as exc:
            read()
        assert one_line(exc) == (f"{path}: no column 'text', which data.format text reads; its columns are "
                                 "['body', 'id']")
    path = bad_parquet(tmp_path, [{"text": "a"}, {"text": "b"}, {"text": None}])
    with pytest.raises(DataError) as exc:
        records(path, "text")
    assert one_line(exc) == f"{path}: row 3: column 'text' is null; data.format text needs a value"
    path = bad_parquet(tmp_path, [{"text": 1}])
    with pytest.raises(DataError, match=f"^{path}: column 'text' has type int64; data.format text needs strings$"):
        records(path, "text")
    path = bad_parquet(tmp_path, [{"conversations": "hi"}])
    with pytest.raises(DataError, match="column 'conversations' has type string; .* needs a list of structs"):
        records(path, "sharegpt")
    turns = [[{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
             [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]]
    path = bad_parquet(tmp_path, [{"conversations": t} for t in turns])
    with pytest.raises(DataError) as exc:
        records(path, "sharegpt")
    assert one_line(exc).startswith(f"{path}: row 2: expected 'conversations': a non-empty list of ")
    # An optional alpaca column may be absent, or null throughout.
    schema = pa.schema([("instruction", pa.string()), ("input", pa.null()), ("output", pa.string())])
    path = bad_parquet(tmp_path, [{"instruction": "q", "input": None, "output": "a"}], schema)
    assert records(path, "alpaca") == [(0, {"instruction": "q", "output": "a"}, 2)]


def test_bad_table_paths_are_one_line(tmp_path):
    cases = [(tmp_path / "missing", "no such file or folder"), (tmp_path, "the folder holds no .arrow files")]
    (tmp_path / "x.txt").write_text("not arrow")
    cases.append((tmp_path / "x.txt", "expected a datasets save_to_disk folder, or .arrow files"))
    for path, match in cases:
        with pytest.raises(DataError, match=match) as exc:
            table_files("hf_dataset", str(path))
        assert one_line(exc).startswith(f"data.path = {str(path)!r}: ")
    with pytest.raises(DataError, match=r"^data.sources\[1\].path = .*: no such file or folder$"):
        table_files("hf_dataset", str(tmp_path / "missing"), field="data.sources[1].path")
    with pytest.raises(DataError, match=r"^data.sources\[1\].path = .*: no such file or folder$"):
        table_files("parquet", str(tmp_path / "missing"), field="data.sources[1].path")
    (tmp_path / "bad.arrow").write_text("not arrow either")
    with pytest.raises(DataError, match="bad.arrow: cannot be read as an Arrow file") as exc:
        list(table_blocks("hf_dataset", str(tmp_path / "bad.arrow"), 4))
    one_line(exc)
    table = pa.table({"text": [f"row {i}" for i in range(1000)]})
    with pa.ipc.new_stream(tmp_path / "cut.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=100)
    data = (tmp_path / "cut.arrow").read_bytes()
    (tmp_path / "cut.arrow").write_bytes(data[: len(data) // 2])  # a copy that stopped halfway
    with pytest.raises(DataError, match="cut.arrow: cannot be read") as exc:
        list(table_blocks("hf_dataset", str(tmp_path / "cut.arrow"), 64))
    one_line(exc)
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "gone.arrow"}]}))
    with pytest.raises(DataError, match="state.json lists .*gone.arrow', which is not there") as exc:
        table_files("hf_dataset", str(tmp_path))
    one_line(exc)


# ---------------------------------------------------------------- config


def lm_config(data: dict, model: dict | None = None) -> dict:
    return {"model": model or {"name": "gpt"}, "data": {"batch_size": 2, **data},
            "train": {"max_steps": 1}, "run": {"name": "formats"}}


@pytest.mark.parametrize("source", ["jsonl", "hf_dataset", "parquet"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_config_takes_the_formats_for_every_record_source(source, fmt):
    cfg = load_config(lm_config({"source": source, "path": "d", "format": fmt, "tokenizer": "tok"}))
    assert cfg.data.reads_records(cfg.model) and cfg.data.tokenizer_for(cfg.model) == "tok"
    assert cfg.data.resolved_packing == ("concat" if fmt == "text" else "documents")


def test_tabular_parquet_is_as_before():
    cfg = load_config(lm_config({"source": "parquet", "path": "d"}, {"name": "mlp"}))
    assert not cfg.data.reads_records(cfg.model) and cfg.data.tokenizer_for(cfg.model) is None
    assert cfg.data.resolved_packing == "concat"


BAD_CONFIGS = [
    ({"source": "text", "format": "alpaca"}, None, "data.format",
     "'text' for data.source text (the other formats are records of jsonl, hf_dataset, parquet)"),
    ({"source": "synthetic", "format": "sharegpt"}, None, "data.format", "'text' for data.source synthetic"),
    ({"source": "jsonl", "path": "d", "format": "xml", "tokenizer": "t"}, None, "data.format",
     "one of ['text', 'prompt_completion', 'chat', 'alpaca', 'sharegpt', 'preference']"),
    ({"source": "hf_dataset", "tokenizer": "t"}, None, "data.path", "a datasets save_to_disk folder"),
    ({"source": "hf_dataset", "path": "d"}, None, "data.tokenizer",
     "a local tokenizer folder for data.source hf_dataset (model 'gpt' has no tokenizer"),
    ({"source": "parquet", "path": "d", "format": "chat"}, None, "data.tokenizer",
     "a local tokenizer folder for data.source parquet"),
    ({"source": "hf_dataset", "path": "d", "tokenizer": "t"}, {"name": "mlp"}, "data.source",
     "hf_dataset needs an lm model"),
    ({"source": "parquet", "path": "d", "format": "alpaca"}, {"name": "mlp"}, "data.format",
     "'text' (unset) for tabular parquet (a classification model"),
    ({"source": "parquet", "path": "d", "tokenizer": "t"}, {"name": "mlp"}, "data.tokenizer",
     "null for tabular parquet"),
    ({"source": "parquet", "path": "d", "packing": "documents"}, {"name": "mlp"}, "data.packing",
     "concat or null for tabular parquet"),
    ({"source": "parquet", "path": "d", "tokenizer": "t", "val_path": "v"}, None, "data.val_path",
     "null for parquet records"),
    ({"source": "jsonl", "path": "d", "tokenizer": "t", "conversations_field": ""}, None,
     "data.conversations_field", "a JSON field name"),
]


@pytest.mark.parametrize("data,model,field,needle", BAD_CONFIGS, ids=[f"{c[2]}-{i}" for i, c in enumerate(BAD_CONFIGS)])
def test_config_refuses_in_one_line(data, model, field, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(lm_config(data, model))
    assert exc.value.field == field and needle in one_line(exc), one_line(exc)
