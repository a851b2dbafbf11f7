"""OpenAI's completions and chat completions over a `GenerationEngine`: a request ->
prompts (one or a batch) and sampling parameters (checked against the model's context,
vocabulary and the deployment's limits), ``n`` choices per prompt as rows of the
engine's batch, and the engine's output -> OpenAI's response objects, whole or as
server-sent events (``data: {json}\\n\\n`` chunks, then ``data: [DONE]``).

Choice ``i * n + k`` is prompt ``i``'s ``k``-th sample; with a ``seed`` it samples with
``seed + k`` (so one prompt gives the same choices alone or in a batch).

>>> usage(3, 4)
{'prompt_tokens': 3, 'completion_tokens': 4, 'total_tokens': 7}
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from raytrain_platform.errors import describe_error
from raytrain_platform.serve.engine import Completion, GenerationEngine, SamplingParams, TokenLogprob
from raytrain_platform.serve.http import error, error_body
from raytrain_platform.serve.openai_logprobs import chat_logprobs, completion_logprobs
from raytrain_platform.serve.openai_schemas import ChatRequest, CompletionRequest
from raytrain_platform.serve.text import HFTokenizer, Tokenizer, encode_chat

__all__ = ["Choice", "answer", "prepare", "usage"]

Request = CompletionRequest | ChatRequest


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _prompt_ids(body: Request, tokenizer: Tokenizer, model_id: str) -> list[list[int]]:
    if isinstance(body, CompletionRequest):
        return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompt_list()]
    if not tokenizer.chat_template:
        raise error(400, f"model {model_id!r} has no chat template (its tokenizer has none): use "
                         "POST /v1/completions", param="messages", code="chat_template_missing")
    try:
        return [encode_chat(tokenizer, [m.as_template_input() for m in body.messages])]
    except Exception as exc:  # the template's own checks (jinja raise_exception): a bad conversation
        raise error(400, f"messages: the chat template refused them ({str(exc).splitlines()[0][:200]})",
                    param="messages") from None


def _check_ids(body: Request, prompts: list[list[int]], vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    for i, ids in enumerate(prompts):
        if max(ids) >= vocab_size:
            at = f"prompt {i}: " if len(prompts) > 1 else ""
            raise error(400, f"prompt: {at}token id {max(ids)}; this model's ids are 0..{vocab_size - 1}",
                        param="prompt")
    for token, _ in body.bias():
        if token >= vocab_size:
            raise error(400, f"logit_bias: token id {token}; this model's ids are 0..{vocab_size - 1}",
                        param="logit_bias")


def _limit(body: Request, ids: list[int], at: str, entry: dict, max_new_tokens: int) -> int:
    """The tokens this prompt may generate, or a 400 naming the limit broken."""
    where = "prompt" if isinstance(body, CompletionRequest) else "messages"
    context, cached = entry["context_len"], entry["kv_cache"]
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
    generates = asked != 0  # max_tokens 0 (with echo): the prompt is scored, it needs no room after it
    if context and (len(ids) >= context if cached and generates else len(ids) > context):
        raise error(400, f"{where}: {at}{len(ids)} tokens; this model's maximum context length is {context} "
                         f"tokens{' (prompt and completion together)' if cached and generates else ''}",
                    param=where, code="context_length_exceeded")
    room = context - len(ids) if context and cached else max_new_tokens
    if explicit is not None and explicit > room:
        raise error(400, f"{limit_field}: {asked}; this model's maximum context length is {context} tokens "
                         f"and the {where} {at}has {len(ids)}, so at most {room}", param=limit_field,
                    code="context_length_exceeded")
    return min(asked if asked is not None else max_new_tokens, room, max_new_tokens)


def prepare(body: Request, entry: dict, tokenizer: Tokenizer, *, max_new_tokens: int,
            vocab_size: int | None = None) -> list[tuple[list[int], SamplingParams]]:
    """Per prompt: its ids and sampling parameters, or a 400 naming the limit broken:
    the context (``entry["context_len"]``), the deployment's ``max_new_tokens``, the
    model's ids (`vocab_size`: prompt token ids and ``logit_bias`` keys)."""
    prompts = _prompt_ids(body, tokenizer, entry["id"])
    where = "prompt" if isinstance(body, CompletionRequest) else "messages"
    for i, ids in enumerate(prompts):
        if not ids:
            raise error(400, f"{where}: {f'prompt {i} ' if len(prompts) > 1 else ''}encodes to no tokens",
                        param=where)
    _check_ids(body, prompts, vocab_size)
    top = body.top_logprobs_count()
    base = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                          stop=body.stop_strings(), stop_token_ids=tuple(entry["stop_token_ids"]),
                          presence_penalty=body.presence_penalty or 0.0,
                          frequency_penalty=body.frequency_penalty or 0.0, logit_bias=body.bias(), logprobs=top)
    return [(ids, replace(base, max_tokens=_limit(body, ids, f"prompt {i} " if len(prompts) > 1 else "", entry,
                                                     max_new_tokens)))
            for i, ids in enumerate(prompts)]


async def _grammar(body: Request, tokenizer: Tokenizer, engine: GenerationEngine, entry: dict) -> Any:
    """The compiled grammar of ``response_format`` (None: plain text), or a 400 saying why not."""
    schema = body.response_format.schema_text() if body.response_format else None
    if schema is None:
        return None
    if not isinstance(tokenizer, HFTokenizer) or engine.vocab_size is None or not entry["stop_token_ids"]:
        raise error(400, f"response_format: model {entry['id']!r} cannot be constrained (it needs a Hugging Face "
                         "tokenizer, a known vocabulary and an end-of-sequence token)", param="response_format")
    from raytrain_platform.serve.structured import StructuredOutputError

    try:
        grammars = engine.grammars(tokenizer.backend, entry["stop_token_ids"])
        return await asyncio.to_thread(grammars.compile, schema)
    except ImportError:
        raise error(400, "response_format: constrained decoding needs xgrammar (pip install xgrammar)",
                    param="response_format") from None
    except StructuredOutputError as exc:
        raise error(400, f"response_format.json_schema.schema: {exc}", param="response_format") from None


@dataclass
class Choice:
    """One choice of a response: its prompt, parameters and (for echo) prompt text."""

    index: int
    prompt: list[int]
    params: SamplingParams
    echo: str | None  # the prompt's text when echoed
    as_ids: bool = False  # tokens shown as "token_id:ID" (vLLM's return_tokens_as_token_ids)


def _choices(body: Request, prepared: list[tuple[list[int], SamplingParams]], grammar: Any,
             tokenizer: Tokenizer) -> list[Choice]:
    n = body.choices_per_prompt()
    texts = body.prompt_list() if isinstance(body, CompletionRequest) else []
    out = []
    for i, (ids, params) in enumerate(prepared):
        echo = None
        if isinstance(body, CompletionRequest) and body.echo:
            text = texts[i]
            echo = text if isinstance(text, str) else tokenizer.decode(ids)
        for k in range(n):
            seed = None if params.seed is None else (params.seed + k) % 2**63
            out.append(Choice(i * n + k, ids, replace(params, seed=seed, grammar=grammar), echo,
                              bool(body.return_tokens_as_token_ids)))
    return out


async def answer(body: Request, entry: dict, tokenizer: Tokenizer, engine: GenerationEngine, *,
                 max_new_tokens: int, step: int) -> dict | AsyncIterator[str]:
    """The response object, or (``stream: true``) its server-sent events; request errors
    are raised here, before anything is sent."""
    prepared = prepare(body, entry, tokenizer, max_new_tokens=max_new_tokens, vocab_size=engine.vocab_size)
    choices = _choices(body, prepared, await _grammar(body, tokenizer, engine, entry), tokenizer)
    prompt_tokens = sum(len(ids) for ids, _ in prepared)
    if body.stream:
        return _stream(body, entry["id"], tokenizer, engine, choices, prompt_tokens)
    results = await asyncio.gather(*[_run(engine, c) for c in choices])
    out = [_choice_object(body, tokenizer, c, done, scored) for c, (done, scored) in zip(choices, results)]
    completion_tokens = sum(done.completion_tokens for done, _ in results)
    return {**_envelope(body, entry["id"], chunk=False), "choices": out,
            "usage": usage(prompt_tokens, completion_tokens), "seed": results[0][0].seed, "step": step}


async def _scored(engine: GenerationEngine, choice: Choice) -> list[tuple[int, TokenLogprob | None]] | None:
    """An echoed prompt's tokens with their logprobs (the first None), when logprobs are asked."""
    if choice.echo is None or choice.params.logprobs is None:
        return None
    infos = await engine.score(choice.prompt, choice.params.logprobs)
    return list(zip(choice.prompt, [None, *infos]))


async def _run(engine: GenerationEngine, choice: Choice) -> tuple[Completion, list | None]:
    scored = await _scored(engine, choice)
    if choice.params.max_tokens == 0:  # echo only: the prompt scored, nothing generated
        asked = choice.params.logprobs is not None
        seed = choice.params.seed or 0
        return Completion("", "length", len(choice.prompt), 0, seed, [], [] if asked else None), scored
    return await engine.generate(choice.prompt, choice.params), scored


def _envelope(body: Request, model_id: str, chunk: bool) -> dict:
    chat = isinstance(body, ChatRequest)
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), "object": kind,
            "created": int(time.time()), "model": model_id}


def _completion_lp(tokenizer: Tokenizer, choice: Choice, scored: list | None, infos: Any, offset: int) -> dict:
    pairs = list(scored or []) + [(info.token, info) for info in infos]
    return completion_logprobs(tokenizer, pairs, offset, choice.as_ids)


def _choice_object(body: Request, tokenizer: Tokenizer, choice: Choice, done: Completion, scored: list | None) -> dict:
    out: dict[str, Any] = {"index": choice.index, "finish_reason": done.finish_reason, "logprobs": None}
    if isinstance(body, ChatRequest):
        out["message"] = {"role": "assistant", "content": done.text, "refusal": None}
        if done.logprobs is not None:
            out["logprobs"] = chat_logprobs(tokenizer, done.logprobs, choice.as_ids)
        return out
    out["text"] = (choice.echo or "") + done.text
    if done.logprobs is not None:
        start = 0 if choice.echo is not None else len(tokenizer.decode(choice.prompt))
        out["logprobs"] = _completion_lp(tokenizer, choice, scored, done.logprobs, start)
    return out


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def _choice_chunks(body: Request, tokenizer: Tokenizer, engine: GenerationEngine,
                         choice: Choice) -> AsyncIterator[tuple[dict | None, Completion | None]]:
    """One choice's chunk choices (``delta`` for chat, ``text`` for completions), then
    (None, its Completion)."""
    chat, asked = isinstance(body, ChatRequest), choice.params.logprobs is not None
    offset = 0 if choice.echo is not None else len(tokenizer.decode(choice.prompt))

    def piece(text: str, scored: list | None, infos: Any, finish: str | None = None) -> dict:
        nonlocal offset
        out: dict[str, Any] = {"index": choice.index, "finish_reason": finish, "logprobs": None}
        if chat:
            out["delta"] = {"content": text} if text else {}
            if asked and (infos or finish is None):
                out["logprobs"] = chat_logprobs(tokenizer, infos, choice.as_ids)
        else:
            out["text"] = text
            if asked:
                out["logprobs"] = _completion_lp(tokenizer, choice, scored, infos, offset)
                tokens = [t for t, _ in scored or []] + [t.token for t in infos]
                offset += sum(len(tokenizer.decode([t])) for t in tokens)
        return out

    if chat:
        yield {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
               "logprobs": None}, None
    elif choice.echo is not None:
        yield piece(choice.echo, await _scored(engine, choice), ()), None
    if choice.params.max_tokens == 0:
        yield piece("", None, (), "length"), None
        yield None, Completion("", "length", len(choice.prompt), 0, choice.params.seed or 0)
        return
    async for item in engine.stream(choice.prompt, choice.params):
        if isinstance(item, Completion):
            yield piece("", None, (), item.finish_reason), None
            yield None, item
        else:
            yield piece(item.text, None, item.logprobs), None


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators as they come; an error in one is raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.get_running_loop().create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:  # a client gone: each choice's request leaves the batch
        for task in tasks:
            task.cancel()


async def _stream(body: Request, model_id: str, tokenizer: Tokenizer, engine: GenerationEngine,
                  choices: list[Choice], prompt_tokens: int) -> AsyncIterator[str]:
    """Server-sent events: chunks per choice as text is released (each choice's first:
    chat's role, or the echoed prompt), one with each choice's finish reason, (with
    ``stream_options.include_usage``) one with the usage, then ``[DONE]``. An error after
    the first byte is sent as an event in OpenAI's error shape."""
    envelope = _envelope(body, model_id, chunk=True)
    completion_tokens = 0
    try:
        async for chunk, done in _merged([_choice_chunks(body, tokenizer, engine, c) for c in choices]):
            if done is not None:
                completion_tokens += done.completion_tokens
            else:
                yield _sse({**envelope, "choices": [chunk]})
        if body.include_usage():
            yield _sse({**envelope, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except Exception as exc:  # the status line is sent already: say it in the stream, in one line
        yield _sse(error_body(500, f"internal error: {describe_error(exc)}"))
    yield _sse("[DONE]")
