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

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

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
    """The text of one request's generated tokens, released as it becomes final."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False  # a stop string was reached; `text` ends before it

    def push(self, token: int) -> str:
        """Add a generated token; returns the newly released text (maybe '')."""
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        found = [at for s in self.stop if (at := full.find(s, max(0, len(self.text) - len(s) + 1))) != -1]
        if found:  # the text ends before the earliest, whichever stop string it is
            self.stopped = True
            return self._release(full[:min(found)])
        hold = len(full) - len(full.rstrip("\ufffd"))
        for s in self.stop:  # the longest tail that could begin a stop string
            hold = max(hold, next((n for n in range(min(len(s) - 1, len(full)), 0, -1)
                                   if full.endswith(s[:n])), 0))
        return self._release(full[:len(full) - hold])

    def finish(self) -> str:
        """The text held back, released at the end (no more tokens are coming)."""
        return "" if self.stopped else self._release(self.tokenizer.decode(self.ids))

    def _release(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""  # nothing new (or a decode that rewrote earlier text: keep what was sent)
        delta, self.text = upto[len(self.text):], upto
        return delta
