"""OpenAI's completions and chat completions over a `GenerationEngine`: a request ->
prompt tokens and sampling parameters (checked against the model's context and the
deployment's limits), and the engine's output -> OpenAI's response objects, whole or
as server-sent events (``data: {json}\\n\\n`` chunks, then ``data: [DONE]``).

>>> usage(3, 4)
{'prompt_tokens': 3, 'completion_tokens': 4, 'total_tokens': 7}
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from raytrain_platform.errors import describe_error
from raytrain_platform.serve.engine import Completion, GenerationEngine, SamplingParams
from raytrain_platform.serve.http import error, error_body
from raytrain_platform.serve.openai_schemas import ChatRequest, CompletionRequest
from raytrain_platform.serve.text import Tokenizer, encode_chat

__all__ = ["prepare", "respond", "stream_events", "usage"]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _prompt_ids(body: CompletionRequest | ChatRequest, tokenizer: Tokenizer, model_id: str) -> list[int]:
    if isinstance(body, CompletionRequest):
        return tokenizer.encode(body.prompt_text())
    if not tokenizer.chat_template:
        raise error(400, f"model {model_id!r} has no chat template (its tokenizer has none): use "
                         "POST /v1/completions", param="messages", code="chat_template_missing")
    try:
        return encode_chat(tokenizer, [m.as_template_input() for m in body.messages])
    except Exception as exc:  # the template's own checks (jinja raise_exception): a bad conversation
        raise error(400, f"messages: the chat template refused them ({str(exc).splitlines()[0][:200]})",
                    param="messages") from None


def prepare(body: CompletionRequest | ChatRequest, entry: dict, tokenizer: Tokenizer, *,
            max_new_tokens: int) -> tuple[list[int], SamplingParams]:
    """Prompt ids and sampling parameters, or a 400 naming the limit broken: the
    context (``entry["context_len"]``), the deployment's ``max_new_tokens``."""
    ids = _prompt_ids(body, tokenizer, entry["id"])
    where = "prompt" if isinstance(body, CompletionRequest) else "messages"
    context, cached = entry["context_len"], entry["kv_cache"]
    if not ids:
        raise error(400, f"{where}: encodes to no tokens", param=where)
    # Completions: max_tokens, 16 when unset or null; chat: None when neither field is set.
    asked = body.token_limit()
    # The client's own limit (None when it set none, or null): a limit it did not set is not refused.
    given = body.max_tokens if isinstance(body, CompletionRequest) else asked
    explicit = given if {"max_tokens", "max_completion_tokens"} & body.model_fields_set else None
    # Errors name the field the limit came from (chat's newer name wins, as in token_limit).
    newer = isinstance(body, ChatRequest) and body.max_completion_tokens is not None
    limit_field = "max_completion_tokens" if newer else "max_tokens"
    if explicit is not None and explicit > max_new_tokens:
        raise error(400, f"{limit_field}: {asked}; at most {max_new_tokens} (the deployment's max_new_tokens)",
                    param=limit_field)
    if context and (len(ids) >= context if cached else len(ids) > context):
        raise error(400, f"{where}: {len(ids)} tokens; this model's maximum context length is {context} "
                         f"tokens{' (prompt and completion together)' if cached else ''}",
                    param=where, code="context_length_exceeded")
    room = context - len(ids) if context and cached else max_new_tokens
    if explicit is not None and explicit > room:
        raise error(400, f"{limit_field}: {asked}; this model's maximum context length is {context} tokens "
                         f"and the {where} has {len(ids)}, so at most {room}", param=limit_field,
                    code="context_length_exceeded")
    limit = min(asked if asked is not None else max_new_tokens, room, max_new_tokens)
    params = SamplingParams(max_tokens=limit, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                            stop=body.stop_strings(), stop_token_ids=tuple(entry["stop_token_ids"]))
    return ids, params


def _envelope(body: CompletionRequest | ChatRequest, model_id: str, chunk: bool) -> dict:
    chat = isinstance(body, ChatRequest)
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), "object": kind,
            "created": int(time.time()), "model": model_id}


def respond(body: CompletionRequest | ChatRequest, model_id: str, done: Completion, step: int) -> dict:
    """The whole response object of a finished request (``seed`` and ``step`` are ours)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
    if isinstance(body, ChatRequest):
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice["text"] = done.text
    return {**_envelope(body, model_id, chunk=False), "choices": [choice],
            "usage": usage(done.prompt_tokens, done.completion_tokens), "seed": done.seed, "step": step}


def _chunk(envelope: dict, chat: bool, text: str | None, finish: str | None, first: bool = False) -> dict:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {**envelope, "choices": [choice]}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def stream_events(body: CompletionRequest | ChatRequest, model_id: str, engine: GenerationEngine,
                        ids: list[int], params: SamplingParams) -> AsyncIterator[str]:
    """Server-sent events: a chunk per text delta, one with the finish reason, (with
    ``stream_options.include_usage``) one with the usage, then ``[DONE]``. An error after
    the first byte is sent as an event in OpenAI's error shape."""
    chat = isinstance(body, ChatRequest)
    envelope = _envelope(body, model_id, chunk=True)
    if chat:
        yield _sse(_chunk(envelope, chat, None, None, first=True))
    try:
        async for item in engine.stream(ids, params):
            if isinstance(item, Completion):
                yield _sse(_chunk(envelope, chat, None, item.finish_reason))
                if body.include_usage():
                    yield _sse({**envelope, "choices": [],
                                "usage": usage(item.prompt_tokens, item.completion_tokens)})
            else:
                yield _sse(_chunk(envelope, chat, item, None))
    except Exception as exc:  # the status line is sent already: say it in the stream, in one line
        yield _sse(error_body(500, f"internal error: {describe_error(exc)}"))
    yield _sse("[DONE]")
