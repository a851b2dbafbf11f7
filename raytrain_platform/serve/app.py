"""The Serve deployment: a FastAPI ingress over the served checkpoints, with dynamic
batching (``serve.batch``) and model multiplexing (``serve.multiplexed``, LRU-bounded
per replica).

    POST /v1/completions        LMs, OpenAI's completions (stream: true = server-sent events)
    POST /v1/chat/completions   LMs with a chat template, OpenAI's chat completions
    POST /v1/predict    tabular models: feature rows -> predictions (+ class probabilities)
    POST /v1/generate   byte-level LMs: prompt -> generated text (same seed, same text)
    GET  /v1/models     OpenAI's model list, plus each model's config, step and training metrics
    GET  /v1/models/ID  one of them (OpenAI's model retrieval)
    GET  /healthz       liveness (with API keys: the models only to a request with a key)
    GET  /docs          OpenAPI

Started with API keys (``rtp serve --api-key``, serve/auth.py), every ``/v1/`` route
needs ``Authorization: Bearer KEY``, else a 401 in OpenAI's shape.

A request names its model with the ``model`` field or the ``serve_multiplexed_model_id``
header (which Serve also routes by: to a replica that has the model loaded); without
one, the only model served at that endpoint answers (each model's family says which). Models load on a replica when first
asked for; compute runs on one thread per replica, off the event loop, so the loop keeps
accepting (and batching) requests meanwhile. The OpenAI endpoints generate through one
`GenerationEngine` per loaded LM (continuous batching, a KV cache where the family's
forward keeps one); errors have OpenAI's shape.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' body types from
# real annotations (as strings, under serve.ingress, they turn into query parameters).
import asyncio
import logging
import secrets
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from ray import serve

from fastapi import Request
from fastapi.responses import StreamingResponse

from raytrain_platform._version import __version__
from raytrain_platform.models.registry import get_family
from raytrain_platform.serve import openai_api
from raytrain_platform.serve.adapters import SharedBases
from raytrain_platform.serve.auth import is_authorized
from raytrain_platform.serve.catalog import load_served_model
from raytrain_platform.serve.coalesce import Coalescer
from raytrain_platform.serve.http import ERROR_RESPONSES, error, make_api
from raytrain_platform.serve import inference
from raytrain_platform.serve.engine import GenerationEngine
from raytrain_platform.serve.inference import GenerationJob, Prediction
from raytrain_platform.serve.openai_schemas import ChatRequest, CompletionRequest
from raytrain_platform.serve.options import ServeOptions
from raytrain_platform.serve.text import Tokenizer, load_tokenizer
from raytrain_platform.serve.schemas import (BatchStats, GenerateRequest, GenerateResponse, HealthResponse, ModelInfo,
                                             ModelsResponse, PredictRequest, PredictResponse)

__all__ = ["ModelServer", "api"]

api = make_api("raytrain_platform models", __version__)
_ROUTE = {"predict": "POST /v1/predict", "generate": "POST /v1/completions, /v1/chat/completions or /v1/generate"}


def _check_rows(entry: dict, rows: list[list[float]], *, max_rows: int) -> None:
    """Rows as long as the model's input; for a user model whose family cannot tell the
    width, at least one width per request (its rows become one tensor)."""
    if len(rows) > max_rows:
        raise error(422, f"rows: {len(rows)} rows; at most {max_rows} per request (max_batch_rows)")
    expected = entry["inputs"]["num_features"]
    if expected is None:
        if not rows[0]:
            raise error(422, "rows.0: 0 features; at least 1")
        for i, row in enumerate(rows):
            if len(row) != len(rows[0]):
                raise error(422, f"rows.{i}: {len(row)} features; rows.0 has {len(rows[0])} (every row of "
                                 "a request needs the same count)")
        return
    for i, row in enumerate(rows):
        if len(row) != expected:
            raise error(422, f"rows.{i}: {len(row)} features; model {entry['id']!r} expects {expected}")


class _ConcurrentBatchesWarning(logging.Filter):
    """Drops Serve's warning that max_batch_size x max_concurrent_batches exceeds
    max_ongoing_requests (so not every batch can be full at once): by design here, the
    batches are many small ones that the coalescer merges."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "max_concurrent_batches" not in record.getMessage()


def _quiet_concurrent_batches_warning() -> None:
    serve_logger = logging.getLogger("ray.serve")  # the logger Serve's batcher warns on
    if not any(isinstance(f, _ConcurrentBatchesWarning) for f in serve_logger.filters):
        serve_logger.addFilter(_ConcurrentBatchesWarning())


class _Loaded:
    """A model in a replica's multiplexing cache. Serve calls ``__del__`` when its LRU
    policy unloads it, which keeps `loaded` (what /healthz reports) exact."""

    def __init__(self, model_id: str, module: torch.nn.Module, loaded: set[str],
                 tokenizer: Optional[Tokenizer] = None, engine: Optional[GenerationEngine] = None):
        self.model_id, self.module, self._loaded, self._unloaded = model_id, module, loaded, False
        self.tokenizer, self.engine = tokenizer, engine  # LMs: the OpenAI endpoints' generation
        loaded.add(model_id)

    def __del__(self) -> None:
        if not self._unloaded:  # Serve calls it on unload, the garbage collector again later
            self._unloaded = True
            self._loaded.discard(self.model_id)


@serve.deployment
@serve.ingress(api)
class ModelServer:
    """One replica: the catalog (plain data, from the driver) and up to
    ``max_models_per_replica`` loaded models."""

    def __init__(self, catalog: dict[str, dict], options: ServeOptions):
        self.catalog, self.options = catalog, options
        api.state.max_body_bytes = options.max_body_bytes
        api.state.api_key_digests = options.api_key_digests  # http.ApiKeyCheck: /v1/ needs one of them
        self.device = torch.device("cuda" if options.use_gpu else "cpu")
        # Set in the compute thread itself: torch's intra-op thread count is per thread, and
        # a default-sized pool spinning next to the event loop starves it of the CPU.
        threads = max(1, int(options.cpus_per_replica))
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-compute",
                                           initializer=torch.set_num_threads, initargs=(threads,))
        self.loaded: set[str] = set()
        self.batches: dict[str, BatchStats] = defaultdict(BatchStats)  # per kind, /healthz shows them
        # LoRA runs: one base per replica, each run's adapters on it. A run's adapters are
        # dropped once nothing holds its module, on the compute thread (the only one that
        # runs the shared modules).
        self.bases = SharedBases(self.device, defer=lambda fn, *args: self._compute.submit(fn, *args))

        async def load_model(model_id: str) -> _Loaded:
            module = await self._run(self._load, model_id)
            entry = self.catalog[model_id]
            if entry["endpoint"] != "generate":
                return _Loaded(model_id, module, self.loaded)
            tokenizer = await self._run(load_tokenizer, entry["tokenizer"])
            engine = GenerationEngine(module, tokenizer, kv_cache=entry["kv_cache"],
                                      logits_of=get_family(entry["model"]["name"]).logits,
                                      context_len=entry["context_len"], max_batch=options.max_batch_size,
                                      run=self._run, on_step=self.batches["decode"].record)
            return _Loaded(model_id, module, self.loaded, tokenizer, engine)

        # Decorated here, not on the class, so the LRU bound is this deployment's option.
        self.get_model = serve.multiplexed(max_num_models_per_replica=options.max_models_per_replica)(load_model)
        self._coalescer = Coalescer(self._grouped, max_items=options.max_batch_size)
        # Serve's dynamic batcher, per deployment. Every batch it forms goes on to the
        # coalescer at once (at most one batch per request in flight): with Serve's default
        # of one batch at a time, the batches formed while the compute thread is busy (a
        # request or two each) would wait their turn and compute one by one, unmerged.
        batching = serve.batch(max_batch_size=options.max_batch_size,
                               batch_wait_timeout_s=options.batch_wait_timeout_s,
                               max_concurrent_batches=options.max_ongoing_requests)
        self._predict_batch = batching(self._coalesced("predict"))
        self._generate_batch = batching(self._coalesced("generate"))
        _quiet_concurrent_batches_warning()

    async def _run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def _load(self, model_id: str) -> torch.nn.Module:
        if self.catalog[model_id].get("lora"):  # adapters over the base this replica loads once
            return self.bases.load(model_id, self.catalog[model_id]["checkpoint"],
                                   trust_builder=self.options.trust_builder)
        model, _ = load_served_model(model_id, self.catalog[model_id]["checkpoint"],
                                     trust_builder=self.options.trust_builder)
        return model.to(self.device)

    # ---- requests -> a checked model entry -------------------------------------------------
    def _resolve(self, field_id: Optional[str], endpoint: str) -> dict:
        """The catalog entry a request names (or the only one this `endpoint` serves)."""
        header_id = serve.get_multiplexed_model_id()
        if field_id and header_id and field_id != header_id:
            raise error(400, f"model field {field_id!r} and serve_multiplexed_model_id header "
                             f"{header_id!r} differ; give one")
        model_id = field_id or header_id
        known = ", ".join(self.catalog)
        if not model_id:
            of_kind = [m for m in self.catalog.values() if m["endpoint"] == endpoint]
            if len(of_kind) != 1:
                families = "/".join(sorted({m["model"]["name"] for m in of_kind}))
                raise error(400 if of_kind else 404,
                            f"{len(of_kind)} {families + ' ' if families else ''}models served for "
                            f"{_ROUTE[endpoint]}: name one with the model field or the "
                            f"serve_multiplexed_model_id header; known ids: {known}")
            return of_kind[0]
        entry = self.catalog.get(model_id)
        if entry is None:
            raise error(404, f"unknown model id {model_id!r}; known ids: {known}", param="model",
                        code="model_not_found")
        if entry["endpoint"] != endpoint:
            raise error(400, f"model {model_id!r} is a {entry['model']['name']} model: use "
                             f"{_ROUTE[entry['endpoint']]}", param="model")
        return entry

    def _job(self, body: GenerateRequest) -> GenerationJob:
        prompt = body.prompt.encode("utf-8")  # the schema refuses lone surrogates
        if len(prompt) > self.options.max_prompt_bytes:
            raise error(422, f"prompt: {len(prompt)} UTF-8 bytes; at most {self.options.max_prompt_bytes} "
                             "(max_prompt_bytes)")
        new_tokens = body.new_tokens(self.options.max_new_tokens)  # unset: within the limit
        if new_tokens > self.options.max_new_tokens:
            raise error(422, f"max_new_tokens: {new_tokens}; at most "
                             f"{self.options.max_new_tokens} (the deployment's max_new_tokens)")
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        return GenerationJob(prompt, new_tokens, body.temperature, body.top_k, seed)

    async def _submit(self, batched: Callable, kind: str, item: tuple) -> Any:
        """Through the dynamic batcher, or (max_batch_size 1) straight to the compute thread."""
        if self.options.max_batch_size > 1:
            return await batched(item)
        return (await self._grouped(kind, [item]))[0]

    # ---- batched compute --------------------------------------------------------------------
    def _predict_compute(self, model_id: str, model: torch.nn.Module, rows: list) -> list[Prediction]:
        classification = self.catalog[model_id]["task"] == "classification"
        return inference.predict(model, rows, classification=classification)

    def _generate_compute(self, model_id: str, model: torch.nn.Module, jobs: list) -> list[bytes]:
        return inference.generate(model, jobs, context_len=self.catalog[model_id]["context_len"])

    async def _grouped(self, kind: str, items: list[tuple[str, Any]]) -> list:
        """One compute call per model among `items` (``(model_id, payload)``), on the
        compute thread; results in item order."""
        compute = self._predict_compute if kind == "predict" else self._generate_compute
        self.batches[kind].record(len(items))
        groups: dict[str, list[int]] = defaultdict(list)
        for i, (model_id, _) in enumerate(items):
            groups[model_id].append(i)
        models = {model_id: (await self.get_model(model_id)).module for model_id in groups}

        def run_all() -> list:
            results: list = [None] * len(items)
            for model_id, members in groups.items():
                outs = compute(model_id, models[model_id], [items[i][1] for i in members])
                for i, out in zip(members, outs):
                    results[i] = out
            return results

        return await self._run(run_all)

    def _coalesced(self, kind: str) -> Callable:
        """The batch function for `kind`: a batch Serve formed -> the coalescer, so
        batches formed while the compute thread was busy run as one."""

        async def batch(items: list[tuple[str, Any]]) -> list:
            return await self._coalescer.submit(kind, items)

        return batch

    # ---- endpoints --------------------------------------------------------------------------
    @api.post("/v1/predict", response_model=PredictResponse, responses=ERROR_RESPONSES)
    async def predict(self, body: PredictRequest) -> PredictResponse:
        """Predictions for feature rows (tabular models): class and class probabilities, or a value."""
        entry = self._resolve(body.model, "predict")
        _check_rows(entry, body.rows, max_rows=self.options.max_batch_rows)
        out = await self._submit(self._predict_batch, "predict", (entry["id"], body.rows))
        if out.error is not None:  # the model failed on this request's rows (and only on them)
            raise out.error
        if out.predictions is None:
            raise error(422, "rows: the model's output is not finite for these rows (inputs too large "
                             "for it?); nothing was predicted")
        return PredictResponse(model=entry["id"], step=entry["step"], predictions=out.predictions,
                               probabilities=out.probabilities)

    @api.post("/v1/generate", response_model=GenerateResponse, responses=ERROR_RESPONSES)
    async def generate(self, body: GenerateRequest) -> GenerateResponse:
        """Continue a prompt byte by byte (byte-level LMs); the same seed gives the same text."""
        entry = self._resolve(body.model, "generate")
        if entry["tokenizer"] is not None:
            raise error(400, f"model {entry['id']!r} reads text with its tokenizer; /v1/generate takes "
                             "byte-level models: use POST /v1/completions", param="model")
        job = self._job(body)
        out = await self._submit(self._generate_batch, "generate", (entry["id"], job))
        return GenerateResponse(model=entry["id"], step=entry["step"], seed=job.seed,
                                text=out.decode("utf-8", errors="replace"), new_tokens=len(out))

    async def _openai(self, body: Any) -> Any:
        """A completion or chat completion: whole, or streamed as server-sent events."""
        entry = self._resolve(body.model, "generate")
        loaded = await self.get_model(entry["id"])
        result = await openai_api.answer(body, entry, loaded.tokenizer, loaded.engine,
                                         max_new_tokens=self.options.max_new_tokens, step=entry["step"])
        if body.stream:
            return StreamingResponse(result, media_type="text/event-stream")
        return result

    @api.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(self, body: CompletionRequest) -> Any:
        """OpenAI's completions: continue `prompt` (``stream: true`` for server-sent events)."""
        return await self._openai(body)

    @api.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(self, body: ChatRequest) -> Any:
        """OpenAI's chat completions, through the model's chat template."""
        return await self._openai(body)

    @api.get("/v1/models", response_model=ModelsResponse)
    async def models(self) -> ModelsResponse:
        """OpenAI's model list; each model with its config, checkpoint step and training metrics."""
        return ModelsResponse(data=[ModelInfo(**entry) for entry in self.catalog.values()])

    @api.get("/v1/models/{model_id:path}", response_model=ModelInfo, responses=ERROR_RESPONSES)  # ids hold "/"
    async def model(self, model_id: str) -> ModelInfo:
        """OpenAI's model retrieval: one served model, as the list shows it."""
        entry = self.catalog.get(model_id)
        if entry is None:
            raise error(404, f"unknown model id {model_id!r}; known ids: {', '.join(self.catalog)}",
                        param="model", code="model_not_found")
        return ModelInfo(**entry)

    @api.get("/healthz", response_model=HealthResponse)
    async def healthz(self, request: Request) -> HealthResponse:
        """Liveness; with API keys, the models and batches only to a request carrying one."""
        keys = self.options.api_key_digests
        if keys and not is_authorized(request.headers.get("authorization"), keys):
            return HealthResponse(status="ok", models=[], loaded=[])
        return HealthResponse(status="ok", models=list(self.catalog), loaded=sorted(self.loaded),
                              batches=dict(self.batches))
