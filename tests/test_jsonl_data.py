"""JSONL instruction data and tokenized text (`data/jsonl.py`, `data/text_groups.py`,
`data/pieces.py`), their tokenized dataset written in this process (`data/tokenize_pass.py`,
`data/prepared.py`; on Ray: tests/test_tokenize_pass.py), and the offline tiny LLM maker
(`tools/tiny_llm.py`), with a real tokenizer, model and data: no Ray, no mocks, no hub."""

import os

# Before transformers is imported: nothing in this file may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import dataclasses  # noqa: E402

from raytrain_platform.data import text_groups  # noqa: E402
from raytrain_platform.data.encode import check_fits, encode_record, load_tokenizer  # noqa: E402
from raytrain_platform.data.jsonl import jsonl_files  # noqa: E402
from raytrain_platform.data.packing import joined  # noqa: E402
from raytrain_platform.data.sources import (SourceSpec, describe, iter_source, split_key, split_keys,  # noqa: E402
                                            split_mask, token_pieces, token_windows)
from raytrain_platform.data.specs import TokenSpec  # noqa: E402
from raytrain_platform.errors import ConfigError, DataError  # noqa: E402
from raytrain_platform.tools import tiny_llm  # noqa: E402

SEQ_LEN = 65
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    return tiny_llm.make_all(tmp_path_factory.mktemp("tiny"), samples=300)


def spec_for(tiny, fmt: str, **kw) -> SourceSpec:
    """A jsonl source over the tiny data (`fmt`'s file), its datasets under the module's folder."""
    args = dict(kind="jsonl", task="lm", path=str(tiny[fmt]), format=fmt, tokenizer=str(tiny["tokenizer"]),
                seq_len=SEQ_LEN, val_fraction=0.2, cache_root=str(tiny["tokenizer"].parent / "datasets"))
    return SourceSpec(**{**args, **kw})


def ready(spec: SourceSpec) -> SourceSpec:
    """`spec` with its tokenized dataset (written in this process where no pass has)."""
    return dataclasses.replace(spec, prepared=describe(spec, on_ray=False).prepared)


def windows(spec: SourceSpec, split: str) -> dict[str, np.ndarray]:
    """The whole `split`, all pieces, as one batch."""
    return joined(iter_source(ready(spec), split), spec.seq_len, spec.packing)


def piece_windows(spec: SourceSpec, split: str) -> list[dict[str, np.ndarray]]:
    """Each piece's `split` windows (the pieces that have some), in order."""
    spec = ready(spec)
    return [joined(token_windows(p, spec, split, rows=1 << 20), spec.seq_len, spec.packing)
            for p in token_pieces(spec, split)]


def counts(spec: SourceSpec) -> tuple[int, int]:
    info = describe(spec, on_ray=False)
    return info.num_train, info.num_val


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(path: Path, val_fraction: float = 0.2) -> list[dict]:
    """The file's training records (a top-level file of data.path: named by its own name)."""
    rows = records(path)
    keys = split_keys(split_key(str(path), str(path)), np.arange(len(rows)))
    return [r for r, keep in zip(rows, split_mask(keys, val_fraction, "train")) if keep]


def write(path: Path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def three_text_groups(tiny, folder: Path) -> list[tuple[str, ...]]:
    """The tiny text records dealt into 3 text files under `folder`, one group each."""
    for i in range(3):
        write(folder / f"{i}.txt", [json.loads(line)["text"] for line in tiny["text"].read_text().splitlines()[i::3]])
    return text_groups.text_groups([(str(p), p.stat().st_size) for p in sorted(folder.iterdir())], group_bytes=1)


def refusing_tokenizer(tiny, tok_dir: Path) -> Path:
    """A copy of the tiny tokenizer whose chat template refuses (raise_exception) a
    conversation with FORBIDDEN in a message (`forbidden`)."""
    shutil.copytree(tiny["tokenizer"], tok_dir)
    template = tok_dir / "chat_template.jinja"
    template.write_text("{% for m in messages %}{% if 'FORBIDDEN' in m['content'] %}"
                        "{{ raise_exception('no FORBIDDEN here') }}{% endif %}{% endfor %}" + template.read_text())
    return tok_dir


def forbidden(chat_line: str) -> str:
    """A chat JSONL line whose first message `refusing_tokenizer`'s template refuses."""
    return chat_line.replace('"content": "', '"content": "FORBIDDEN ', 1)


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------- tiny LLM artifacts


def test_tokenizer_loads_with_chat_template(tiny, tok, tmp_path):
    assert tok.eos_token == EOS and tok.pad_token == EOS and len(tok) == 512
    messages = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n")
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    text = "def f(x):\n    return x  # ünïcode"
    assert tok.decode(tok(text)["input_ids"]) == text
    tiny_llm.make_tokenizer(tmp_path)  # deterministic: same stdlib, same tokenizer
    assert (tmp_path / "tokenizer.json").read_bytes() == (tiny["tokenizer"] / "tokenizer.json").read_bytes()


def test_model_loads_and_predicts(tiny, tok):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(tiny["model"]), local_files_only=True)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.num_key_value_heads < cfg.num_attention_heads
    assert not cfg.tie_word_embeddings and cfg.vocab_size == len(tok)
    ids = torch.tensor([tok("import os")["input_ids"][:3]] * 2)
    with torch.no_grad():
        assert model(ids).logits.shape == (2, ids.shape[1], len(tok))
    gen = GenerationConfig.from_pretrained(str(tiny["model"]), local_files_only=True)
    assert gen.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]


def test_sharded_save_has_index_and_same_weights(tiny, tok, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tiny_llm.make_model(tmp_path, vocab_size=len(tok), max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).state_dict()
    whole = AutoModelForCausalLM.from_pretrained(str(tiny["model"]), local_files_only=True).state_dict()
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures(arch, tmp_path):
    from transformers import AutoConfig

    tiny_llm.make_model(tmp_path, arch=arch, vocab_size=300, num_layers=1)
    cfg = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    assert (cfg.model_type, cfg.num_key_value_heads, cfg.num_hidden_layers) == (arch, 2, 1)


def test_instruction_data_is_real_docstrings(tiny):
    chat, pc, text = (records(tiny[k]) for k in ("chat", "prompt_completion", "text"))
    assert len(chat) == len(pc) == len(text) == 300
    first = chat[0]["messages"]
    assert first[0]["content"].startswith("What does `") and first[1]["role"] == "assistant"
    assert pc[0] == {"prompt": first[0]["content"] + "\n", "completion": first[1]["content"]}
    assert text[0] == {"text": first[1]["content"]}
    assert len({r["messages"][0]["content"] for r in chat}) > 250  # mostly distinct questions


def test_cli_rejects_bad_args_in_one_line(capsys, tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit) as exc:
        tiny_llm.main([out, "--arch", "gpt2"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert tiny_llm.main([out, "--heads", "3"]) == 2  # 64 is not divisible by 3
    err = capsys.readouterr().err.strip()
    assert "--heads = 3" in err and len(err.splitlines()) == 1
    assert tiny_llm.main([out, "--samples", "10000000"]) == 2  # more than the stdlib's docstrings
    err = capsys.readouterr().err.strip()
    assert "samples = 10000000" in err and "at most" in err and len(err.splitlines()) == 1
    assert not os.path.exists(out)  # checked before anything is written


# ---------------------------------------------------------------- windows


def rendered(record: dict, fmt: str, tok) -> str:
    if fmt == "text":
        return record["text"]
    if fmt == "prompt_completion":
        return record["prompt"] + record["completion"]
    return tok.apply_chat_template(record["messages"], tokenize=False)


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "chat"])
def test_windows_pack_documents_in_order(tiny, tok, fmt):
    train = windows(spec_for(tiny, fmt), "train")
    assert train["tokens"].dtype == np.int32 and train["loss_mask"].dtype == np.uint8
    assert train["sample_id"].dtype == np.int64
    n = train["tokens"].shape[0]
    assert n > 10 and train["tokens"].shape == train["loss_mask"].shape == (n, SEQ_LEN)
    # Concatenated, the windows are the train documents in file order, EOS after each.
    flat = train["tokens"].ravel()
    ends = np.flatnonzero(flat == tok.eos_token_id)
    assert len(ends) > 20
    docs = np.split(flat, ends + 1)[: len(ends)]
    expected = [rendered(r, fmt, tok) for r in train_records(tiny[fmt])[: len(ends)]]
    assert [tok.decode(d[:-1]) for d in docs] == expected


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_windows_ids_split_and_counts(tiny, fmt):
    spec = spec_for(tiny, fmt)
    train, val = (windows(spec, s) for s in ("train", "val"))
    ids = np.concatenate([train["sample_id"], val["sample_id"]])
    assert len(np.unique(ids)) == len(ids) and set(ids >> 32) == {0}
    assert not set(train["sample_id"]) & set(val["sample_id"])
    assert 0.1 < len(val["sample_id"]) / len(ids) < 0.3  # val_fraction 0.2
    assert counts(spec) == (len(train["sample_id"]), len(val["sample_id"]))
    none = windows(spec_for(tiny, fmt, val_fraction=0.0), "val")
    assert none["tokens"].shape == (0, SEQ_LEN)


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_windows_read_in_chunks_of_the_same_windows(tiny, fmt):
    """A read task reads `rows` windows at a time: any chunk size, the same windows."""
    spec = ready(spec_for(tiny, fmt))
    for split in ("train", "val"):
        whole = windows(spec, split)
        for rows in (1, 7, 10_000):
            chunks = list(token_windows(0, spec, split, rows=rows))
            sizes = [len(c["sample_id"]) for c in chunks]
            assert sizes[:-1] == [rows] * (len(sizes) - 1) and 0 < sizes[-1] <= rows
            for key in whole:
                assert np.array_equal(np.concatenate([c[key] for c in chunks]), whole[key]), (split, rows, key)


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "chat"])
@pytest.mark.parametrize("packing", ["concat", "documents"])
def test_any_block_size_gives_the_same_windows(tiny, monkeypatch, fmt, packing):
    """A file is tokenized in byte ranges side by side: however small the ranges (lines
    longer than a range, ranges that own no line), the windows are the same as in one."""
    from raytrain_platform.data import jsonl

    spec = spec_for(tiny, fmt, packing=packing)
    whole = {s: windows(spec, s) for s in ("train", "val")}
    for block in (997, 64):
        monkeypatch.setattr(jsonl, "BLOCK_BYTES", block)
        again = spec_for(tiny, fmt, packing=packing, cache_root=str(tiny["tokenizer"].parent / f"blocks-{block}"))
        for split in ("train", "val"):
            got = windows(again, split)
            assert all(np.array_equal(got[k], whole[split][k]) for k in whole[split]), (block, split)


def test_prompt_completion_mask_is_the_completion(tiny, tok):
    first = windows(spec_for(tiny, "prompt_completion"), "train")
    tokens, mask = first["tokens"][0], first["loss_mask"][0]
    end = int(np.flatnonzero(tokens == tok.eos_token_id)[0]) + 1  # first document
    record = train_records(tiny["prompt_completion"])[0]
    assert tok.decode(tokens[:end][mask[:end] == 1]) == record["completion"] + EOS
    assert tok.decode(tokens[:end][mask[:end] == 0]) == record["prompt"]


def test_chat_mask_is_exactly_the_assistant_turns(tiny, tok):
    spec = spec_for(tiny, "chat")
    first = windows(spec, "train")
    tokens, mask = first["tokens"][0], first["loss_mask"][0]
    end = int(np.flatnonzero(tokens == tok.eos_token_id)[0]) + 1
    user, assistant = train_records(tiny["chat"])[0]["messages"]
    trained = tok.decode(tokens[:end][mask[:end] == 1])
    assert trained == assistant["content"] + "<|im_end|>\n"  # the turn and its end marker
    assert user["content"] not in trained
    # Several turns: each assistant turn is in, nothing else, and EOS is not a target.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Sum?"},
                {"role": "assistant", "content": " 1 + 2 = 3"}]
    ids, m = encode_record(tok, {"messages": messages}, spec.token_spec())
    assert len(ids) == len(m) and ids[-1] == tok.eos_token_id and m[-1] == 0
    picked = [i for i, keep in zip(ids, m) if keep]
    assert tok.decode(picked) == "Hello!<|im_end|>\n 1 + 2 = 3<|im_end|>\n"


def test_text_mask_covers_everything(tiny, tok):
    ids, mask = encode_record(tok, {"text": "hello world"}, spec_for(tiny, "text").token_spec())
    assert tok.decode(ids) == "hello world" + EOS and mask == [1] * len(ids)


# ---------------------------------------------------------------- files and errors


def test_a_record_keeps_its_split_when_files_are_added_to_the_folder(tiny, tmp_path):
    """The split hashes a record's file's path under data.path and its line, so
    b.jsonl's windows of each split stay the same when a.jsonl sorts ahead of it (their
    ids name the file's new index)."""
    rows = records(tiny["chat"])
    write(tmp_path / "d" / "b.jsonl", [json.dumps(r) for r in rows[:150]])
    spec = spec_for(tiny, "chat", path=str(tmp_path / "d"), cache_root=str(tmp_path / "cache"))
    before = {split: piece_windows(spec, split) for split in ("train", "val")}
    write(tmp_path / "d" / "a.jsonl", [json.dumps(r) for r in rows[150:200]])
    after = {split: piece_windows(spec, split) for split in ("train", "val")}
    for split in ("train", "val"):
        (was,), (_, now) = before[split], after[split]
        assert was["tokens"].shape[0] > 0, split
        np.testing.assert_array_equal(now["tokens"], was["tokens"])
        np.testing.assert_array_equal(now["sample_id"], was["sample_id"] | (1 << 32))


def test_folder_sorted_recursive_and_file_uri(tiny, tok, tmp_path):
    rows = records(tiny["text"])
    for name, part in (("b.jsonl", rows[100:200]), ("a.jsonl", rows[:100]),
                       ("sub/c.jsonl", rows[200:])):
        write(tmp_path / "d" / name, [json.dumps(r) for r in part])
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    folder = tmp_path / "d"
    assert jsonl_files(str(folder)) == [str(folder / n) for n in ("a.jsonl", "b.jsonl", "sub/c.jsonl")]
    batches = piece_windows(spec_for(tiny, "text", path=str(folder)), "train")
    assert [set(b["sample_id"] >> 32) for b in batches] == [{0}, {1}, {2}]
    first_doc = batches[0]["tokens"].ravel()
    end = int(np.flatnonzero(first_doc == tok.eos_token_id)[0])
    assert tok.decode(first_doc[:end]) == train_records(folder / "a.jsonl")[0]["text"]
    uri_files = jsonl_files(folder.as_uri())
    assert uri_files == [(folder / n).as_uri() for n in ("a.jsonl", "b.jsonl", "sub/c.jsonl")]
    via_uri = piece_windows(spec_for(tiny, "text", path=folder.as_uri()), "train")
    assert all(np.array_equal(u["tokens"], b["tokens"]) for u, b in zip(via_uri, batches))


def test_a_folder_uri_keeps_its_query_after_each_file_path(tiny, tmp_path):
    """``s3://bucket/dir?endpoint_override=...`` became ``...?endpoint_override=.../a.jsonl``
    for each file. pyarrow takes (and ignores) a query on a ``file://`` URI."""
    rows = records(tiny["text"])
    write(tmp_path / "a.jsonl", [json.dumps(r) for r in rows[:100]])
    write(tmp_path / "sub" / "b.jsonl", [json.dumps(r) for r in rows[100:]])
    uri = tmp_path.as_uri() + "/?unused=1"
    assert jsonl_files(uri) == [(tmp_path / n).as_uri() + "?unused=1" for n in ("a.jsonl", "sub/b.jsonl")]
    local = windows(spec_for(tiny, "text", path=str(tmp_path)), "train")
    assert np.array_equal(windows(spec_for(tiny, "text", path=uri), "train")["tokens"], local["tokens"])


def test_missing_or_empty_paths(tiny, tmp_path):
    with pytest.raises(DataError, match="no such file or folder") as exc:
        jsonl_files(str(tmp_path / "nope"))
    assert "nope" in one_line(exc)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no .jsonl files"):
        jsonl_files(str(tmp_path / "empty"))
    (tmp_path / "zero.jsonl").write_text("")
    with pytest.raises(DataError, match="zero.jsonl.*empty"):
        jsonl_files(str(tmp_path / "zero.jsonl"))
    short = write(tmp_path / "short.jsonl", ['{"text": "hi"}'])
    with pytest.raises(DataError, match="no training window"):
        counts(spec_for(tiny, "text", path=short))


def test_a_tokenizer_changed_in_place_is_loaded_again(tiny, tmp_path):
    """A long-lived process (a notebook) that edits the chat template tokenizes with the
    new template."""
    tok_dir = tmp_path / "tok"
    shutil.copytree(tiny["tokenizer"], tok_dir)
    before = load_tokenizer(str(tok_dir), need_chat_template=True)
    assert load_tokenizer(str(tok_dir), need_chat_template=True) is before  # loaded once
    template = tok_dir / "chat_template.jinja"
    template.write_text("{{ bos_token }}" + template.read_text())
    after = load_tokenizer(str(tok_dir), need_chat_template=True)
    assert after is not before and after.chat_template.startswith("{{ bos_token }}")


BAD_LINES = [
    ("text", ['{"text": "ok"}', "", "{not json"], 3, "not valid JSON"),
    ("text", ['{"text": "ok"}', '{"txt": "oops"}'], 2, "expected a string field 'text'.*missing"),
    ("text", ['["a list"]'], 1, "expected a JSON object, got list"),
    ("prompt_completion", ['{"prompt": "q", "completion": 3}'], 1, "'completion'.*got int"),
    ("chat", ['{"messages": [{"role": "user", "content": "q"}]}'], 1, "role 'assistant'"),
    ("chat", ['{"messages": []}'], 1, "non-empty list"),
    ("chat", ['{"messages": [{"role": "assistant"}]}'], 1, "message 0"),
]


@pytest.mark.parametrize("fmt,lines,line_no,match", BAD_LINES)
def test_bad_records_name_file_and_line(tiny, tmp_path, fmt, lines, line_no, match):
    path = write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=match) as exc:
        counts(spec_for(tiny, fmt, path=path, cache_root=str(tmp_path / "cache")))
    assert one_line(exc).startswith(f"{path}:{line_no}: ")
    assert not list((tmp_path / "cache").glob("*/manifest.json"))  # nothing written as a dataset


@pytest.mark.parametrize("fmt,line,field", [
    ("text", r'{"text": "bad \ud800 x"}', "field 'text'"),
    ("prompt_completion", r'{"prompt": "q", "completion": "bad \udc00"}', "field 'completion'"),
    ("chat", r'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a \ud800"}]}',
     "'messages' message 1 'content'"),
], ids=["text", "prompt_completion", "chat"])
def test_a_lone_surrogate_is_named_by_its_line(tiny, tmp_path, fmt, line, field):
    """Valid JSON, but the tokenizer raised `TypeError: TextEncodeInput must be ...`,
    naming no file or line."""
    path = write(tmp_path / "bad.jsonl", [json.dumps(records(tiny[fmt])[0]), line])
    with pytest.raises(DataError) as exc:
        counts(spec_for(tiny, fmt, path=path))
    assert one_line(exc).startswith(f"{path}:2: {field}: a lone surrogate "), one_line(exc)


def test_a_bad_line_in_a_later_block_or_file_is_named_by_its_line(tiny, tmp_path, monkeypatch):
    """A file is tokenized in byte ranges that do not know the lines before them: the
    pass adds them, so a bad line in a later range is named by its line in the file."""
    from raytrain_platform.data import jsonl

    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 2048)  # the chat file: some 30 ranges
    lines = tiny["chat"].read_text().splitlines()
    folder = tmp_path / "two"
    write(folder / "a.jsonl", lines)
    write(folder / "b.jsonl", lines[:250] + ["{not json"] + lines[251:])
    with pytest.raises(DataError, match="not valid JSON") as exc:
        counts(spec_for(tiny, "chat", path=str(folder)))
    assert one_line(exc).startswith(f"{folder / 'b.jsonl'}:251: ")


def test_tokenizer_errors(tiny, tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer") as exc:
        load_tokenizer(str(tmp_path / "missing"), need_chat_template=False)
    assert "missing" in one_line(exc)
    (tmp_path / "no_files").mkdir()
    with pytest.raises(ConfigError, match="tokenizer files"):
        load_tokenizer(str(tmp_path / "no_files"), need_chat_template=False)
    plain = tmp_path / "plain"  # the same tokenizer without its chat template
    plain.mkdir()
    shutil.copy(tiny["tokenizer"] / "tokenizer.json", plain)
    config = json.loads((tiny["tokenizer"] / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(str(plain), need_chat_template=False).eos_token == EOS
    with pytest.raises(ConfigError, match="chat_template for data.format chat") as exc:
        windows(spec_for(tiny, "chat", tokenizer=str(plain)), "train")
    one_line(exc)


def test_check_fits(tiny):
    spec = spec_for(tiny, "text", seq_len=257).token_spec()
    check_fits(spec, vocab_size=512, max_positions=256)  # exactly fits
    check_fits(spec, vocab_size=None, max_positions=None)
    with pytest.raises(ConfigError, match="data.tokenizer.*vocab_size 500.*has 512") as exc:
        check_fits(spec, vocab_size=500, max_positions=256)
    one_line(exc)
    with pytest.raises(ConfigError, match="data.seq_len = 258") as exc:
        check_fits(spec_for(tiny, "text", seq_len=258).token_spec(), vocab_size=512, max_positions=256)
    one_line(exc)


def test_spec_rejects_bad_values(tiny):
    with pytest.raises(ConfigError, match="data.format = 'csv'"):
        TokenSpec(path="d", format="csv", tokenizer="t", seq_len=65, val_fraction=0.1)
    with pytest.raises(ConfigError, match="data.seq_len"):
        TokenSpec(path="d", format="text", tokenizer="t", seq_len=1, val_fraction=0.1)


# ---------------------------------------------------------------- tokenizing in batches and ranges


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "chat"])
def test_documents_tokenized_together_get_each_their_own_tokens(tiny, tok, monkeypatch, fmt):
    """The tokenizer is called for many documents at once (`ENCODE_BATCH`, `ENCODE_CHARS`):
    each gets the ids and mask it gets alone (`encode_record`), in line order, at any
    batch size."""
    from raytrain_platform.data import encode
    from raytrain_platform.data.pieces import Block, Piece, tokenize_block

    spec = spec_for(tiny, fmt).token_spec()
    rows = records(tiny[fmt])
    alone = [encode_record(tok, r, spec) for r in rows]

    def ids(text: str) -> list[int]:  # the tokenizer called for one text
        return tok(text, add_special_tokens=False)["input_ids"]

    eos = [tok.eos_token_id]
    for (got, mask), r in zip(alone, rows):  # encode_record: each text tokenized alone
        if fmt == "text":
            assert (got, mask) == (ids(r["text"]) + eos, [1] * (len(got)))
        elif fmt == "prompt_completion":
            n = len(ids(r["prompt"]))
            assert (got, mask) == (ids(r["prompt"]) + ids(r["completion"]) + eos, [0] * n + [1] * (len(got) - n))
        else:
            assert got == ids(tok.apply_chat_template(r["messages"], tokenize=False)) + eos
    size = tiny[fmt].stat().st_size
    piece = Piece(0, "jsonl", (str(tiny[fmt]),), size)
    for batch, chars in ((64, 1 << 20), (7, 1 << 20), (64, 500), (1, 1 << 20)):
        monkeypatch.setattr(encode, "ENCODE_BATCH", batch)
        monkeypatch.setattr(encode, "ENCODE_CHARS", chars)
        t = tokenize_block(piece, Block(0, 0, 0, size), spec)
        assert t.ids.tolist() == [i for d, _ in alone for i in d], (batch, chars)
        assert t.mask.tolist() == [i for _, m in alone for i in m], (batch, chars)
        assert t.lengths.tolist() == [len(d) for d, _ in alone] and t.lines_of.tolist() == list(range(len(rows)))


def test_text_files_tokenized_together_get_each_their_own_tokens(tiny, tok, tmp_path, monkeypatch):
    """A text group's files are tokenized several at a time: each file one document, with
    the ids it gets alone."""
    from raytrain_platform.data import encode

    texts = [r["text"] for r in records(tiny["text"])[:40]]
    for i, text in enumerate(texts):
        write(tmp_path / f"{i:03d}.txt", [text])
    paths = tuple(str(p) for p in sorted(tmp_path.iterdir()))
    alone = [encode.text_documents(tok, [t + "\n"])[0] for t in texts]
    for batch, chars in ((64, 1 << 20), (64, 300), (1, 1 << 20)):
        monkeypatch.setattr(encode, "ENCODE_BATCH", batch)
        monkeypatch.setattr(encode, "ENCODE_CHARS", chars)
        spec = spec_for(tiny, "text", path=str(tmp_path)).token_spec()
        assert list(text_groups.group_documents(paths, spec)) == alone


def test_a_conversation_the_template_cannot_render_is_named_by_its_line(tiny, tmp_path, monkeypatch):
    from raytrain_platform.data import encode

    tok_dir = refusing_tokenizer(tiny, tmp_path / "tok")
    lines = tiny["chat"].read_text().splitlines()
    lines[69] = forbidden(lines[69])
    path = write(tmp_path / "chat.jsonl", lines)
    monkeypatch.setattr(encode, "ENCODE_BATCH", 16)  # the 70th line is in the 5th batch
    with pytest.raises(DataError, match="chat template cannot render.*no FORBIDDEN here") as exc:
        counts(spec_for(tiny, "chat", path=path, tokenizer=str(tok_dir)))
    assert one_line(exc).startswith(f"{path}:70: ")


def test_a_file_is_read_in_ranges_of_whole_lines(tmp_path):
    """`read_lines`: each range owns the lines that start in it, whole; the ranges'
    lines are the file's, each once, for blank lines, a missing last newline, an empty
    file and lines longer than a range."""
    from raytrain_platform.data import jsonl

    rng = np.random.default_rng(0)
    cases = [b"", b"\n", b"a", b"a\n", b"a\nbb\n\nc", b"x" * 50 + b"\ny\n"]
    cases += [rng.choice(list(b"ab\n"), size=int(rng.integers(1, 60))).astype(np.uint8).tobytes()
              for _ in range(200)]
    for k, data in enumerate(cases):
        path = tmp_path / f"{k}.jsonl"
        path.write_bytes(data)
        for block_bytes in (1, 2, 3, 7, 64):
            parts = [jsonl.read_lines(str(path), o, n) for o, n in jsonl.byte_ranges(len(data), block_bytes)]
            assert b"".join(parts) == data, (data, block_bytes)
            owned = [p for p in parts if p]
            assert all(p.endswith(b"\n") for p in owned[:-1]), (data, block_bytes)
            assert all(p.count(b"\n") <= 1 or block_bytes > 1 for p in owned), (data, block_bytes)
    with pytest.raises(DataError, match="cannot be read") as exc:
        jsonl.read_lines(str(tmp_path), 0, 8)  # a folder
    one_line(exc)
