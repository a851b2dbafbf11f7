"""Continuous batching of generation inside a replica: one `GenerationEngine` per loaded
LM, an asyncio scheduler that joins every request in flight into one forward per step.

Each step (on the replica's compute thread, so the event loop keeps accepting
requests): one decode forward for the rows already running, one prefill forward for the
requests that arrived since (at most ``max_batch`` rows in all), then a token sampled
per row. Between steps, finished rows leave and waiting requests join, so a request
never waits for another to finish (vLLM's and TGI's continuous batching, at the
granularity of one token).

Sampling is per request: ``logit_bias`` and the presence/frequency penalties (OpenAI's:
``bias - count * frequency - (count > 0) * presence``, counting the tokens this request
generated) are added to its logits, a ``response_format`` grammar masks them
(`raytrain_platform.serve.structured`, one matcher per request), then temperature
(0 = greedy), top_p, and a ``torch.Generator``
seeded by the request, drawing one uniform number per token and taking the token where
it falls in the cumulative distribution. The draws do not depend on the batch, so the
same seed gives the same text whatever else is running (the batch shapes change the
logits only in the last bits of float32, which moves a draw only if it falls within
that distance of a boundary).

Logprobs (when a request asks) are the model's own: the log-softmax of its logits
before bias, penalties, grammar and temperature (vLLM's default), for the token sampled
and the ``logprobs`` most likely ones. `GenerationEngine.score` gives the prompt's own
(for ``echo``) from one forward over it.

>>> import asyncio, torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> from raytrain_platform.serve.text import ByteTokenizer
>>> torch.manual_seed(0) and None
>>> cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
>>> llama = LlamaForCausalLM(cfg).eval()
>>> async def demo():
...     engine = GenerationEngine(llama, ByteTokenizer(), kv_cache=True, logits_of=lambda o: o.logits)
...     ask = lambda seed: engine.generate(list(b"hi"), SamplingParams(max_tokens=6, temperature=1.0, seed=seed))
...     return await asyncio.gather(ask(1), ask(2), ask(1))
>>> a, b, c = asyncio.run(demo())
>>> a.text == c.text, a.completion_tokens, a.finish_reason
(True, 6, 'length')
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from raytrain_platform.serve.decode import KVCacheBatch, RecomputeBatch
from raytrain_platform.serve.inference import tempered
from raytrain_platform.serve.text import ByteTokenizer, TextStream, Tokenizer

__all__ = ["Completion", "Delta", "GenerationEngine", "SamplingParams", "TokenLogprob", "sample_next"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # None: a random one (`Completion.seed` says which)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # alternatives reported per token; None: no logprobs
    grammar: Any = None  # a compiled grammar (structured.JsonGrammars.compile); None: free text

    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.grammar is not None)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # the model's log-softmax (before bias, penalties, grammar, temperature)
    top: tuple[tuple[int, float], ...]  # the most likely (id, logprob), most likely first


@dataclass(frozen=True)
class Delta:
    """Text released by a request's stream, and the logprobs of the tokens since the last."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" (a stop string or end-of-sequence token) | "length"
    prompt_tokens: int
    completion_tokens: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when asked


def adjusted(logits: torch.Tensor, params: SamplingParams, counts: dict[int, int], constraint: Any) -> torch.Tensor:
    """(vocab,) logits with `params`' logit bias and penalties (OpenAI's formula over
    `counts`, the tokens generated so far) added, and `constraint`'s mask applied."""
    out = logits.clone()
    if params.logit_bias:
        biased, bias = zip(*params.logit_bias)
        out[list(biased)] += torch.tensor(bias, dtype=out.dtype)
    if counts and (params.presence_penalty or params.frequency_penalty):
        ids = list(counts)
        count = torch.tensor([counts[i] for i in ids], dtype=out.dtype)
        out[ids] -= count * params.frequency_penalty + params.presence_penalty
    if constraint is not None:
        constraint.mask(out)
    return out


def token_logprobs(logits: torch.Tensor, chosen: list[int], top: int) -> list[TokenLogprob]:
    """Per row of (rows, vocab) logits: the log-softmax of token `chosen[row]` and the
    `top` most likely tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, torch.tensor(chosen)[:, None])[:, 0].tolist()
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1) if top else (logp[:, :0], logp[:, :0].long())
    return [TokenLogprob(token, lp, tuple(zip(i, v))) for token, lp, i, v in
            zip(chosen, picked, ids.tolist(), values.tolist())]


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from (vocab,) logits: greedy at temperature 0; else one uniform draw
    from `generator` placed in the cumulative distribution (after top_p filtering)."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(tempered(logits, params.temperature), dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        sorted_probs[before >= params.top_p] = 0.0  # the nucleus: smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    cdf = probs.cumsum(0)
    draw = torch.rand((), generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, draw, right=True).clamp(max=len(cdf) - 1))


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    stream: TextStream
    seed: int
    generator: torch.Generator
    constraint: Any = None  # its own grammar state (structured.Constraint)
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta pieces, then a Completion
    generated: int = 0
    cancelled: bool = False
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> times (the penalties)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    unsent: int = 0  # logprobs not yet sent with a Delta


class GenerationEngine:
    """The scheduler of one model: `generate` / `stream` put a request in, the loop
    (started on demand, ended when idle) runs steps until every request is done."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, *, kv_cache: bool,
                 logits_of: Callable[[Any], torch.Tensor], context_len: int = 0, max_batch: int = 32,
                 run: Callable[..., Awaitable[Any]] | None = None, pad_id: int = 0,
                 on_step: Callable[[int], None] | None = None):
        self.tokenizer, self.max_batch, self.context_len = tokenizer, max_batch, context_len
        if kv_cache:
            self.batch: KVCacheBatch | RecomputeBatch = KVCacheBatch(model, logits_of=logits_of, pad_id=pad_id)
        else:
            self.batch = RecomputeBatch(model, logits_of=logits_of, context_len=context_len)
        self.kv_cache = kv_cache
        self.vocab_size = _vocab_size(model, tokenizer)
        self._grammars: Any = None  # structured.JsonGrammars, made on the first response_format
        self._run = run or _inline
        self._on_step = on_step or (lambda rows: None)  # rows per forward step, for /healthz
        self.running: list[_Request] = []  # rows of self.batch, in order
        self.waiting: list[_Request] = []
        self._loop: asyncio.Task | None = None
        self.steps = 0  # forwards run (a step = one decode and/or one prefill)
        self.largest_batch = 0

    # ---- requests in ---------------------------------------------------------------------
    def _add(self, prompt: list[int], params: SamplingParams) -> _Request:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        constraint = None
        if params.grammar is not None:
            from raytrain_platform.serve.structured import Constraint

            assert self.vocab_size is not None  # openai_api refuses response_format otherwise
            constraint = Constraint(params.grammar, self.vocab_size)
        request = _Request(prompt, params, TextStream(self.tokenizer, params.stop, prompt), seed,
                           torch.Generator().manual_seed(seed), constraint)
        self.waiting.append(request)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._schedule())
        return request

    async def stream(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Delta | Completion]:
        """Text deltas as they become final (with their tokens' logprobs, when asked),
        then the `Completion`. Leaving early
        (a client gone) takes the request out at the next step."""
        request = self._add(prompt, params)
        try:
            while True:
                item = await request.deltas.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Completion):
                    return
        finally:
            request.cancelled = True

    async def generate(self, prompt: list[int], params: SamplingParams) -> Completion:
        async for item in self.stream(prompt, params):
            if isinstance(item, Completion):
                return item
        raise RuntimeError("generation ended without a result")  # not reached

    def grammars(self, hf_tokenizer: Any, stop_token_ids: list[int]) -> Any:
        """This model's `structured.JsonGrammars` (xgrammar's compiler over its vocabulary)."""
        if self._grammars is None:
            from raytrain_platform.serve.structured import JsonGrammars

            assert self.vocab_size is not None
            self._grammars = JsonGrammars(hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids)
        return self._grammars

    async def score(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """The logprobs of the prompt's tokens after the first (one forward over it, on
        the compute thread, between steps), each with its `top` most likely tokens."""
        def run() -> list[TokenLogprob]:
            logits = self.batch.score(prompt)  # (len(prompt), vocab): position i predicts i + 1
            return token_logprobs(logits[:-1], prompt[1:], top)

        return await self._run(run) if len(prompt) > 1 else []

    # ---- the loop --------------------------------------------------------------------------
    async def _schedule(self) -> None:
        while self.running or self.waiting:
            room = self.max_batch - len(self.running)
            joining = [r for r in self.waiting if not r.cancelled][:room]
            self.waiting = [r for r in self.waiting if not r.cancelled and r not in joining]
            try:
                tokens = await self._run(self._step, joining)
            except Exception as exc:  # every request in the step gets the error; the loop goes on
                for request in self.running + joining:
                    request.deltas.put_nowait(exc)
                self.running = []
                self.batch.select([])
                continue
            self.running += joining
            self.largest_batch = max(self.largest_batch, len(self.running))
            self._on_step(len(self.running))
            keep = [i for i, (request, (token, info)) in enumerate(zip(self.running, tokens))
                    if not self._deliver_or_fail(request, token, info)]
            if len(keep) < len(self.running):
                self.running = [self.running[i] for i in keep]
                self.batch.select(keep)

    def _step(self, joining: list[_Request]) -> list[tuple[int, TokenLogprob | None]]:
        """Compute thread: decode the running rows, prefill the joining ones, sample;
        each row's token and (when asked) its logprobs."""
        parts = []
        if self.running:
            parts.append(self.batch.decode())
        if joining:
            parts.append(self.batch.prefill([r.prompt for r in joining]))
        logits = torch.cat(parts).cpu()
        self.steps += 1
        requests = self.running + joining
        tokens = []
        for i, r in enumerate(requests):
            row = adjusted(logits[i], r.params, r.counts, r.constraint) if r.params.adjusts_logits() else logits[i]
            tokens.append(sample_next(row, r.params, r.generator))
            if r.constraint is not None:
                r.constraint.accept(tokens[-1])
        self.batch.advance(tokens)
        asking = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        infos: list[TokenLogprob | None] = [None] * len(requests)
        if asking:  # one log-softmax over the rows that asked
            top = max(requests[i].params.logprobs or 0 for i in asking)
            for i, info in zip(asking, token_logprobs(logits[asking], [tokens[i] for i in asking], top)):
                n = requests[i].params.logprobs or 0
                infos[i] = info if n == top else TokenLogprob(info.token, info.logprob, info.top[:n])
        return list(zip(tokens, infos))

    def _deliver_or_fail(self, request: _Request, token: int, info: TokenLogprob | None) -> bool:
        """`_deliver`, but its error (a token the tokenizer cannot decode) ends this
        request only: the loop, and every other request in it, goes on."""
        try:
            return self._deliver(request, token, info)
        except Exception as exc:
            request.deltas.put_nowait(exc)
            return True

    def _deliver(self, request: _Request, token: int, info: TokenLogprob | None) -> bool:
        """Hand `token`'s text to the request; True when the request is done."""
        if request.cancelled:
            return True
        request.generated += 1
        request.counts[token] = request.counts.get(token, 0) + 1
        request.token_ids.append(token)
        if info is not None:
            request.logprobs.append(info)
        finish = None
        if token in request.params.stop_token_ids:
            finish = "stop"
        else:
            delta = request.stream.push(token)
            if delta:
                self._send(request, delta)
            if request.stream.stopped:
                finish = "stop"
        total = len(request.prompt) + request.generated
        if finish is None and (request.generated >= request.params.max_tokens
                               or (self.kv_cache and self.context_len and total >= self.context_len)):
            finish = "length"
        if finish is None:
            return False
        rest = request.stream.finish()
        if rest or request.unsent < len(request.logprobs):
            self._send(request, rest)
        asked = request.params.logprobs is not None
        request.deltas.put_nowait(Completion(request.stream.text, finish, len(request.prompt), request.generated,
                                             request.seed, request.token_ids, request.logprobs if asked else None))
        return True

    @staticmethod
    def _send(request: _Request, text: str) -> None:
        """A `Delta`: the text, and the logprobs of the tokens since the last one sent."""
        request.deltas.put_nowait(Delta(text, tuple(request.logprobs[request.unsent:])))
        request.unsent = len(request.logprobs)


def _vocab_size(model: nn.Module, tokenizer: Tokenizer) -> int | None:
    """The ids a request may name (prompt ids, ``logit_bias`` keys): the model config's
    ``vocab_size`` (Hugging Face); 256 for a byte-level tokenizer (no other id decodes);
    None when neither tells."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    return 256 if isinstance(tokenizer, ByteTokenizer) else None


async def _inline(fn: Callable, *args: Any) -> Any:
    return fn(*args)
