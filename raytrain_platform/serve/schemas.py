"""Request and response bodies of the HTTP API (pydantic; FastAPI publishes them as
OpenAPI at ``/docs``). Types are strict: a string where a number belongs, a float
where an integer belongs, NaN or infinity are refused, not coerced. Limits that
depend on the deployment (rows, prompt bytes, max_new_tokens) and on the model
(feature count) are checked by the endpoint.

>>> PredictRequest.model_validate({"rows": [[0.5, 1.0]]}).rows
[[0.5, 1.0]]
>>> PredictRequest.model_validate({"rows": [[float("nan")]]})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for PredictRequest
...
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = ["PredictRequest", "PredictResponse", "GenerateRequest", "GenerateResponse",
           "ModelInfo", "ModelsResponse", "HealthResponse", "BatchStats", "ErrorResponse", "ErrorDetail"]

FLOAT32_MAX = 3.4028234663852886e38  # rows become float32 tensors: larger overflows to inf


def _float32(value: float) -> float:
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{value:g} is beyond float32, the model's input type (at most 3.4e38 in size)")
    return value


Feature = Annotated[float, Field(strict=True, allow_inf_nan=False), AfterValidator(_float32)]
ModelId = Annotated[Optional[str], Field(
    None, min_length=1, max_length=128,
    description="which served model (see GET /v1/models); or the serve_multiplexed_model_id "
                "header. Optional when one model of the endpoint's kind is served")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


class PredictRequest(_Strict):
    rows: list[list[Feature]] = Field(min_length=1, description="feature rows, each as long as "
                                      "the model's num_features; at most max_batch_rows rows")
    model: ModelId = None


class PredictResponse(_Strict):
    model: str
    step: int = Field(description="the checkpoint's optimizer step")
    predictions: list[Union[int, float]] = Field(description="class index (classification) or "
                                                 "value (regression) per row")
    probabilities: Optional[list[list[float]]] = Field(description="per row, per class "
                                                       "(classification); null for regression")


class GenerateRequest(_Strict):
    prompt: str = Field(min_length=1, description="text to continue (UTF-8, byte-level model); "
                        "at most max_prompt_bytes bytes; the last block_size bytes are the context")
    max_new_tokens: int = Field(32, ge=1, description="bytes to generate; at most the deployment's "
                                "max_new_tokens (unset: 32, or that maximum where it is lower)")
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False,
                               description="0 = greedy; higher = more random")
    top_k: Optional[int] = Field(None, ge=1, le=256, description="sample among the k most likely bytes")
    seed: Optional[int] = Field(None, ge=0, lt=2**63, description="same seed, same text; "
                                "default: a random seed, returned in the response")
    model: ModelId = None

    def new_tokens(self, limit: int) -> int:
        """The bytes to generate under the deployment's `limit` (its max_new_tokens): the
        request's own max_new_tokens (the endpoint refuses one over `limit`), or where it
        set none, the default capped at `limit`.

        >>> GenerateRequest(prompt="hi").new_tokens(16)
        16
        >>> GenerateRequest(prompt="hi", max_new_tokens=20).new_tokens(16)  # refused by the endpoint
        20
        """
        return self.max_new_tokens if "max_new_tokens" in self.model_fields_set else min(self.max_new_tokens, limit)


class GenerateResponse(_Strict):
    model: str
    step: int
    text: str = Field(description="the generated continuation (bytes that are not valid UTF-8 "
                      "shown as U+FFFD)")
    new_tokens: int
    seed: int


class ModelInfo(_Strict):
    """One served model, in OpenAI's model shape (id, object, created, owned_by) plus
    what this platform knows of it."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(0, description="when the checkpoint was written, Unix seconds")
    owned_by: str = "raytrain_platform"
    model: dict = Field(description="model.name and model.kwargs from the training config")
    task: str = Field(description="classification, regression or lm")
    endpoint: str = Field(description="predict (POST /v1/predict) or generate (a language model: "
                          "POST /v1/generate, or with a tokenizer POST /v1/completions and "
                          "/v1/chat/completions)")
    inputs: dict = Field(description="what a request's input must match, from the model's family: "
                         "num_features/num_outputs (predict) or block_size/vocab_size (gpt)")
    context_len: int = Field(0, description="generate: tokens of context the model sees")
    tokenizer: Optional[str] = Field(None, description="generate: the tokenizer folder; null: UTF-8 bytes")
    kv_cache: bool = Field(False, description="generate: decoding keeps a KV cache (else the context is "
                           "re-run per token)")
    stop_token_ids: list[int] = Field(default_factory=list, description="generate: end-of-sequence tokens")
    checkpoint: str
    step: int
    metrics: dict = Field(description="the training metrics recorded with the checkpoint")
    num_params: int
    lora: Optional[dict] = Field(None, description="a LoRA run: its model.lora and base (null otherwise)")


class ModelsResponse(_Strict):
    """OpenAI's list shape (``client.models.list()`` reads it)."""

    object: Literal["list"] = "list"
    data: list[ModelInfo]


class BatchStats(_Strict):
    """How requests of one kind reached the model on one replica: each compute call
    answers every request waiting for it (dynamic batching), so `requests / calls` is
    the mean batch."""

    calls: int = Field(default=0, description="compute calls (model forwards or generation loops)")
    requests: int = Field(default=0, description="requests those calls answered")
    largest: int = Field(default=0, description="most requests answered by one call")

    def record(self, n: int) -> None:
        self.calls, self.requests, self.largest = self.calls + 1, self.requests + n, max(self.largest, n)


class HealthResponse(_Strict):
    status: str
    models: list[str] = Field(description="every served model id")
    loaded: list[str] = Field(description="ids loaded on the replica that answered (at most "
                              "max_models_per_replica: least recently used ones are unloaded)")
    batches: dict[str, BatchStats] = Field(
        default_factory=dict, description="on the replica that answered, per kind of work "
                                          "(predict, generate, decode), since it started")


class ErrorDetail(_Strict):
    message: str = Field(description="one line naming the problem and what is allowed")
    type: str = Field(description="invalid_request_error, not_found_error, server_error, ...")
    param: Optional[str] = Field(None, description="the request field at fault, if one is")
    code: Optional[str] = Field(None, description="a short code (model_not_found, context_length_exceeded, ...)")


class ErrorResponse(_Strict):
    """OpenAI's error shape, so its clients raise their typed errors."""

    error: ErrorDetail
