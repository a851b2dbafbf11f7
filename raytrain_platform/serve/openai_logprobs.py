"""Logprobs in OpenAI's two shapes: completions' (parallel lists ``tokens``,
``token_logprobs``, ``top_logprobs`` and ``text_offset``) and chat's
(``content: [{token, logprob, bytes, top_logprobs}]``). A token is shown as its own
decoded text (``token_id:ID`` with vLLM's ``return_tokens_as_token_ids``); ``text_offset`` counts characters from the start of the prompt (OpenAI's
legacy rule: with ``echo`` the prompt's tokens come first, from 0).

>>> from raytrain_platform.serve.text import ByteTokenizer
>>> from raytrain_platform.serve.engine import TokenLogprob
>>> completion_logprobs(ByteTokenizer(), [(104, None), (105, TokenLogprob(105, -0.5, ((106, -0.1),)))], 0)
{'tokens': ['h', 'i'], 'token_logprobs': [None, -0.5], 'top_logprobs': [None, {'j': -0.1, 'i': -0.5}], 'text_offset': [0, 1]}
"""

from __future__ import annotations

from collections.abc import Sequence

from raytrain_platform.serve.engine import TokenLogprob
from raytrain_platform.serve.text import ByteTokenizer, Tokenizer

__all__ = ["chat_logprobs", "completion_logprobs", "token_bytes", "token_text"]


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """One token's own text (a piece of a multi-byte character decodes to U+FFFD)."""
    return tokenizer.decode([token])


def token_bytes(tokenizer: Tokenizer, token: int) -> list[int]:
    """The token's UTF-8 bytes: exact for byte-level models, its text's otherwise."""
    if isinstance(tokenizer, ByteTokenizer) and 0 <= token < 256:
        return [token]
    return list(token_text(tokenizer, token).encode("utf-8"))


def _shown(tokenizer: Tokenizer, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else token_text(tokenizer, token)


def completion_logprobs(tokenizer: Tokenizer, tokens: Sequence[tuple[int, TokenLogprob | None]],
                        offset: int, as_ids: bool = False) -> dict:
    """Completions' ``logprobs`` object for (token id, its logprobs or None: a prompt's
    first token) pairs whose text starts at character `offset`. ``top_logprobs`` holds
    the most likely tokens and the token itself (OpenAI: up to logprobs + 1 entries)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, info in tokens:
        shown = _shown(tokenizer, token, as_ids)
        out["tokens"].append(shown)
        out["text_offset"].append(offset)
        offset += len(token_text(tokenizer, token))
        out["token_logprobs"].append(None if info is None else info.logprob)
        top = None if info is None else {_shown(tokenizer, t, as_ids): lp for t, lp in info.top}
        if top is not None and info is not None:
            top.setdefault(shown, info.logprob)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokenizer: Tokenizer, infos: Sequence[TokenLogprob], as_ids: bool = False) -> dict:
    """Chat's ``logprobs`` object: ``content`` per token, ``refusal`` null."""
    def entry(token: int, logprob: float) -> dict:
        return {"token": _shown(tokenizer, token, as_ids), "logprob": logprob, "bytes": token_bytes(tokenizer, token)}

    content = [{**entry(info.token, info.logprob), "top_logprobs": [entry(t, lp) for t, lp in info.top]}
               for info in infos]
    return {"content": content, "refusal": None}
