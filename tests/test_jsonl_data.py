"""JSONL instruction data and tokenized text (`data/jsonl.py`, `data/text_groups.py`,
`data/pieces.py`) and the offline tiny LLM maker
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

from raytrain_platform.data import pieces, text_groups, token_cache  # noqa: E402
from raytrain_platform.data.jsonl import (  # noqa: E402
    JsonlSpec, check_fits, encode_record, iter_windows, jsonl_files, jsonl_windows, load_tokenizer,
    stream_jsonl_windows)
from raytrain_platform.data.pieces import count_windows  # noqa: E402
from raytrain_platform.data.sources import split_key, split_keys, split_mask  # noqa: E402
from raytrain_platform.errors import ConfigError, DataError, describe_error  # noqa: E402
from raytrain_platform.tools import tiny_llm  # noqa: E402

SEQ_LEN = 65
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    return tiny_llm.make_all(tmp_path_factory.mktemp("tiny"), samples=300)


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny["tokenizer"]), local_files_only=True)


def spec_for(tiny, fmt: str, **kw) -> JsonlSpec:
    args = dict(path=str(tiny[fmt]), format=fmt, tokenizer=str(tiny["tokenizer"]),
                seq_len=SEQ_LEN, val_fraction=0.2)
    return JsonlSpec(**{**args, **kw})


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


def own_copies(tiny, tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path, JsonlSpec]:
    """A token cache, and copies of the chat data and tokenizer a test may change: the
    cache folder, the data file, the tokenizer folder and the chat spec over them."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("RTP_CACHE_DIR", str(cache))
    data = tmp_path / "chat.jsonl"
    shutil.copy(tiny["chat"], data)
    tok_dir = tmp_path / "tok"
    shutil.copytree(tiny["tokenizer"], tok_dir)
    return cache, data, tok_dir, spec_for(tiny, "chat", path=str(data), tokenizer=str(tok_dir))


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
    spec = spec_for(tiny, fmt)
    (path,) = jsonl_files(spec)
    train = jsonl_windows(0, path, spec, "train")
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
def test_windows_ids_split_and_determinism(tiny, fmt):
    spec = spec_for(tiny, fmt)
    (path,) = jsonl_files(spec)
    train, val = (jsonl_windows(3, path, spec, s) for s in ("train", "val"))
    ids = np.concatenate([train["sample_id"], val["sample_id"]])
    assert len(np.unique(ids)) == len(ids) and set(ids >> 32) == {3}
    assert not set(train["sample_id"]) & set(val["sample_id"])
    assert 0.1 < len(val["sample_id"]) / len(ids) < 0.3  # val_fraction 0.2
    again = jsonl_windows(3, path, spec, "train")
    assert all(np.array_equal(train[k], again[k]) for k in train)
    # The split hashes the file index too: count what file 0 holds.
    counts = [len(jsonl_windows(0, path, spec, s)["sample_id"]) for s in ("train", "val")]
    assert count_windows(spec) == tuple(counts)
    none = jsonl_windows(0, path, spec_for(tiny, fmt, val_fraction=0.0), "val")
    assert none["tokens"].shape == (0, SEQ_LEN)


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_windows_stream_in_chunks_of_the_same_windows(tiny, fmt):
    """A read task yields `rows` windows at a time: any chunk size, the same windows."""
    spec = spec_for(tiny, fmt)
    (path,) = jsonl_files(spec)
    for split in ("train", "val"):
        whole = jsonl_windows(0, path, spec, split)
        for rows in (1, 7, 10_000):
            chunks = list(stream_jsonl_windows(0, path, spec, split, rows=rows))
            sizes = [len(c["sample_id"]) for c in chunks]
            assert sizes[:-1] == [rows] * (len(sizes) - 1) and 0 < sizes[-1] <= rows
            for key in whole:
                joined = np.concatenate([c[key] for c in chunks])
                assert np.array_equal(joined, whole[key]), (split, rows, key)


def test_windows_stream_before_the_whole_file_is_read(tiny, tmp_path):
    """The first chunk comes before the file's last line is parsed: a bad last line
    fails the stream only when it is reached, naming the file and line."""
    lines = tiny["text"].read_text().splitlines() + ["{not json"]
    path = write(tmp_path / "late.jsonl", lines)
    stream = stream_jsonl_windows(0, path, spec_for(tiny, "text", path=path), "train", rows=4)
    assert next(stream)["tokens"].shape == (4, SEQ_LEN)
    with pytest.raises(DataError, match="not valid JSON") as exc:
        list(stream)
    assert one_line(exc).startswith(f"{path}:{len(lines)}: ")


def test_prompt_completion_mask_is_the_completion(tiny, tok):
    spec = spec_for(tiny, "prompt_completion")
    first = jsonl_windows(0, jsonl_files(spec)[0], spec, "train")
    tokens, mask = first["tokens"][0], first["loss_mask"][0]
    end = int(np.flatnonzero(tokens == tok.eos_token_id)[0]) + 1  # first document
    record = train_records(tiny["prompt_completion"])[0]
    assert tok.decode(tokens[:end][mask[:end] == 1]) == record["completion"] + EOS
    assert tok.decode(tokens[:end][mask[:end] == 0]) == record["prompt"]


def test_chat_mask_is_exactly_the_assistant_turns(tiny, tok):
    spec = spec_for(tiny, "chat")
    first = jsonl_windows(0, jsonl_files(spec)[0], spec, "train")
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
    ids, m = encode_record(tok, {"messages": messages}, spec)
    assert len(ids) == len(m) and ids[-1] == tok.eos_token_id and m[-1] == 0
    picked = [i for i, keep in zip(ids, m) if keep]
    assert tok.decode(picked) == "Hello!<|im_end|>\n 1 + 2 = 3<|im_end|>\n"


def test_text_mask_covers_everything(tiny, tok):
    spec = spec_for(tiny, "text")
    ids, mask = encode_record(tok, {"text": "hello world"}, spec)
    assert tok.decode(ids) == "hello world" + EOS and mask == [1] * len(ids)


# ---------------------------------------------------------------- files and errors


def test_a_record_keeps_its_split_when_files_are_added_to_the_folder(tiny, tmp_path):
    """The split hashed a record's file index: a file sorting ahead of another moved
    that file's records between train and validation. Now it hashes the file's path
    under data.path and the line, so b.jsonl's windows of each split stay the same
    (their ids name the file's new index)."""
    rows = records(tiny["chat"])
    write(tmp_path / "d" / "b.jsonl", [json.dumps(r) for r in rows[:150]])
    spec = spec_for(tiny, "chat", path=str(tmp_path / "d"))
    before = {split: list(iter_windows(spec, split)) for split in ("train", "val")}
    write(tmp_path / "d" / "a.jsonl", [json.dumps(r) for r in rows[150:200]])
    after = {split: list(iter_windows(spec, split)) for split in ("train", "val")}
    for split in ("train", "val"):
        (was,), (_, now) = before[split], after[split]
        assert was["tokens"].shape[0] > 0, split
        np.testing.assert_array_equal(now["tokens"], was["tokens"])
        np.testing.assert_array_equal(now["sample_id"], was["sample_id"] | (1 << 32))


def test_folder_sorted_recursive_and_file_uri(tiny, tok, tmp_path):
    rows = records(tiny["text"])
    for name, part in (("b.jsonl", rows[100:200]), ("a.jsonl", rows[:100]),
                       ("sub/c.jsonl", rows[200:])):
        write(tmp_path / name, [json.dumps(r) for r in part])
    (tmp_path / "notes.txt").write_text("ignored")
    spec = spec_for(tiny, "text", path=str(tmp_path))
    files = jsonl_files(spec)
    assert files == [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "sub/c.jsonl")]
    batches = list(iter_windows(spec, "train"))
    assert [set(b["sample_id"] >> 32) for b in batches] == [{0}, {1}, {2}]
    first_doc = batches[0]["tokens"].ravel()
    end = int(np.flatnonzero(first_doc == tok.eos_token_id)[0])
    assert tok.decode(first_doc[:end]) == train_records(tmp_path / "a.jsonl")[0]["text"]
    uri_spec = spec_for(tiny, "text", path=tmp_path.as_uri())
    uri_files = jsonl_files(uri_spec)
    assert uri_files == [(tmp_path / n).as_uri() for n in ("a.jsonl", "b.jsonl", "sub/c.jsonl")]
    via_uri = jsonl_windows(1, uri_files[1], uri_spec, "train")
    assert np.array_equal(via_uri["tokens"], batches[1]["tokens"])


def test_a_folder_uri_keeps_its_query_after_each_file_path(tiny, tmp_path):
    """``s3://bucket/dir?endpoint_override=...`` became ``...?endpoint_override=.../a.jsonl``
    for each file. pyarrow takes (and ignores) a query on a ``file://`` URI."""
    rows = records(tiny["text"])
    write(tmp_path / "a.jsonl", [json.dumps(r) for r in rows[:100]])
    write(tmp_path / "sub" / "b.jsonl", [json.dumps(r) for r in rows[100:]])
    spec = spec_for(tiny, "text", path=tmp_path.as_uri() + "/?unused=1")
    files = jsonl_files(spec)
    assert files == [(tmp_path / n).as_uri() + "?unused=1" for n in ("a.jsonl", "sub/b.jsonl")]
    local = jsonl_windows(1, str(tmp_path / "sub" / "b.jsonl"), spec_for(tiny, "text", path=str(tmp_path)), "train")
    assert np.array_equal(jsonl_windows(1, files[1], spec, "train")["tokens"], local["tokens"])


def test_missing_or_empty_paths(tiny, tmp_path):
    with pytest.raises(DataError, match="no such file or folder") as exc:
        jsonl_files(spec_for(tiny, "text", path=str(tmp_path / "nope")))
    assert "nope" in one_line(exc)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no .jsonl files"):
        jsonl_files(spec_for(tiny, "text", path=str(tmp_path / "empty")))
    (tmp_path / "zero.jsonl").write_text("")
    with pytest.raises(DataError, match="zero.jsonl.*empty"):
        jsonl_files(spec_for(tiny, "text", path=str(tmp_path / "zero.jsonl")))
    short = write(tmp_path / "short.jsonl", ['{"text": "hi"}'])
    with pytest.raises(DataError, match="no training window"):
        count_windows(spec_for(tiny, "text", path=short))


def test_counts_are_cached_per_file_tokenizer_and_spec(tiny, tmp_path, monkeypatch):
    """The driver's count tokenizes a file once: a second count of the same file (path,
    size, modification time), tokenizer files and spec reads the token sums back, at
    any seq_len; a changed file, val_fraction or tokenizer is counted again; a broken or
    unwritable cache is no cache."""
    from raytrain_platform.data import jsonl

    cache, data, tok_dir, spec = own_copies(tiny, tmp_path, monkeypatch)
    # Sums serve any seq_len where no windows are kept for it (data.window_cache false).
    spec_128 = spec_for(tiny, "chat", path=str(data), tokenizer=str(tok_dir), seq_len=129, window_cache=False)
    monkeypatch.setenv("RTP_CACHE_DIR", "")  # the reference counts, without a cache
    counted, at_128 = count_windows(spec), count_windows(spec_128)
    assert counted != at_128
    monkeypatch.setenv("RTP_CACHE_DIR", str(cache))
    assert count_windows(spec) == counted
    entries = list((cache / "token-counts").iterdir())
    assert len(entries) == 1 and json.loads(entries[0].read_text())["key"]["files"][0][0] == str(data)

    real_documents = jsonl._documents

    def tokenizes(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(jsonl, "_documents", tokenizes)
    assert count_windows(spec) == counted  # read back
    assert count_windows(spec_128) == at_128  # the same token sums, divided by another seq_len
    kept_128 = spec_for(tiny, "chat", path=str(data), tokenizer=str(tok_dir), seq_len=129)
    with pytest.raises(AssertionError, match="tokenized again"):  # its windows are not kept yet
        count_windows(kept_128)
    monkeypatch.setattr(jsonl, "_documents", real_documents)
    assert count_windows(kept_128) == at_128  # tokenized to keep them
    monkeypatch.setattr(jsonl, "_documents", tokenizes)
    assert count_windows(kept_128) == at_128  # sums and windows held
    shutil.rmtree(cache / "token-windows")
    with pytest.raises(AssertionError, match="tokenized again"):  # sums held, windows gone
        count_windows(spec)
    for changed in (spec_for(tiny, "chat", path=str(data), tokenizer=str(tok_dir), val_fraction=0.3),
                    spec_for(tiny, "chat", path=str(tiny["chat"]), tokenizer=str(tok_dir))):
        with pytest.raises(AssertionError, match="tokenized again"):
            count_windows(changed)
    (tok_dir / "chat_template.jinja").write_text((tok_dir / "chat_template.jinja").read_text() + "\n")
    with pytest.raises(AssertionError, match="tokenized again"):
        count_windows(spec)
    shutil.copytree(tiny["tokenizer"], tok_dir, dirs_exist_ok=True)
    with data.open("a") as f:  # one more record: another size and time
        f.write(data.read_text().splitlines()[0] + "\n")
    with pytest.raises(AssertionError, match="tokenized again"):
        count_windows(spec)

    monkeypatch.setattr(jsonl, "_documents", real_documents)
    grown = count_windows(spec)
    assert grown != counted and count_windows(spec) == grown
    for broken in ("{not json", '{"tokens": [1]}', '{"tokens": [1, -2]}'):
        for entry in (cache / "token-counts").iterdir():
            entry.write_text(broken)
        assert count_windows(spec) == grown  # a broken entry: counted again, and rewritten
    monkeypatch.setenv("RTP_CACHE_DIR", str(data))  # a file, not a folder: cannot be written
    assert count_windows(spec) == grown
    monkeypatch.setenv("RTP_CACHE_DIR", "")  # off
    monkeypatch.setattr(jsonl, "_documents", tokenizes)
    with pytest.raises(AssertionError, match="tokenized again"):
        count_windows(spec)


def test_text_groups_counts_are_cached(tiny, tmp_path, monkeypatch):

    monkeypatch.setenv("RTP_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "text"
    groups = three_text_groups(tiny, folder)
    spec = spec_for(tiny, "text", path=str(folder))
    counted = pieces.count_text_windows(groups, spec)
    assert len(groups) == 3 and len(list((tmp_path / "cache" / "token-counts").iterdir())) == 3

    def tokenizes(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(text_groups, "_group_documents", tokenizes)
    assert pieces.count_text_windows(groups, spec) == counted
    (folder / "1.txt").write_text((folder / "1.txt").read_text() + "more")
    with pytest.raises(AssertionError, match="tokenized again"):
        pieces.count_text_windows(groups, spec)


# ---------------------------------------------------------------- the token cache's windows


def _piece(spec, split: str, *, index: int = 0, piece=None, text: bool = False, rows: int | None = None):
    """One read task's windows (`piece_windows`, as the read tasks call it), joined."""
    piece = piece or (jsonl_files(spec)[0],)
    chunks = list(pieces.piece_windows(index, piece, spec, split, text=text, rows=rows))
    return {k: np.concatenate([c[k] for c in chunks]) for k in ("tokens", "loss_mask", "sample_id")}, chunks


def _same(a: dict, b: dict) -> bool:
    return all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in ("tokens", "loss_mask", "sample_id"))


def _entries(cache: Path) -> list[Path]:
    """The window cache's entries and temporary folders (not the lock files)."""
    folder = cache / "token-windows"
    return sorted(p for p in folder.iterdir() if p.suffix not in (".lock", ".use")) if folder.exists() else []


def _tokenizing_fails(monkeypatch):
    from raytrain_platform.data import jsonl

    def tokenizes(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(jsonl, "_documents", tokenizes)
    monkeypatch.setattr(text_groups, "_group_documents", tokenizes)


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "chat"])
def test_the_count_keeps_the_windows_and_the_read_tasks_map_them(tiny, tmp_path, monkeypatch, fmt):
    """The driver's count tokenizes each file once and writes both splits' windows; a
    read task then maps them, never tokenizing, and gets exactly the arrays (values and
    dtypes) it tokenizes without a cache, in chunks of the size it asks for."""
    spec = spec_for(tiny, fmt)
    monkeypatch.setenv("RTP_CACHE_DIR", "")
    reference = {split: _piece(spec, split)[0] for split in ("train", "val")}
    cache = tmp_path / "cache"
    monkeypatch.setenv("RTP_CACHE_DIR", str(cache))
    assert _entries(cache) == []
    counted = count_windows(spec)
    assert len(_entries(cache)) == 2 and counted == tuple(len(reference[s]["sample_id"]) for s in ("train", "val"))
    _tokenizing_fails(monkeypatch)
    for split in ("train", "val"):
        for rows in (None, 7):
            got, chunks = _piece(spec, split, rows=rows)
            assert _same(got, reference[split]), (split, rows)
            if rows:
                assert [len(c["sample_id"]) for c in chunks[:-1]] == [rows] * (len(chunks) - 1)
            assert all(c[k].flags.owndata for c in chunks for k in c)  # copies, not views of the file



def test_the_count_writes_again_only_a_split_whose_entry_is_gone(tiny, tmp_path, monkeypatch):
    """One split's entry evicted: the count tokenizes the piece again but writes only that
    split, and a read task mapping the other meanwhile reads on."""
    from raytrain_platform.data import jsonl, window_cache

    cache_dir, data, _, spec = own_copies(tiny, tmp_path, monkeypatch)
    counted = count_windows(spec)
    cache, key = token_cache._TokenCache.open(spec), jsonl._file_key(0, str(data), spec)
    train, val = (cache._windows_entry([str(data)], key, s, SEQ_LEN)[0] for s in ("train", "val"))
    assert window_cache.remove(val)
    held = cache.windows([str(data)], key, "train", SEQ_LEN)
    opened = []
    real_writer = token_cache._TokenCache.window_writer

    def window_writer(self, paths, key, split, seq_len):
        opened.append(split)
        return real_writer(self, paths, key, split, seq_len)

    monkeypatch.setattr(token_cache._TokenCache, "window_writer", window_writer)
    assert count_windows(spec) == counted and _entries(cache_dir) == sorted([train, val])
    assert opened == ["val"]
    _tokenizing_fails(monkeypatch)
    assert _same(_piece(spec, "train")[0], dict(held))
    held.close()


def test_an_empty_split_is_kept_as_an_entry_of_no_rows(tiny, tmp_path, monkeypatch):

    spec = spec_for(tiny, "chat", val_fraction=0.0)
    monkeypatch.setenv("RTP_CACHE_DIR", "")
    reference = _piece(spec, "train")[0]
    monkeypatch.setenv("RTP_CACHE_DIR", str(tmp_path / "cache"))
    assert count_windows(spec)[1] == 0
    _tokenizing_fails(monkeypatch)
    assert list(pieces.piece_windows(0, (str(tiny["chat"]),), spec, "val", text=False)) == []
    assert _same(_piece(spec, "train")[0], reference)


def test_text_groups_windows_are_kept_per_group_and_split(tiny, tmp_path, monkeypatch):

    folder = tmp_path / "text"
    groups = three_text_groups(tiny, folder)
    spec = spec_for(tiny, "text", path=str(folder))
    monkeypatch.setenv("RTP_CACHE_DIR", "")
    reference = {(g, s): _piece(spec, s, index=g, piece=paths, text=True)[0]
                 for g, paths in enumerate(groups) for s in ("train", "val")}
    monkeypatch.setenv("RTP_CACHE_DIR", str(tmp_path / "cache"))
    pieces.count_text_windows(groups, spec)
    assert len(_entries(tmp_path / "cache")) == 6
    _tokenizing_fails(monkeypatch)
    for (g, split), ref in reference.items():
        got, chunks = _piece(spec, split, index=g, piece=groups[g], text=True, rows=5)
        assert _same(got, ref) and [len(c["sample_id"]) for c in chunks[:-1]] == [5] * (len(chunks) - 1), (g, split)


def test_windows_are_read_only_for_the_same_files_tokenizer_and_spec(tiny, tmp_path, monkeypatch):
    """Another seq_len, val_fraction or file index, a changed file or tokenizer file:
    the read task tokenizes (no entry of that key), and writes the entry once it has
    read the piece to its end, not when it stops early."""
    from raytrain_platform.data import jsonl

    cache, data, tok_dir, spec = own_copies(tiny, tmp_path, monkeypatch)
    count_windows(spec)
    real = jsonl._documents
    _tokenizing_fails(monkeypatch)
    _piece(spec, "train")  # held
    for other, index in ((spec_for(tiny, "chat", path=str(data), tokenizer=str(tok_dir), seq_len=33), 0),
                         (spec_for(tiny, "chat", path=str(data), tokenizer=str(tok_dir), val_fraction=0.3), 0),
                         (spec, 1)):
        with pytest.raises(AssertionError, match="tokenized again"):
            _piece(other, "train", index=index)
    (tok_dir / "chat_template.jinja").write_text((tok_dir / "chat_template.jinja").read_text() + "\n")
    with pytest.raises(AssertionError, match="tokenized again"):
        _piece(spec, "train")
    shutil.copytree(tiny["tokenizer"], tok_dir, dirs_exist_ok=True)
    cache_of = token_cache._TokenCache.open(spec)  # the format and every field name are in the key
    others = [spec, *(spec_for(tiny, "chat", path=str(data), tokenizer=str(tok_dir), **kw) for kw in (
        {"format": "text"}, {"text_field": "body"}, {"prompt_field": "q"}, {"completion_field": "a"},
        {"messages_field": "turns"}))]
    assert len({cache_of._windows_entry([str(data)], jsonl._file_key(0, str(data), o), "train", SEQ_LEN)[0]
                for o in others}) == len(others)
    with data.open("a") as f:  # one more record: another size and time
        f.write(data.read_text().splitlines()[0] + "\n")
    with pytest.raises(AssertionError, match="tokenized again"):
        _piece(spec, "train")

    monkeypatch.setattr(jsonl, "_documents", real)
    at_33 = spec_for(tiny, "chat", path=str(data), tokenizer=str(tok_dir), seq_len=33)
    before = _entries(cache)
    first = next(pieces.piece_windows(0, (str(data),), at_33, "train", text=False, rows=2))
    assert first["tokens"].shape == (2, 33)
    assert _entries(cache) == before  # a reader that stopped early (the generator unfinished)
    streamed = _piece(at_33, "train")[0]  # read to the end: written
    assert len(_entries(cache)) == len(before) + 1 and not list(cache.glob("token-windows/*.tmp"))
    _tokenizing_fails(monkeypatch)
    assert _same(_piece(at_33, "train", rows=3)[0], streamed)


def test_broken_unwritable_or_no_window_cache_still_reads_the_same(tiny, tmp_path, monkeypatch):
    """An entry cut short, of another key or without its meta reads as none (the piece
    is tokenized again, and the entry written anew); a cache that cannot be written, or
    none, still reads every window; a bad record leaves no entry behind."""
    from raytrain_platform.data import jsonl

    spec = spec_for(tiny, "chat")
    monkeypatch.setenv("RTP_CACHE_DIR", "")
    reference = _piece(spec, "train")[0]
    cache = tmp_path / "cache"
    monkeypatch.setenv("RTP_CACHE_DIR", str(cache))
    count_windows(spec)
    real = jsonl._documents
    breakages = {
        "cut short": lambda e: (e / "tokens.bin").write_bytes((e / "tokens.bin").read_bytes()[:-4]),
        "another key": lambda e: (e / "meta.json").write_text(
            json.dumps({**json.loads((e / "meta.json").read_text()), "key": {"other": 1}})),
        "no meta": lambda e: (e / "meta.json").unlink(),
        "rows not an integer": lambda e: (e / "meta.json").write_text(
            json.dumps({**json.loads((e / "meta.json").read_text()), "rows": "12"})),
    }
    for what, brake in breakages.items():
        for entry in _entries(cache):
            if (entry / "meta.json").exists():  # the val entry stays as the last breakage left it
                brake(entry)
        _tokenizing_fails(monkeypatch)
        with pytest.raises(AssertionError, match="tokenized again"):
            _piece(spec, "train")
        monkeypatch.setattr(jsonl, "_documents", real)
        assert _same(_piece(spec, "train")[0], reference), what  # tokenized, and written anew
        _tokenizing_fails(monkeypatch)
        assert _same(_piece(spec, "train")[0], reference), what  # read back
        monkeypatch.setattr(jsonl, "_documents", real)
    assert not list(cache.glob("token-windows/*.tmp"))

    off = spec_for(tiny, "chat", window_cache=False)  # data.window_cache: false
    monkeypatch.setenv("RTP_CACHE_DIR", str(tmp_path / "off"))
    assert count_windows(off) and _entries(tmp_path / "off") == [] and _same(_piece(off, "train")[0], reference)
    assert _entries(tmp_path / "off") == [] and (tmp_path / "off" / "token-counts").is_dir()

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("RTP_CACHE_DIR", str(blocker))  # a file, not a folder: cannot be written
    assert count_windows(spec) and _same(_piece(spec, "train")[0], reference)

    bad = write(tmp_path / "late.jsonl", tiny["chat"].read_text().splitlines() + ["{not json"])
    bad_spec = spec_for(tiny, "chat", path=bad)
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("RTP_CACHE_DIR", str(fresh))
    for attempt in (lambda: count_windows(bad_spec), lambda: _piece(bad_spec, "train")):
        with pytest.raises(DataError, match="not valid JSON"):
            attempt()
        assert _entries(fresh) == []  # nothing half-written, no temporary folder left


def test_one_writer_per_entry_a_whole_entry_kept_and_stale_leftovers_swept(tiny, tmp_path, monkeypatch):
    """Two processes keeping the same windows (torchrun ranks each counting): the second
    gets no writer while the first writes (a lock), and a whole entry already in place
    is kept; a temporary folder a killed writer left a day ago is removed by the next
    writer, a recent one (a writer at work) is not; a disk that fills up mid-write
    leaves no entry and every window still read."""
    import os
    import time

    from raytrain_platform.data import jsonl, window_cache

    spec = spec_for(tiny, "chat")
    monkeypatch.setenv("RTP_CACHE_DIR", "")
    reference = _piece(spec, "train")[0]
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("RTP_CACHE_DIR", str(cache_dir))
    cache = token_cache._TokenCache.open(spec)
    piece, key = [jsonl_files(spec)[0]], jsonl._file_key(0, jsonl_files(spec)[0], spec)
    first = cache.window_writer(piece, key, "train", SEQ_LEN)
    assert first is not None and cache.window_writer(piece, key, "train", SEQ_LEN) is None  # locked
    first.add(reference)
    first.commit()
    second = cache.window_writer(piece, key, "train", SEQ_LEN)  # the lock is free again
    second.add({k: np.zeros_like(v) for k, v in reference.items()})
    second.commit()  # the whole entry in place is kept
    assert _same(cache.windows(piece, key, "train", SEQ_LEN), reference)

    folder = cache_dir / "token-windows"
    old, recent = folder / "left-by-a-killed-writer.tmp", folder / "a-writer-at-work.tmp"
    for leftover in (old, recent):
        leftover.mkdir()
        (leftover / "tokens.bin").write_bytes(b"\0" * 8)
    day_ago = time.time() - 25 * 3600
    for path in (old / "tokens.bin", old):
        os.utime(path, (day_ago, day_ago))
    cache.window_writer(piece, key, "val", SEQ_LEN).abort()
    assert old.exists()  # a folder is swept once per process: this one was, at the first writer
    monkeypatch.setattr(window_cache, "_swept", set())  # as a new process
    cache.window_writer(piece, key, "val", SEQ_LEN).abort()
    assert not old.exists() and recent.exists()

    def full_disk(self, name, array):
        raise OSError(28, "No space left on device")

    fresh = tmp_path / "fresh"
    monkeypatch.setenv("RTP_CACHE_DIR", str(fresh))
    monkeypatch.setattr(window_cache.Writer, "_write", full_disk)
    assert count_windows(spec) and _same(_piece(spec, "train")[0], reference)
    assert _entries(fresh) == []  # nothing half-written, no temporary folder left


def _age(entry: Path, hours: float) -> None:
    """Marks a window entry last used `hours` ago (its meta file's time, as a read sets it)."""
    import time

    when = time.time() - hours * 3600
    os.utime(entry / "meta.json", (when, when))


def test_prune_evicts_the_least_recently_used_entries_first(tmp_path):
    """Entries go oldest use first until the rest fit; a read counts as a use; the
    caller's entries, those used within the hour and those being read stay even above
    the limit; an evicted entry reads as none; an entry being removed reads as none."""
    import fcntl

    from raytrain_platform.data import window_cache

    folder = tmp_path / "token-windows"
    arrays = {}
    for i, rows in enumerate((4, 3, 2, 1)):
        chunk = {"tokens": np.full((rows, 8), i, np.int32), "loss_mask": np.ones((rows, 8), np.uint8),
                 "sample_id": np.arange(rows, dtype=np.int64)}
        writer = window_cache.Writer(folder / f"e{i}", {"i": i}, 8)
        writer.add(chunk)
        writer.commit()
        arrays[i] = chunk
    size = {e.path.name: e.bytes for e in window_cache.entries(folder)}
    assert size == {f"e{i}": rows * (8 * 5 + 8) + len(json.dumps({"key": {"i": i}, "rows": rows, "seq_len": 8}))
                    for i, rows in enumerate((4, 3, 2, 1))}
    for i, hours in enumerate((5, 4, 3, 2)):
        _age(folder / f"e{i}", hours)
    window_cache.read(folder / "e0", {"i": 0}, 8).close()  # read now: e0 is the most recently used
    assert [e.path.name for e in window_cache.entries(folder)] == ["e1", "e2", "e3", "e0"]

    pruned = window_cache.prune(folder, size["e0"] + size["e3"], keep=[folder / "e2"])
    # e1 (oldest) goes; e2 is kept by the caller; e3 goes; e0 (used now) stays and the rest fit
    assert pruned == window_cache.Pruned(2, size["e1"] + size["e3"], size["e0"] + size["e2"])
    assert _entries(tmp_path) == [folder / "e0", folder / "e2"]
    assert window_cache.read(folder / "e1", {"i": 1}, 8) is None
    assert window_cache.prune(folder, 0) == window_cache.Pruned(1, size["e2"], size["e0"])  # e0: recent

    rewriting = window_cache.Writer(folder / "e0", {"i": 0}, 8)  # a writer of e0 does not stop its readers
    held = window_cache.read(folder / "e0", {"i": 0}, 8)  # a reader maps e0 and holds it
    rewriting.abort()
    assert window_cache.prune(folder, 0, recent_s=0) == window_cache.Pruned(0, 0, size["e0"])
    assert not window_cache.remove(folder / "e0") and _entries(tmp_path) == [folder / "e0"]
    assert all(np.array_equal(held[k], arrays[0][k]) for k in arrays[0])
    held.close()
    with open(folder / "e0.use", "a+") as remover:  # another process removing it: reads as none
        fcntl.flock(remover, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert window_cache.read(folder / "e0", {"i": 0}, 8) is None
    assert window_cache.prune(folder, 0, recent_s=0) == window_cache.Pruned(1, size["e0"], 0)
    assert _entries(tmp_path) == []  # nothing renamed and left behind
    assert window_cache.entries(tmp_path / "none") == [] and not window_cache.remove(folder / "e0")
    assert window_cache.read(folder / "e9", {"i": 9}, 8) is None and not (folder / "e9.use").exists()


def test_the_count_keeps_the_token_cache_within_its_limit(tiny, tmp_path, monkeypatch, capsys):
    """RTP_CACHE_MAX_SIZE: the driver's count evicts other data's windows used longest
    ago, never its own (it says so when they alone are above the limit); evicted data
    still counts the same; a read task that writes an entry keeps the cache within it
    too, leaving entries used within the day, at most once a minute; a bad value is one
    line before anything is tokenized."""
    import time

    from raytrain_platform.data import jsonl

    cache, data_a, _, spec_a = own_copies(tiny, tmp_path, monkeypatch)
    lines = data_a.read_text().splitlines(keepends=True)
    data_b, data_c = tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    data_b.write_text("".join(lines[:200]))
    data_c.write_text("".join(lines[:100]))
    spec_b, spec_c = (spec_for(tiny, "chat", path=str(d), tokenizer=spec_a.tokenizer) for d in (data_b, data_c))
    counts_a = count_windows(spec_a)
    entries_a = _entries(cache)
    assert len(entries_a) == 2
    for entry in entries_a:
        _age(entry, 2)
    monkeypatch.setenv("RTP_CACHE_DIR", str(tmp_path / "probe"))
    count_windows(spec_b)
    bytes_b = sum(f.stat().st_size for e in _entries(tmp_path / "probe") for f in e.iterdir())
    monkeypatch.setenv("RTP_CACHE_DIR", str(cache))
    monkeypatch.setenv("RTP_CACHE_MAX_SIZE", str(bytes_b))  # room for b's windows only
    capsys.readouterr()
    counts_b = count_windows(spec_b)
    entries_b = _entries(cache)
    assert len(entries_b) == 2 and not set(entries_a) & set(entries_b)  # a's evicted, b's kept
    err = capsys.readouterr().err
    assert "removed 2 window entries used longest ago" in err and "above" not in err
    real = jsonl._documents
    _tokenizing_fails(monkeypatch)
    assert count_windows(spec_b) == counts_b  # b's windows and sums read back
    monkeypatch.setattr(jsonl, "_documents", real)

    monkeypatch.setenv("RTP_CACHE_MAX_SIZE", "1B")
    assert count_windows(spec_a) == counts_a  # tokenized again to keep its windows: the same counts
    err = capsys.readouterr().err
    assert "removed" not in err and "above RTP_CACHE_MAX_SIZE = 1 B" in err  # b's are recent; a's its own
    assert len(_entries(cache)) == 4
    assert count_windows(spec_a) == counts_a  # read back: the note, and no summary of a count
    err = capsys.readouterr().err
    assert "above RTP_CACHE_MAX_SIZE = 1 B" in err and "tokenized" not in err

    for entry in _entries(cache):
        _age(entry, 30)  # a's and b's last used a day ago and more
    monkeypatch.setattr(pieces, "_last_prune", -1e9)
    _piece(spec_c, "train")  # a read task that finds no entry tokenizes, writes it, then prunes
    c_train = set(_entries(cache))
    assert len(c_train) == 1 and not c_train & set(entries_b)  # all but its own, fresh, entry evicted
    _age(next(iter(c_train)), 30)
    monkeypatch.setattr(pieces, "_last_prune", time.monotonic())
    _piece(spec_c, "val")  # within the minute: no look at the cache
    assert len(_entries(cache)) == 2
    monkeypatch.setattr(pieces, "_last_prune", -1e9)
    _piece(spec_b, "val")  # c's entries: val used now; train a day ago
    assert len(_entries(cache)) == 2 and not set(_entries(cache)) & c_train

    monkeypatch.setenv("RTP_CACHE_MAX_SIZE", "lots")
    fresh = spec_for(tiny, "chat", path=write(tmp_path / "d.jsonl", lines[:50]), tokenizer=spec_a.tokenizer)
    _tokenizing_fails(monkeypatch)
    with pytest.raises(ConfigError, match="RTP_CACHE_MAX_SIZE = 'lots': expected a size like 80GiB") as exc:
        count_windows(fresh)
    one_line(exc)


def test_cli_cache_shows_trims_and_clears(tiny, tmp_path, monkeypatch, capsys):
    from raytrain_platform.cli import main
    from raytrain_platform.data import window_cache
    from raytrain_platform.units import format_size

    cache, _, _, spec = own_copies(tiny, tmp_path, monkeypatch)
    monkeypatch.delenv("RTP_CACHE_MAX_SIZE", raising=False)
    assert main(["cache"]) == 0  # no folder yet
    assert capsys.readouterr().out.splitlines()[1] == "  windows: 0 window entries, 0 B of at most 20.0 GiB (RTP_CACHE_MAX_SIZE)"
    count_windows(spec)
    entries = _entries(cache)
    sizes = [sum(f.stat().st_size for f in e.iterdir()) for e in entries]
    capsys.readouterr()
    assert main(["cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"token cache: {cache}"
    assert out[1].startswith(f"  windows: 2 window entries, {format_size(sum(sizes))} of at most 20.0 GiB "
                             "(RTP_CACHE_MAX_SIZE); least recently used ")
    assert out[2] == "  token sums: 1 file(s)"

    for bad in (["cache", "--max-size", "-1"], ["cache", "--max-size", "1e400GB"], ["cache", "--max-size", "ten"]):
        assert main(bad) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --max-size = ") and "80GiB" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as exc:
        main(["cache", "--max-size", "1GB", "--clear"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    assert _entries(cache) == entries
    oldest = min(range(2), key=lambda i: (cache / "token-windows" / entries[i].name / "meta.json").stat().st_mtime)
    _age(entries[oldest], 0.5)
    monkeypatch.setenv("RTP_CACHE_MAX_SIZE", "lots")  # the flag is read, not the environment
    assert main(["cache", "--max-size", f"{sum(sizes) - 1}B"]) == 0  # the user's word: used or not
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"removed 1 window entry used longest ago ({format_size(sizes[oldest])})"
    assert out[2].endswith(f"of at most {format_size(sum(sizes) - 1)} (--max-size); least recently used "
                           + out[2].rsplit("least recently used ", 1)[1])
    assert _entries(cache) == [entries[1 - oldest]]
    held = window_cache.read(entries[1 - oldest], json.loads((entries[1 - oldest] / "meta.json").read_text())["key"],
                             SEQ_LEN)
    assert main(["cache", "--clear"]) == 0  # a reader holds the last entry
    assert capsys.readouterr().out == f"removed 0 window entries (0 B) and 1 token sum file(s) from {cache}; 1 in use left\n"
    held.close()
    assert main(["cache", "--clear"]) == 0
    assert capsys.readouterr().out.startswith(f"removed 1 window entry ({format_size(sizes[1 - oldest])})")
    assert _entries(cache) == [] and list((cache / "token-counts").glob("*.json")) == []
    monkeypatch.setenv("RTP_CACHE_DIR", "")
    assert main(["cache"]) == 0 and capsys.readouterr().out == "no token cache: RTP_CACHE_DIR is set empty\n"


def test_a_tokenizer_changed_in_place_is_loaded_again(tiny, tmp_path):
    """A long-lived process (a notebook) that edits the chat template and counts again
    counts with the new template (and caches the counts under the new files' key)."""
    tok_dir = tmp_path / "tok"
    shutil.copytree(tiny["tokenizer"], tok_dir)
    before = load_tokenizer(str(tok_dir), need_chat_template=True)
    assert load_tokenizer(str(tok_dir), need_chat_template=True) is before  # loaded once
    template = tok_dir / "chat_template.jinja"
    template.write_text("{{ bos_token }}" + template.read_text())
    after = load_tokenizer(str(tok_dir), need_chat_template=True)
    assert after is not before and after.chat_template.startswith("{{ bos_token }}")


def test_a_long_count_reports_its_progress(tiny, capsys):
    from raytrain_platform.data.pieces import CountProgress

    progress = CountProgress("data.path", quiet=0.0, every=0.0)
    for _ in range(3):
        progress.add(10)
    progress.done(1, 0)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == [f"data.path: tokenizing to count the windows: {n} document{'s' * (n > 1)}, "
                         f"{10 * n} tokens so far (0 s)" for n in (1, 2, 3)]
    assert lines[3].startswith("data.path: tokenized 3 documents, 30 tokens: 1 train and 0 validation")
    quiet = CountProgress("data.path")  # the first 5 s: nothing
    quiet.add(10)
    quiet.done(1, 0)
    assert capsys.readouterr().err == ""


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
    spec = spec_for(tiny, fmt, path=path)
    for split in ("train", "val"):  # a bad line fails both splits, wherever it falls
        with pytest.raises(DataError, match=match) as exc:
            jsonl_windows(0, path, spec, split)
        assert one_line(exc).startswith(f"{path}:{line_no}: ")


@pytest.mark.parametrize("fmt,line,field", [
    ("text", r'{"text": "bad \ud800 x"}', "field 'text'"),
    ("prompt_completion", r'{"prompt": "q", "completion": "bad \udc00"}', "field 'completion'"),
    ("chat", r'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a \ud800"}]}',
     "'messages' message 1 'content'"),
], ids=["text", "prompt_completion", "chat"])
def test_a_lone_surrogate_is_named_by_its_line_in_the_count_and_the_reads(tiny, tmp_path, fmt, line, field):
    """Valid JSON, but the tokenizer raised `TypeError: TextEncodeInput must be ...`,
    naming no file or line."""
    path = write(tmp_path / "bad.jsonl", [json.dumps(records(tiny[fmt])[0]), line])
    spec = spec_for(tiny, fmt, path=path)
    for read in (lambda: count_windows(spec), lambda: jsonl_windows(0, path, spec, "train"),
                 lambda: jsonl_windows(0, path, spec, "val")):
        with pytest.raises(DataError) as exc:
            read()
        assert one_line(exc).startswith(f"{path}:2: {field}: a lone surrogate "), one_line(exc)


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
        jsonl_windows(0, str(tiny["chat"]), spec_for(tiny, "chat", tokenizer=str(plain)), "train")
    one_line(exc)


def test_check_fits(tiny):
    spec = spec_for(tiny, "text", seq_len=257)
    check_fits(spec, vocab_size=512, max_positions=256)  # exactly fits
    check_fits(spec, vocab_size=None, max_positions=None)
    with pytest.raises(ConfigError, match="data.tokenizer.*vocab_size 500.*has 512") as exc:
        check_fits(spec, vocab_size=500, max_positions=256)
    one_line(exc)
    with pytest.raises(ConfigError, match="data.seq_len = 258") as exc:
        check_fits(spec_for(tiny, "text", seq_len=258), vocab_size=512, max_positions=256)
    one_line(exc)


def test_spec_rejects_bad_values(tiny):
    with pytest.raises(ConfigError, match="data.format = 'csv'"):
        spec_for(tiny, "text", format="csv")
    with pytest.raises(ConfigError, match="data.seq_len"):
        spec_for(tiny, "text", seq_len=1)


def test_the_jobs_processes_get_the_drivers_cache_folder(monkeypatch, tmp_path):
    """RTP_CACHE_DIR goes to the job's Ray processes absolute (they start in another
    folder), empty stays empty (no cache), unset stays unset (their own default); so
    does RTP_CACHE_MAX_SIZE, as it is."""
    from raytrain_platform.launch.session import cache_env

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RTP_CACHE_MAX_SIZE", raising=False)
    monkeypatch.setenv("RTP_CACHE_DIR", "relative/cache")
    assert cache_env() == {"RTP_CACHE_DIR": str(tmp_path / "relative" / "cache")}
    monkeypatch.setenv("RTP_CACHE_DIR", "")
    assert cache_env() == {"RTP_CACHE_DIR": ""}
    monkeypatch.delenv("RTP_CACHE_DIR")
    assert cache_env() == {}
    monkeypatch.setenv("RTP_CACHE_MAX_SIZE", "2.5GB")
    assert cache_env() == {"RTP_CACHE_MAX_SIZE": "2.5GB"}


# ---------------------------------------------------------------- tokenizing in batches, on several processes


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "chat"])
def test_documents_tokenized_together_get_each_their_own_tokens(tiny, tok, monkeypatch, fmt):
    """The tokenizer is called for many documents at once (`ENCODE_BATCH`, `ENCODE_CHARS`):
    each gets the ids and mask it gets alone (`encode_record`), in line order, with its
    split, at any batch size."""
    from raytrain_platform.data import encode, jsonl

    spec = spec_for(tiny, fmt)
    rows = records(tiny[fmt])
    keys = split_keys(split_key(spec.path, spec.path), np.arange(len(rows)))
    is_val = split_mask(keys, spec.val_fraction, "val").tolist()
    alone = [(v, *encode_record(tok, r, spec)) for v, r in zip(is_val, rows)]

    def ids(text: str) -> list[int]:  # the tokenizer called for one text
        return tok(text, add_special_tokens=False)["input_ids"]

    eos = [tok.eos_token_id]
    for (_, got, mask), r in zip(alone, rows):  # encode_record: each text tokenized alone
        if fmt == "text":
            assert (got, mask) == (ids(r["text"]) + eos, [1] * (len(got)))
        elif fmt == "prompt_completion":
            n = len(ids(r["prompt"]))
            assert (got, mask) == (ids(r["prompt"]) + ids(r["completion"]) + eos, [0] * n + [1] * (len(got) - n))
        else:
            assert got == ids(tok.apply_chat_template(r["messages"], tokenize=False)) + eos
    for batch, chars in ((64, 1 << 20), (7, 1 << 20), (64, 500), (1, 1 << 20)):
        monkeypatch.setattr(encode, "ENCODE_BATCH", batch)
        monkeypatch.setattr(encode, "ENCODE_CHARS", chars)
        assert list(jsonl._documents(0, str(tiny[fmt]), spec)) == alone, (batch, chars)
        assert list(jsonl._documents(0, str(tiny[fmt]), spec, ("val",))) == [d for d in alone if d[0]]


def test_text_files_tokenized_together_get_each_their_own_tokens(tiny, tok, tmp_path, monkeypatch):
    """A text group's files are tokenized several at a time: each file one document, with
    the ids it gets alone."""
    from raytrain_platform.data import encode

    texts = [r["text"] for r in records(tiny["text"])[:40]]
    for i, text in enumerate(texts):
        write(tmp_path / f"{i:03d}.txt", [text])
    paths = tuple(str(p) for p in sorted(tmp_path.iterdir()))
    alone = [encode._text_docs(tok, [t + "\n"])[0] for t in texts]
    for batch, chars in ((64, 1 << 20), (64, 300), (1, 1 << 20)):
        monkeypatch.setattr(encode, "ENCODE_BATCH", batch)
        monkeypatch.setattr(encode, "ENCODE_CHARS", chars)
        assert list(text_groups._group_documents(paths, spec_for(tiny, "text", path=str(tmp_path)))) == alone


def test_a_conversation_the_template_cannot_render_is_named_by_its_line(tiny, tmp_path, monkeypatch):
    from raytrain_platform.data import encode

    tok_dir = refusing_tokenizer(tiny, tmp_path / "tok")
    lines = tiny["chat"].read_text().splitlines()
    lines[69] = forbidden(lines[69])
    path = write(tmp_path / "chat.jsonl", lines)
    spec = spec_for(tiny, "chat", path=path, tokenizer=str(tok_dir))
    monkeypatch.setattr(encode, "ENCODE_BATCH", 16)  # the 70th line is in the 5th batch
    with pytest.raises(DataError, match="chat template cannot render.*no FORBIDDEN here") as exc:
        in_train = split_mask(split_keys(split_key(path, path), np.array([69])), 0.2, "train")[0]
        jsonl_windows(0, path, spec, "train" if in_train else "val")
    assert one_line(exc).startswith(f"{path}:70: ")


def test_the_count_on_worker_processes_gives_the_same_sums_and_windows(tiny, tmp_path, monkeypatch):
    """data.tokenize_processes 2: the count hands the files' blocks of lines (and the
    text groups) to two worker processes and packs what they give back in order: the
    same counts and kept windows as tokenized here, without this process tokenizing; a
    bad line in a later block is named by its file and line."""
    import dataclasses

    from raytrain_platform.data import pool

    monkeypatch.setattr(pool, "BLOCK_BYTES", 2048)  # the chat file: some 30 blocks
    folder = tmp_path / "text"
    groups = three_text_groups(tiny, folder)
    chat, text = spec_for(tiny, "chat"), spec_for(tiny, "text", path=str(folder))
    monkeypatch.setenv("RTP_CACHE_DIR", "")
    reference = {("chat", s): _piece(chat, s)[0] for s in ("train", "val")}
    reference.update({(g, s): _piece(text, s, index=g, piece=paths, text=True)[0]
                      for g, paths in enumerate(groups) for s in ("train", "val")})
    counts = count_windows(chat), pieces.count_text_windows(groups, text)

    monkeypatch.setenv("RTP_CACHE_DIR", str(tmp_path / "cache"))
    _tokenizing_fails(monkeypatch)  # here; the workers start with the real code
    on_two = [dataclasses.replace(s, tokenize_processes=2) for s in (chat, text)]
    assert (count_windows(on_two[0]), pieces.count_text_windows(groups, on_two[1])) == counts
    assert len(_entries(tmp_path / "cache")) == 2 + 6
    for (which, split), ref in reference.items():  # kept whole, in order: read back, not tokenized
        got = (_piece(chat, split)[0] if which == "chat" else
               _piece(text, split, index=which, piece=groups[which], text=True)[0])
        assert _same(got, ref), (which, split)
    assert (count_windows(chat), pieces.count_text_windows(groups, text)) == counts  # sums held

    lines = tiny["chat"].read_text().splitlines()
    lines[250] = "{not json"
    bad = write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match="not valid JSON") as exc:
        count_windows(dataclasses.replace(on_two[0], path=bad))
    assert one_line(exc).startswith(f"{bad}:251: ")
    assert len(_entries(tmp_path / "cache")) == 8  # nothing kept of the bad file


def test_the_pool_keeps_order_raises_task_errors_and_names_a_dead_worker(monkeypatch):
    from raytrain_platform.data import pool

    assert list(pool.ordered_map(abs, ((i, -i) for i in range(25)), 2)) == [(i, i) for i in range(25)]
    with pytest.raises(ValueError, match="invalid literal") as exc:
        list(pool.ordered_map(int, [(0, "1"), (1, "x"), (2, "3")], 2))
    # Its own message, not the worker's traceback text (what the CLI would print).
    assert describe_error(exc.value) == "ValueError: invalid literal for int() with base 10: 'x'"
    with pytest.raises(DataError, match="a tokenizing worker process stopped.*data.tokenize_processes") as exc:
        list(pool.ordered_map(os._exit, [(0, 3)], 2))
    one_line(exc)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert pool.count_processes("auto", pool.PARALLEL_MIN_BYTES - 1) == 1
    assert pool.count_processes("auto", 1000 * pool.PARALLEL_MIN_BYTES) == pool.MAX_AUTO_PROCESSES == 16
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: the node's ranks share the cores
    assert pool.usable_cores() == 4
    assert pool.count_processes("auto", pool.PARALLEL_MIN_BYTES) == 4
    assert pool.count_processes("auto", 100 * pool.PARALLEL_MIN_BYTES) == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert pool.count_processes("auto", 17 * pool.BLOCK_BYTES) == 8
    assert pool.count_processes(3, 0) == 3


def test_a_file_is_read_in_blocks_of_whole_lines(tmp_path):
    """`_file_blocks`: the blocks are the file, each ends at a line's end but the last, and
    each knows its first line's index: for blank lines, a missing last newline, an empty
    file and lines longer than a block."""
    from raytrain_platform.data import jsonl

    rng = np.random.default_rng(0)
    cases = [b"", b"\n", b"a", b"a\n", b"a\nbb\n\nc", b"x" * 50 + b"\ny\n"]
    cases += [bytes(rng.choice(list(b"ab\n"), size=int(rng.integers(1, 60)))) for _ in range(200)]
    for k, data in enumerate(cases):
        path = tmp_path / f"{k}.jsonl"
        path.write_bytes(data)
        for block_bytes in (1, 2, 3, 7, 64):
            blocks = list(jsonl._file_blocks(str(path), block_bytes))
            assert b"".join(b for _, b in blocks) == data, (data, block_bytes)
            assert all(b.endswith(b"\n") for _, b in blocks[:-1]), (data, block_bytes)
            assert [first for first, _ in blocks] == [data[:len(b"".join(b for _, b in blocks[:i]))].count(b"\n")
                                                    for i in range(len(blocks))], (data, block_bytes)
    with pytest.raises(DataError, match="cannot be read") as exc:
        list(jsonl._file_blocks(str(tmp_path), 8))  # a folder
    one_line(exc)


def test_a_bad_line_in_a_later_block_or_file_keeps_what_came_before(tiny, tmp_path, monkeypatch):
    """The count reads and tokenizes a file a block at a time: a bad line in a later block
    is named by its line; a bad second file leaves the first file's windows and sums kept
    (its entries are committed once its last block is in, not when the next file starts);
    the first bad line of a batch is the one named."""
    from raytrain_platform.data import pool

    monkeypatch.setattr(pool, "BLOCK_BYTES", 2048)
    monkeypatch.setenv("RTP_CACHE_DIR", str(tmp_path / "cache"))
    lines = tiny["chat"].read_text().splitlines()
    bad = lines[:250] + ["{not json"] + lines[251:]
    folder = tmp_path / "two"
    write(folder / "a.jsonl", lines)
    write(folder / "b.jsonl", bad)
    with pytest.raises(DataError, match="not valid JSON") as exc:
        count_windows(spec_for(tiny, "chat", path=str(folder)))
    assert one_line(exc).startswith(f"{folder / 'b.jsonl'}:251: ")
    assert len(_entries(tmp_path / "cache")) == 2  # a.jsonl's train and val
    assert len(list((tmp_path / "cache" / "token-counts").glob("*.json"))) == 1

    tok_dir = refusing_tokenizer(tiny, tmp_path / "tok")
    both = lines[:20] + [forbidden(lines[20])] + lines[21:30] + ["{not json"]
    path = write(tmp_path / "both.jsonl", both)  # line 21 cannot be rendered, line 31 is not JSON: one batch
    with pytest.raises(DataError, match="chat template cannot render") as exc:
        count_windows(spec_for(tiny, "chat", path=path, tokenizer=str(tok_dir)))
    assert one_line(exc).startswith(f"{path}:21: ")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux: the parent-death signal and /proc")
def test_the_pools_workers_stop_with_the_pass_and_with_the_driver(tmp_path):
    """Leaving a pass early ends its running tasks at once (not after them), and a driver
    killed outright (SIGKILL: nothing of it runs) takes its workers with it."""
    import multiprocessing
    import signal
    import subprocess
    import sys
    import time

    from raytrain_platform.data import pool

    before = set(multiprocessing.active_children())
    results = pool.ordered_map(time.sleep, [(0, 0)] + [(i, 60) for i in range(1, 6)], 2)
    assert next(results) == (0, None)
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2, workers
    started = time.monotonic()
    results.close()  # the two workers are into their 60 s sleeps
    assert time.monotonic() - started < 15 and not any(w.is_alive() for w in workers)

    script = tmp_path / "driver.py"
    script.write_text("import multiprocessing, sys, time\n"
                      "from raytrain_platform.data import pool\n"
                      "if __name__ == '__main__':\n"
                      "    results = pool.ordered_map(time.sleep, [(0, 0)] + [(i, 60) for i in range(1, 6)], 2)\n"
                      "    next(results)\n"
                      "    print(' '.join(str(p.pid) for p in multiprocessing.active_children()), flush=True)\n"
                      "    time.sleep(120)\n")
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(workers) == 2, workers
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers), workers
