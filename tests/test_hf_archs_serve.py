"""Serving every architecture of the matrix (tests/hf_archs.py): a Hugging Face folder
loaded the way `rtp serve` loads it (`export.load_hf_directory`: the hf family's checks,
its build, the safetensors loader), generating through the KV-cache engine with requests
joining a running batch, equals ``transformers``' own greedy ``generate`` token for token.
Ray-free: the engine is the replica's, without Serve around it."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from hf_archs import ARCHS, make_arch

from raytrain_platform.inference import load_hf_directory
from raytrain_platform.serve.engine import GenerationEngine, SamplingParams
from raytrain_platform.serve.text import HFTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.timeout(300)

PROMPTS = ["def main():", "import os\n", "The quick brown fox jumps over the lazy dog", "class Foo:\n    def"]
LENGTHS = [10, 6, 8, 12]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from raytrain_platform.tools.tiny_llm import make_tokenizer

    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    return out


def _reference(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_engine_generates_what_transformers_generates(tmp_path, tokenizer_dir, arch):
    """Greedy, 4 prompts of different lengths through a batch of at most 2 rows (rows
    leave and join mid-flight, left-padded together), each equal to `generate` alone."""
    from transformers import AutoModelForCausalLM

    # Weights scaled up so that greedy choices are decided by clear margins, not by the
    # last bits of a near-uniform random model's logits.
    path = make_arch(tmp_path / arch, arch, tokenizer_dir, initializer_range=0.2)
    reference = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    model, info = load_hf_directory(path)
    assert info["model"]["name"] == "hf" and type(model) is type(reference)
    tok = HFTokenizer(str(path))
    prompts = [tok.encode(p) for p in PROMPTS]
    expected = [_reference(reference, p, n) for p, n in zip(prompts, LENGTHS)]

    async def run() -> list:
        engine = GenerationEngine(model, tok, kv_cache=True, logits_of=lambda o: o.logits, context_len=256,
                                  max_batch=2)

        async def one(i: int):
            await asyncio.sleep(0.002 * i)
            return await engine.generate(prompts[i], SamplingParams(max_tokens=LENGTHS[i], temperature=0))
        return await asyncio.gather(*[one(i) for i in range(len(prompts))])

    done = asyncio.run(run())
    assert [d.text for d in done] == [tok.decode(ids) for ids in expected]
    assert [d.completion_tokens for d in done] == LENGTHS
