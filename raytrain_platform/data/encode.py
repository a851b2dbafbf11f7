"""Tokenizing instruction records: the tokenizer of a local folder, each record checked
for its `data.format`, and documents as token ids (ending with EOS) with their loss
masks (1 = trained on), the tokenizer called once for many records. Pure and
deterministic: a record gets the ids it gets alone, whatever it is tokenized with.
`jsonl.py` reads JSON lines and `tables.py` table rows into these records.

Five formats (`FORMATS`); the last three become chat messages rendered by the
tokenizer's chat template, the loss on the assistant turns only (`CHAT_FORMATS`):

* ``text``: ``{"text": ...}``, every token trained on;
* ``prompt_completion``: ``{"prompt": ..., "completion": ...}``, the completion and EOS;
* ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}``;
* ``alpaca``: ``{"instruction": ..., "input": ..., "output": ..., "system": ...}`` (input
  and system optional), as LLaMA-Factory converts it: a system message when there is a
  system, one user turn of the instruction and the input joined by a newline (either
  left out where empty), and the output as the assistant turn;
* ``sharegpt``: ``{"conversations": [{"from": ..., "value": ...}, ...]}`` with ``from``
  human or user, gpt or assistant, system (`SHAREGPT_ROLES`).

>>> spec = RecordSpec("alpaca")
>>> chat_messages({"instruction": "Add.", "input": "1 2", "output": "3"}, spec)
[{'role': 'user', 'content': 'Add.\\n1 2'}, {'role': 'assistant', 'content': '3'}]
>>> check_record({"instruction": "Add."}, spec)
Traceback (most recent call last):
...
raytrain_platform.errors.DataError: expected a string field 'output' (data.format alpaca), got missing
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Union

import numpy as np

from raytrain_platform.data.specs import FORMATS, RecordSpec, record_fields
from raytrain_platform.errors import ConfigError, DataError

if TYPE_CHECKING:
    from raytrain_platform.data.specs import SourceSpec, TokenSpec

__all__ = ["ENCODE_BATCH", "ENCODE_CHARS", "FORMATS", "CHAT_FORMATS", "SHAREGPT_ROLES", "RecordSpec",
           "record_spec", "RecordError", "load_tokenizer", "folder_state", "tokenizer_for_format", "check_record",
           "chat_messages", "encode_records", "encode_record", "text_documents", "encode_batches", "check_fits",
           "check_unicode", "check_messages", "token_ids", "bos_ids", "render_chat", "assistant_spans"]

CHAT_FORMATS = ("chat", "alpaca", "sharegpt")  # rendered by the tokenizer's chat template
# ShareGPT's `from` → chat role. human/gpt/system are ShareGPT's own (and LLaMA-Factory's
# tags); user/assistant are in data that calls itself ShareGPT too (Unsloth's
# standardize_sharegpt takes both).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


def record_spec(spec: Union[RecordSpec, "TokenSpec", "SourceSpec"]) -> RecordSpec:
    """`spec` as a `RecordSpec`: itself, or the format and field names of another spec
    (`TokenSpec`, `SourceSpec`)."""
    if isinstance(spec, RecordSpec):
        return spec
    return _record_spec(spec.format, tuple(record_fields(spec).items()))


@functools.lru_cache(maxsize=64)  # a record is checked per line
def _record_spec(format: str, fields: tuple[tuple[str, str], ...]) -> RecordSpec:
    return RecordSpec(format=format, **dict(fields))


# ---------------------------------------------------------------- tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def folder_state(path: str) -> tuple:
    """(name, size, modification time) of each file in the folder: what a tokenizer
    loaded from it was loaded from (empty where it cannot be listed)."""
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                            for e in os.scandir(path) if e.is_file()))
    except OSError:
        return ()


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, state: tuple = ()) -> Any:
    """`state` (`folder_state`) keys the cache: files changed in place load again."""
    from transformers import AutoTokenizer

    allowed = "a local folder with tokenizer files (tokenizer.json or tokenizer_config.json)"
    if not os.path.isdir(path):
        raise ConfigError("data.tokenizer", path, allowed)
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ConfigError("data.tokenizer", path, allowed)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises OSError, ValueError, ImportError…
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("data.tokenizer", path, f"a loadable tokenizer ({reason})") from None
    if tok.eos_token_id is None:
        raise ConfigError("data.tokenizer", path, "a tokenizer with an eos_token (it ends every document)")
    return tok


def load_tokenizer(path: str, *, need_chat_template: bool, format: str = "chat") -> Any:
    """The Hugging Face tokenizer in local folder `path`, loaded once per process and
    again if its files change; never downloads, never runs code from the folder.
    `format` names the data.format that needs the chat template."""
    tok = _load_tokenizer(path, folder_state(path))
    if need_chat_template and not getattr(tok, "chat_template", None):
        raise ConfigError("data.tokenizer", path, f"a tokenizer with a chat_template for data.format {format}")
    return tok


def tokenizer_for_format(path: str, format: str) -> Any:
    """`load_tokenizer` for records of `format`: one with a chat template for `CHAT_FORMATS`."""
    return load_tokenizer(path, need_chat_template=format in CHAT_FORMATS, format=format)


# ---------------------------------------------------------------- records


class RecordError(DataError):
    """A record that cannot be tokenized: `index` is its place in the list handed to
    `encode_records` (or its line in a reader's block); the message names no location
    (the reader adds its file and line)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def check_unicode(value: Any, where: str) -> None:
    """DataError if a string in `value` (or in its lists and objects, keys too) holds a
    lone UTF-16 surrogate: valid JSON (``"\\ud800"``), but the tokenizer raises a
    TypeError for it that names no file or line."""
    stack = [value]  # not recursive: JSON may nest deeper than Python's stack
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise DataError(f"{where}: a lone surrogate {item[exc.start]!r} at character {exc.start} "
                                "is not Unicode text (expected a string that encodes as UTF-8)") from None


def check_messages(messages: Any, field: str, *, need_assistant: bool = True) -> None:
    """DataError (without a location) unless `messages` is a non-empty list of
    ``{"role": str, "content": str}`` objects of Unicode text, one of them (with
    `need_assistant`) an assistant's; `field` names the list in the message."""
    shape = f"{field!r}: a non-empty list of {{\"role\": str, \"content\": str}} objects"
    if not isinstance(messages, list) or not messages:
        raise DataError(f"expected {shape}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(f"expected {shape}; message {i} is {json.dumps(m)[:80]}")
        for key, value in m.items():  # the chat template may render any of them
            check_unicode([key, value], f"{field!r} message {i} {key!r}")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"expected {field!r} to hold at least one message with role 'assistant'")


def _check_string(record: dict, name: str, fmt: str, optional: bool = False) -> None:
    """DataError unless `record[name]` is a string (with `optional`: or missing, or null)."""
    value = record.get(name)
    if optional and value is None:
        return
    if not isinstance(value, str):
        got = "missing" if name not in record else type(value).__name__
        kind = "an optional string field" if optional else "a string field"
        raise DataError(f"expected {kind} {name!r} (data.format {fmt}), got {got}")
    check_unicode(value, f"field {name!r}")


def _check_sharegpt(turns: Any, field: str) -> None:
    roles = ", ".join(SHAREGPT_ROLES)
    shape = f"{field!r}: a non-empty list of {{\"from\": str, \"value\": str}} objects, \"from\" one of {roles}"
    if not isinstance(turns, list) or not turns:
        raise DataError(f"expected {shape}")
    for i, t in enumerate(turns):
        if not (isinstance(t, dict) and isinstance(t.get("from"), str) and t["from"] in SHAREGPT_ROLES
                and isinstance(t.get("value"), str)):
            raise DataError(f"expected {shape}; message {i} is {json.dumps(t, default=str)[:80]}")
        check_unicode(t["value"], f"{field!r} message {i} 'value'")
    if not any(SHAREGPT_ROLES[t["from"]] == "assistant" for t in turns):
        raise DataError(f"expected {field!r} to hold at least one message from 'gpt' (or 'assistant')")


def check_record(record: Any, spec: Union[RecordSpec, "TokenSpec"]) -> None:
    """DataError (without a location; the reader adds it) unless `record` fits `spec.format`."""
    spec = record_spec(spec)
    if spec.format == "preference":
        raise ValueError("a preference record is a pair: preference.check_pair checks it")
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    if spec.format in ("chat", "sharegpt"):
        field = spec.messages_field if spec.format == "chat" else spec.conversations_field
        if field not in record:
            raise DataError(f"expected a field {field!r} (data.format {spec.format})")
        check = check_messages if spec.format == "chat" else _check_sharegpt
        return check(record[field], field)
    required, optional = spec.fields
    for name in required:
        _check_string(record, name, spec.format)
    for name in optional:
        _check_string(record, name, spec.format, optional=True)




def chat_messages(record: dict, spec: Union[RecordSpec, "TokenSpec"]) -> list[dict]:
    """The chat messages a checked record of a `CHAT_FORMATS` format is rendered from."""
    spec = record_spec(spec)
    if spec.format == "chat":
        return record[spec.messages_field]
    if spec.format == "sharegpt":
        return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in record[spec.conversations_field]]
    if spec.format != "alpaca":
        raise ValueError(f"data.format {spec.format} records are not chat messages")
    # LLaMA-Factory's AlpacaDatasetConverter: "instruction\ninput", each only where non-empty.
    user = "\n".join(v for v in (record[spec.instruction_field], record.get(spec.input_field)) if v)
    system = record.get(spec.system_field)
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": record[spec.output_field]}]


# Documents handed to the tokenizer in one call (at most; and about `ENCODE_CHARS` bytes
# of JSON lines, or characters of text files): its per-call cost is paid once for them,
# and a fast tokenizer spreads them over its threads. Each call still gives every
# document the ids it gives that document alone.
ENCODE_BATCH = 64
ENCODE_CHARS = 1 << 20


def token_ids(tok: Any, texts: list[str]) -> list[list[int]]:
    """The ids of each text, without special tokens, in one tokenizer call."""
    return list(tok(texts, add_special_tokens=False)["input_ids"]) if texts else []


def bos_ids(tok: Any) -> list[int]:
    """``[bos]`` where the tokenizer has a BOS distinct from EOS, else ``[]``."""
    # Tokenizers with a BOS distinct from EOS (Llama) expect it at each document start.
    bos = tok.bos_token_id
    return [] if bos is None or bos == tok.eos_token_id else [bos]


def render_chat(tok: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    """`messages` rendered by the tokenizer's chat template (a DataError where it cannot)."""
    try:
        return tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja errors, raise_exception() in templates
        raise DataError(f"the chat template cannot render these messages ({exc})") from None


def assistant_spans(tok: Any, messages: list[dict], full: str, first: int = 0) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `full` (`messages` rendered), from
    message `first` on: the text a turn adds after the generation prompt that opens it
    (its content and the template's end-of-turn)."""
    spans = []
    for i, m in enumerate(messages):
        if i < first or m["role"] != "assistant":
            continue
        before = render_chat(tok, messages[:i], generation_prompt=True)
        # The last turn's prefix is the whole conversation (one render fewer per record).
        upto = full if i == len(messages) - 1 else render_chat(tok, messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(f"the chat template does not render message {i} as a prefix of the "
                            "conversation, so the assistant tokens cannot be located")
        spans.append((len(before), len(upto)))
    return spans


def _encode_chats(tok: Any, conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    rendered = []
    for i, messages in enumerate(conversations):
        try:
            full = render_chat(tok, messages)
            rendered.append((full, assistant_spans(tok, messages, full)))
        except DataError as exc:
            raise RecordError(i, str(exc)) from None
    if not rendered:
        return []
    enc = tok([full for full, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    docs = []
    for (_, spans), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
        starts = np.array([s for s, _ in offsets], dtype=np.int64)
        inside = np.zeros(starts.shape, dtype=bool)
        for lo, hi in spans:
            inside |= (starts >= lo) & (starts < hi)
        # The chat template already closes each assistant turn, so EOS is not a target.
        docs.append((list(ids) + [tok.eos_token_id], inside.astype(int).tolist() + [0]))
    return docs


def text_documents(tok: Any, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    bos, eos = bos_ids(tok), tok.eos_token_id
    return [(bos + ids + [eos], [0] * len(bos) + [1] * (len(ids) + 1)) for ids in token_ids(tok, texts)]


def encode_records(tok: Any, records: list[dict],
                   spec: Union[RecordSpec, "TokenSpec"]) -> list[tuple[list[int], list[int]]]:
    """Token ids (ending with EOS) and loss mask (1 = trained on) of each checked
    record, the tokenizer called once for them all. A conversation the chat template
    cannot render raises `RecordError` with its index."""
    spec = record_spec(spec)
    if spec.format == "text":
        return text_documents(tok, [r[spec.text_field] for r in records])
    if spec.format == "prompt_completion":
        bos, eos, n = bos_ids(tok), tok.eos_token_id, len(records)
        ids = token_ids(tok, [r[spec.prompt_field] for r in records] + [r[spec.completion_field] for r in records])
        return [(bos + prompt + completion + [eos], [0] * (len(bos) + len(prompt)) + [1] * (len(completion) + 1))
                for prompt, completion in zip(ids[:n], ids[n:])]
    return _encode_chats(tok, [chat_messages(r, spec) for r in records])




def encode_record(tok: Any, record: dict, spec: Union[RecordSpec, "TokenSpec"]) -> tuple[list[int], list[int]]:
    """Token ids of one document (ending with EOS) and its loss mask (1 = trained on)."""
    check_record(record, spec)
    return encode_records(tok, [record], spec)[0]


def encode_batches(items: Iterator[Any], chars: Callable[[Any], int]) -> Iterator[list[Any]]:
    """`items` in lists of at most `ENCODE_BATCH`, a list closed once its `chars`
    reach `ENCODE_CHARS`; where `items` raises DataError, the list so far, then the error.

    >>> [len(b) for b in encode_batches(iter(range(150)), lambda i: 1)]
    [64, 64, 22]
    >>> [len(b) for b in encode_batches(iter(range(3)), lambda i: ENCODE_CHARS)]
    [1, 1, 1]
    """
    batch, size = [], 0
    try:
        for item in items:
            batch.append(item)
            size += chars(item)
            if len(batch) == ENCODE_BATCH or size >= ENCODE_CHARS:
                yield batch
                batch, size = [], 0
    except DataError:  # a bad item: the items before it first (one of them may be bad too)
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def check_fits(spec: TokenSpec, *, vocab_size: int | None, max_positions: int | None) -> None:
    """ConfigError unless the tokenizer's ids fit the model's embedding and each window's
    context (seq_len - 1) fits its positions; None skips a check."""
    tok = tokenizer_for_format(spec.tokenizer, spec.format)
    if vocab_size is not None and len(tok) > vocab_size:
        raise ConfigError("data.tokenizer", spec.tokenizer,
                          f"a tokenizer of at most the model's vocab_size {vocab_size} tokens "
                          f"(this one has {len(tok)})")
    if max_positions is not None and spec.seq_len - 1 > max_positions:
        raise ConfigError("data.seq_len", spec.seq_len,
                          f"at most {max_positions + 1}: the model has {max_positions} positions "
                          "and sees seq_len - 1 tokens")
