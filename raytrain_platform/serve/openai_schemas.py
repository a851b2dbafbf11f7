"""Request bodies of the OpenAI-compatible endpoints (``POST /v1/completions``,
``POST /v1/chat/completions``), as the ``openai`` client, LangChain and curl recipes
send them. Types are strict (a string where a number belongs is refused). Fields that
OpenAI has and this server does not implement are accepted at their neutral value
(penalties 0, ``n`` 1, no ``logit_bias``, ...) and refused otherwise, naming the field;
an unknown field is refused.

>>> CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stop": "\\n"}).stop_strings()
('\\n',)
>>> CompletionRequest.model_validate({"model": "m", "prompt": "hi", "n": 2})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for CompletionRequest
n
  Value error, 2 is not supported (this server answers n = 1 only) ...
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["ChatMessage", "ChatRequest", "CompletionRequest", "StreamOptions"]

DEFAULT_MAX_TOKENS = 16  # a completion's max_tokens when unset or null, as OpenAI's
_NEUTRAL = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False}


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


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="a last chunk with the usage counts")


class _Sampling(_Strict):
    """What both endpoints share."""

    model: str | None = Field(None, min_length=1, max_length=128,
                                 description="a served model id (GET /v1/models); optional when one LM is served")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False,
                         description="sample from the smallest set of tokens holding this much probability")
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the text ends before the first")
    seed: int | None = Field(None, ge=0, lt=2**63, description="same seed, same text")
    stream: bool = Field(False, description="answer as server-sent events, data: {...}, then data: [DONE]")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: str | None = None
    # OpenAI fields accepted at their neutral value only.
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: Any | None = None

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

    @field_validator("n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs")
    @classmethod
    def _neutral(cls, value: Any, info: Any) -> Any:
        neutral = _NEUTRAL.get(info.field_name)
        if value is not None and value != neutral and not (value == {} or value is False):
            allowed = f"{info.field_name} = {neutral}" if neutral is not None else "null"
            raise ValueError(f"{value!r} is not supported (this server answers {allowed} only)")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(description="the text to continue (one string, or a list of one)")
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1, description="tokens to generate (OpenAI's default, "
                                   "also for null: 16)")
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"one prompt (a string or a list of one string); got a list of {len(value)}")
        text = value[0] if isinstance(value, list) else value
        if not text:
            raise ValueError("a non-empty string")
        return _unicode(value)

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        neutral = _NEUTRAL.get(info.field_name)
        if value is not None and value != neutral:
            allowed = f"{info.field_name} = {neutral}" if neutral is not None else "null"
            raise ValueError(f"{value!r} is not supported (this server answers {allowed} only)")
        return value

    def prompt_text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    def token_limit(self) -> int:
        """max_tokens; null, as unset, is OpenAI's default (16)."""
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS


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

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
