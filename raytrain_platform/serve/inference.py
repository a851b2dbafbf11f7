"""The math behind the endpoints, batched: class probabilities or values for tabular
rows, and byte-level sampling for byte-level LMs (gpt). Plain torch, no Serve; requests arrive here
already checked.

>>> import torch
>>> from raytrain_platform.models.gpt import GPT
>>> from raytrain_platform.models.specs import GPTSpec
>>> gpt = GPT(GPTSpec(n_layer=1, n_head=2, n_embd=16, block_size=8)).eval()
>>> job = GenerationJob(prompt=b"hi", max_new_tokens=5, temperature=1.0, top_k=None, seed=7)
>>> generate(gpt, [job, job], context_len=8)[0] == generate(gpt, [job], context_len=8)[0]  # same seed
True
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Prediction", "predict", "GenerationJob", "generate", "tempered"]


@dataclass(frozen=True)
class Prediction:
    predictions: list | None  # class index per row (classification) or value (regression); None: not finite
    probabilities: list[list[float]] | None  # per row, per class (classification only)
    error: Exception | None = None  # the forward of this request's width failed (a user model's unknown width)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def predict(model: nn.Module, requests: list[list[list[float]]], *, classification: bool) -> list[Prediction]:
    """One forward over the rows of every request (a dynamic batch) of each row width,
    split back per request. Widths differ only for a model whose width is unknown (each
    request's rows are checked to share one): a width it refuses fails its requests only."""
    by_width: dict[int, list[int]] = defaultdict(list)
    for i, rows in enumerate(requests):
        by_width[len(rows[0])].append(i)
    results: list[Prediction] = [Prediction(None, None)] * len(requests)
    for members in by_width.values():
        try:
            x = torch.tensor([row for i in members for row in requests[i]], dtype=torch.float32,
                             device=_device(model))  # (sum of rows, F)
            out = model(x).float().cpu()
        except Exception as exc:
            for i in members:
                results[i] = Prediction(None, None, error=exc)
            continue
        for i, part in zip(members, torch.split(out, [len(requests[i]) for i in members])):
            results[i] = _prediction(part, classification)
    return results


def _prediction(part: torch.Tensor, classification: bool) -> Prediction:
    if not bool(torch.isfinite(part).all()):  # inputs the model overflows on: this request only
        return Prediction(None, None)
    if classification:
        probs = torch.softmax(part, dim=-1)
        return Prediction(probs.argmax(-1).tolist(), probs.tolist())
    return Prediction(part.tolist(), None)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Float32 logits / `temperature` (> 0), each row shifted to a max of 0 first, in
    float64: a tiny temperature then sends the max to 0 and the rest to -inf (softmax:
    the argmax) instead of overflowing to inf (softmax: NaN). The shift leaves softmax
    as it was; float64, because float32 rounds a temperature under 1e-45 to 0 (0 / 0)."""
    shifted = logits.double() - logits.max(dim=-1, keepdim=True).values.double()
    return (shifted / temperature).float()


@dataclass(frozen=True)
class GenerationJob:
    prompt: bytes  # at least one byte
    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_k: int | None
    seed: int


def _sample(logits: torch.Tensor, job: GenerationJob, generator: torch.Generator) -> int:
    """One token from (vocab,) logits: greedy at temperature 0, else top-k sampling
    with the request's own generator (so its draws do not depend on the batch)."""
    if job.temperature == 0:
        return int(logits.argmax())
    logits = tempered(logits, job.temperature)
    if job.top_k is not None and job.top_k < logits.numel():
        kth = torch.topk(logits, job.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.inference_mode()
def generate(model: nn.Module, jobs: list[GenerationJob], *, context_len: int | None = None) -> list[bytes]:
    """Continue each prompt by its ``max_new_tokens`` bytes. Each step runs one forward
    per group of sequences of equal context length (no padding, so no mask needed); the
    context is the last `context_len` bytes (the model family's serving context; None:
    all of it)."""
    block_size = context_len or 1 << 62
    seqs = [list(job.prompt) for job in jobs]
    outs: list[list[int]] = [[] for _ in jobs]
    generators = [torch.Generator().manual_seed(job.seed) for job in jobs]
    active = [i for i, job in enumerate(jobs) if job.max_new_tokens > 0]
    while active:
        groups: dict[int, list[int]] = defaultdict(list)
        for i in active:
            groups[min(len(seqs[i]), block_size)].append(i)
        for length, members in groups.items():
            context = torch.tensor([seqs[i][-length:] for i in members], device=_device(model))
            logits = model(context)[:, -1, :].float().cpu()  # (n, vocab): the next byte
            for row, i in enumerate(members):
                token = _sample(logits[row], jobs[i], generators[i])
                seqs[i].append(token)
                outs[i].append(token)
        active = [i for i in active if len(outs[i]) < jobs[i].max_new_tokens]
    return [bytes(out) for out in outs]
