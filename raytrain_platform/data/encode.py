"""Tokenizing instruction records: the tokenizer of a local folder, each record checked
for its `data.format`, and documents as token ids (ending with EOS) with their loss
masks (1 = trained on), the tokenizer called once for many records. Pure and
deterministic: a record gets the ids it gets alone, whatever it is tokenized with.
`jsonl.py` reads the files and packs these documents into windows.
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from raytrain_platform.errors import ConfigError, DataError

if TYPE_CHECKING:
    from raytrain_platform.data.jsonl import JsonlSpec

__all__ = ["ENCODE_BATCH", "ENCODE_CHARS", "load_tokenizer", "encode_record", "check_unicode", "check_messages",
           "token_ids", "bos_ids", "render_chat", "assistant_spans"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _folder_state(path: str) -> tuple:
    """(name, size, modification time) of each file in the folder: what a tokenizer
    loaded from it was loaded from (empty where it cannot be listed)."""
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                            for e in os.scandir(path) if e.is_file()))
    except OSError:
        return ()


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, state: tuple = ()) -> Any:
    """`state` (`_folder_state`) keys the cache: files changed in place load again."""
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


def load_tokenizer(path: str, *, need_chat_template: bool) -> Any:
    """The Hugging Face tokenizer in local folder `path`, loaded once per process and
    again if its files change; never downloads, never runs code from the folder."""
    tok = _load_tokenizer(path, _folder_state(path))
    if need_chat_template and not getattr(tok, "chat_template", None):
        raise ConfigError("data.tokenizer", path, "a tokenizer with a chat_template for data.format chat")
    return tok


# ---------------------------------------------------------------- records


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


def _check_record(record: Any, spec: JsonlSpec) -> None:
    """DataError (without a location; the reader adds it) unless `record` fits `spec.format`."""
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    if spec.format == "chat":
        if spec.messages_field not in record:
            raise DataError(f"expected a field {spec.messages_field!r} (data.format chat)")
        return check_messages(record[spec.messages_field], spec.messages_field)
    fields = ((spec.text_field,) if spec.format == "text"
              else (spec.prompt_field, spec.completion_field))
    for name in fields:
        if not isinstance(record.get(name), str):
            got = "missing" if name not in record else type(record[name]).__name__
            raise DataError(f"expected a string field {name!r} (data.format {spec.format}), got {got}")
        check_unicode(record[name], f"field {name!r}")


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


def _encode_chats(tok: Any, conversations: list[list[dict]],
                  where: Callable[[int], str]) -> list[tuple[list[int], list[int]]]:
    rendered = []
    for i, messages in enumerate(conversations):
        try:
            full = render_chat(tok, messages)
            rendered.append((full, assistant_spans(tok, messages, full)))
        except DataError as exc:
            raise DataError(f"{where(i)}{exc}") from None
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


def _text_docs(tok: Any, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    bos, eos = bos_ids(tok), tok.eos_token_id
    return [(bos + ids + [eos], [0] * len(bos) + [1] * (len(ids) + 1)) for ids in token_ids(tok, texts)]


def _encode(tok: Any, records: list[dict], spec: JsonlSpec,
            where: Callable[[int], str] = lambda i: "") -> list[tuple[list[int], list[int]]]:
    """Token ids (ending with EOS) and loss mask (1 = trained on) of each checked
    record, the tokenizer called once for them all. A conversation the chat template
    cannot render raises DataError, its message prefixed by ``where(its index)``."""
    if spec.format == "text":
        return _text_docs(tok, [r[spec.text_field] for r in records])
    if spec.format == "prompt_completion":
        bos, eos, n = bos_ids(tok), tok.eos_token_id, len(records)
        ids = token_ids(tok, [r[spec.prompt_field] for r in records] + [r[spec.completion_field] for r in records])
        return [(bos + prompt + completion + [eos], [0] * (len(bos) + len(prompt)) + [1] * (len(completion) + 1))
                for prompt, completion in zip(ids[:n], ids[n:])]
    return _encode_chats(tok, [r[spec.messages_field] for r in records], where)


def encode_record(tok: Any, record: dict, spec: JsonlSpec) -> tuple[list[int], list[int]]:
    """Token ids of one document (ending with EOS) and its loss mask (1 = trained on)."""
    _check_record(record, spec)
    return _encode(tok, [record], spec)[0]


def _batches(items: Iterator[Any], chars: Callable[[Any], int]) -> Iterator[list[Any]]:
    """`items` in lists of at most `ENCODE_BATCH`, a list closed once its `chars`
    reach `ENCODE_CHARS`; where `items` raises DataError, the list so far, then the error.

    >>> [len(b) for b in _batches(iter(range(150)), lambda i: 1)]
    [64, 64, 22]
    >>> [len(b) for b in _batches(iter(range(3)), lambda i: ENCODE_CHARS)]
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
