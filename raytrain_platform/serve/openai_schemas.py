"""Request bodies of the OpenAI-compatible endpoints (``POST /v1/completions``,
``POST /v1/chat/completions``), as the ``openai`` client, LangChain, lm-evaluation-harness
and curl recipes send them. Types are strict (a string where a number belongs is
refused); a value out of range is refused naming the field and the range; fields OpenAI
has and this server does not implement (``best_of`` > 1, ``suffix``, ``tools``) are
refused naming the field, and so is an unknown field.

Bounds: ``n`` <= `MAX_N`; a completion's ``prompt`` list holds at most `MAX_PROMPTS`
prompts; ``logprobs`` (completions) 0..5, ``top_logprobs`` (chat) 0..20; penalties
-2..2; ``logit_bias`` values -100..100.

>>> CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stop": "\\n"}).stop_strings()
('\\n',)
>>> CompletionRequest.model_validate({"model": "m", "prompt": "hi", "n": 17})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for CompletionRequest
n
  Value error, 17 is out of range: 1..16 ...
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["ChatMessage", "ChatRequest", "CompletionRequest", "JsonSchemaFormat", "MAX_N", "MAX_PROMPTS",
           "ResponseFormat", "StreamOptions"]

DEFAULT_MAX_TOKENS = 16  # a completion's max_tokens when unset or null, as OpenAI's
MAX_N = 16  # choices per prompt (each one a row of the engine's batch)
MAX_PROMPTS = 64  # prompts in one completion request (lm-evaluation-harness sends batches of them)
_RANGES = {"n": (1, MAX_N), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
           "logprobs": (0, 5), "top_logprobs": (0, 20)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


def _unicode(value: Any) -> Any:
    """Text that encodes as UTF-8: JSON's ``\\ud800`` escapes parse into lone surrogates,
    which no tokenizer can encode."""
    for text in [value] if isinstance(value, str) else (value or []):
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"not valid Unicode text (a lone surrogate at character {exc.start})") from None
    return value


def _in_range(value: Any, field: str) -> Any:
    low, high = _RANGES[field]
    if value is not None and not low <= value <= high:
        raise ValueError(f"{value!r} is out of range: {low}..{high}")
    return value


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="a last chunk with the usage counts")


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``json_object``: the answer is a JSON object; ``json_schema``: it validates
    against ``json_schema.schema`` (decoding is constrained token by token)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _with_type(cls, value: Any, info: Any) -> Any:
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("only with type: json_schema")
        return value

    def schema_text(self) -> str | None:
        """The JSON Schema to constrain to (None: plain text)."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            schema = self.json_schema.json_schema if self.json_schema else None
            return json.dumps(schema if schema is not None else {})
        return None


class _Sampling(_Strict):
    """What both endpoints share."""

    model: str | None = Field(None, min_length=1, max_length=128,
                                 description="a served model id (GET /v1/models); optional when one LM is served")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False,
                         description="sample from the smallest set of tokens holding this much probability")
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the text ends before the first")
    seed: int | None = Field(None, ge=0, lt=2**63, description="same seed, same text (choice i: seed + i)")
    stream: bool = Field(False, description="answer as server-sent events, data: {...}, then data: [DONE]")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: str | None = None
    n: int | None = Field(None, description=f"choices per prompt, 1..{MAX_N}")
    presence_penalty: float | None = Field(None, allow_inf_nan=False, description="-2..2, subtracted from the "
                                           "logit of each token already generated")
    frequency_penalty: float | None = Field(None, allow_inf_nan=False, description="-2..2, times the count of "
                                            "each token already generated, subtracted from its logit")
    logit_bias: dict[str, int | float] | None = Field(None, description="token id (as a string) -> -100..100, "
                                                      "added to its logit")
    response_format: ResponseFormat | None = None
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM's: logprobs show each token as "
                                                    "'token_id:ID'")

    @field_validator("stop", "user")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return _unicode(value)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty strings")
        return value

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, value: Any, info: Any) -> Any:
        # `stream` comes first, so it is validated already (absent from data if it failed).
        if value is not None and info.data.get("stream") is False:
            raise ValueError("only with stream: true (this request has stream: false)")
        return value

    @field_validator("n", "presence_penalty", "frequency_penalty")
    @classmethod
    def _range(cls, value: Any, info: Any) -> Any:
        return _in_range(value, info.field_name)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: Any) -> Any:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"key {key!r:.40} is not a token id (a non-negative integer as a string)")
            if not -100 <= bias <= 100:
                raise ValueError(f"token {key}: {bias!r} is out of range: -100..100")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def choices_per_prompt(self) -> int:
        return self.n or 1

    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt = Field(description="the text to continue: a string, a list of strings, token ids, or a "
                                       f"list of token-id lists (at most {MAX_PROMPTS} prompts)")
    echo: bool | None = Field(None, description="the prompt before the completion (with logprobs: its tokens' "
                                                "logprobs, the first null)")
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=0, description="tokens to generate (OpenAI's default, "
                                   "also for null: 16; 0 only with echo)")
    logprobs: int | None = Field(None, description="0..5: each token's logprob and the N most likely ones")
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        prompts = value if isinstance(value, list) and value and not isinstance(value[0], int) else [value]
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise ValueError(f"{len(prompts)} prompts; 1..{MAX_PROMPTS} per request")
        for i, prompt in enumerate(prompts):
            at = f"prompt {i}: " if len(prompts) > 1 else ""
            if not prompt:
                raise ValueError(f"{at}a non-empty string (or a non-empty list of token ids)")
            if isinstance(prompt, list) and min(prompt) < 0:
                raise ValueError(f"{at}token id {min(prompt)} is negative")
        if isinstance(prompts[0], str):
            _unicode(prompts)
        return value

    @field_validator("max_tokens")
    @classmethod
    def _zero_with_echo(cls, value: Any, info: Any) -> Any:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("0 only with echo: true (the prompt scored, nothing generated)")
        return value

    @field_validator("logprobs")
    @classmethod
    def _top(cls, value: Any) -> Any:
        return _in_range(value, "logprobs")

    @field_validator("best_of", "suffix")
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        if value is not None and not (info.field_name == "best_of" and value == 1):
            allowed = "best_of = 1" if info.field_name == "best_of" else "null"
            raise ValueError(f"{value!r:.40} is not supported (this server answers {allowed} only)")
        return value

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts: strings, or token-id lists."""
        p: Any = self.prompt
        if isinstance(p, str):
            return [p]
        return [p] if p and isinstance(p[0], int) else list(p)

    def token_limit(self) -> int:
        """max_tokens; null, as unset, is OpenAI's default (16)."""
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS

    def top_logprobs_count(self) -> int | None:
        """Alternatives per token (None: no logprobs)."""
        return self.logprobs


class _TextPart(_Strict):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return _unicode(value)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]
    name: str | None = None

    @field_validator("content", "name")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return _unicode(value) if isinstance(value, str) else value

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate (default: up to the "
                                      "deployment's max_new_tokens and the context)")
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")
    logprobs: bool | None = Field(None, description="each token's logprob (choices[].logprobs.content)")
    top_logprobs: int | None = Field(None, description="0..20 most likely tokens at each position; "
                                                       "with logprobs: true")
    tools: list[Any] | None = None
    tool_choice: Any | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, value: Any, info: Any) -> Any:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("only with logprobs: true")
        return _in_range(value, "top_logprobs")

    @field_validator("tools", "tool_choice")
    @classmethod
    def _no_tools(cls, value: Any) -> Any:
        if value and value != "none":  # no tools, or tool_choice "none": a plain answer
            raise ValueError("tool calling is not supported by this server")
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """Alternatives per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None
