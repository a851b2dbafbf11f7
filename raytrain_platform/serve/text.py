"""Tokens <-> text for served LMs: a Hugging Face tokenizer from the model's folder, or
UTF-8 bytes (ids 0-255) for byte-level models; and `TextStream`, which turns the tokens
a request generates into text deltas, stopping at a stop string.

A stream never shows text it may have to take back: a trailing U+FFFD (the first bytes
of a character whose last bytes are still to come) and a tail that could be the start
of a stop string are held until the next token decides.

>>> stream = TextStream(ByteTokenizer(), stop=("\\n\\n",))
>>> [stream.push(t) for t in b"ab\\n"]
['a', 'b', '']
>>> stream.push(ord("\\n")), stream.stopped
('', True)
>>> stream.text
'ab'
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["ByteTokenizer", "HFTokenizer", "TextStream", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (the byte-level gpt, and user LMs trained on bytes)."""

    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict]) -> str:
        raise ValueError("this model has no chat template")


class HFTokenizer:
    """A `transformers` tokenizer read from a local folder (no code from it runs)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        self.chat_template: str | None = getattr(self._tok, "chat_template", None)

    @property
    def backend(self) -> Any:
        """The `transformers` tokenizer itself."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        # No clean-up of spaces (" ." -> "."): it rewrites text already streamed (vLLM's
        # detokenizer does none either); Llama, Qwen and Mistral tokenizers do none anyway.
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template's text with an opened assistant turn (encoded as it stands:
        the template writes any special tokens itself)."""
        return self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode_rendered(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer in folder `path`; None: UTF-8 bytes."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


def encode_chat(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """Messages -> prompt ids through the tokenizer's chat template."""
    text = tokenizer.render_chat(messages)
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode_rendered(text)
    return tokenizer.encode(text)


class TextStream:
    """The text of one request's generated tokens, released as it becomes final.

    Decoding is incremental (vLLM's and TGI's detokenizer): each token decodes only the
    ids since the text was last final, after the ids just before them, so the decode a
    token costs does not grow with the completion (a run of ids with no text of their
    own yet, skipped special tokens or bytes of an unfinished character, widens the
    window until text comes). The text after the earlier ids' own
    is the new text: a tokenizer whose decoder strips the text's leading space
    (SentencePiece's Metaspace, Llama-2, Mistral) would drop a word's space if its ids
    were decoded alone. `prompt`: the request's prompt ids; the first window starts with
    its last few (vLLM's prefix offset), so the completion's first space is kept too.
    """

    PREFIX_IDS = 5  # prompt ids decoded with the generated ones (vLLM's initial offset)

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), prompt: list[int] | tuple[int, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.text = ""  # released so far
        self.stopped = False  # a stop string was reached; `text` ends before it
        # the ids decoded together: `_read` whose text is final, then those still pending
        self._window = list(prompt[-self.PREFIX_IDS:]) if prompt else []
        self._read = len(self._window)
        self._read_text = tokenizer.decode(self._window) if self._window else ""
        self._final = ""  # the generated ids' text up to the window's pending ids
        self._pending = ""  # the pending ids' text (it may end inside a character)

    def _decode_next(self, token: int) -> str:
        """Adds `token`; returns the generated ids' text (the last character may be a
        U+FFFD standing for bytes still to come)."""
        self._window.append(token)
        text = self.tokenizer.decode(self._window)
        if text.startswith(self._read_text):
            self._pending = text[len(self._read_text):]
        else:  # the earlier ids' text changed (they ended inside a character): the pending ids alone
            self._pending = self.tokenizer.decode(self._window[self._read:])
        if self._pending and not self._pending.endswith("\ufffd"):  # final: the window moves on
            self._final += self._pending
            self._pending = ""
            self._window = self._window[self._read:]
            self._read = len(self._window)
            self._read_text = self.tokenizer.decode(self._window)
        return self._final + self._pending

    def push(self, token: int) -> str:
        """Add a generated token; returns the newly released text (maybe '')."""
        full = self._decode_next(token)
        found = [at for s in self.stop if (at := full.find(s, max(0, len(self.text) - len(s) + 1))) != -1]
        if found:  # the text ends before the earliest, whichever stop string it is
            self.stopped = True
            return self._release(full[:min(found)])
        body = full.rstrip("\ufffd")
        pending = len(full) - len(body)  # a character whose last bytes are still to come
        hold = pending
        for s in self.stop:  # the longest tail that could begin a stop string
            hold = max(hold, _stop_prefix(full, s, len(s) - 1))
            if pending:  # the pending character may complete a stop string begun before it
                hold = max(hold, pending + _stop_prefix(body, s, len(s)))
        return self._release(full[:len(full) - hold])

    def finish(self) -> str:
        """The text held back, released at the end (no more tokens are coming)."""
        return "" if self.stopped else self._release(self._final + self._pending)

    def _release(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""  # nothing new (or a decode that rewrote earlier text: keep what was sent)
        delta, self.text = upto[len(self.text):], upto
        return delta


def _stop_prefix(text: str, stop: str, longest: int) -> int:
    """The length of the longest tail of `text` (at most `longest` characters) that
    `stop` begins with; 0: none."""
    return next((n for n in range(min(longest, len(text)), 0, -1) if text.endswith(stop[:n])), 0)
