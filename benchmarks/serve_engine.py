"""The generation engine alone: generated tokens/s of `GenerationEngine` (continuous
batching over a KV cache) with 32 requests in flight, logprobs off and on, in this
process: no Ray, no HTTP, so a change to the engine's step shows without the noise of
Serve's processes on a shared machine.

    python benchmarks/serve_engine.py                 # logprobs off and on (top 5)
    python benchmarks/serve_engine.py --against /tmp/base --repeats 8   # and another checkout's engine

``--against DIR`` loads ``DIR/raytrain_platform/serve/engine.py`` (say, ``git archive``
of an earlier commit) into this process as a side of its own, interleaved with this
checkout's (its imports of the package's other modules resolve to this checkout's).

The model is serve_llm.py's (tools/tiny_llm.py, byte-level BPE of 512 tokens, hidden
256, 4 layers), 1 torch thread; each request samples ``max_tokens`` 32 at temperature 1
with its own seed. Prints one JSON line per repeat and side; the figure is the median.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", type=Path, default=None, help="another checkout whose engine is a side too")
    args = parser.parse_args(argv)
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from raytrain_platform.serve import engine as this
    from raytrain_platform.serve.text import HFTokenizer
    from serve_llm import MAX_TOKENS, _make_model, _prompt

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = _make_model(Path(tmp), 256, 4)
        model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
        tok = HFTokenizer(str(folder))
    sides: dict[str, tuple] = {}
    if args.against is not None:
        sides[f"{args.against}, logprobs off"] = (_load_engine(args.against), {})
    sides["this checkout, logprobs off"] = (this, {})
    if "logprobs" in {f.name for f in dataclasses.fields(this.SamplingParams)}:
        sides["this checkout, logprobs 5"] = (this, {"logprobs": 5})

    async def run(side: tuple, repeat: int) -> float:
        module, extra = side
        engine = module.GenerationEngine(model, tok, kv_cache=True, logits_of=lambda o: o.logits, context_len=512,
                                         max_batch=32)
        asks = [engine.generate(tok.encode(_prompt(i)), module.SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=1.0, seed=repeat * 1000 + i, **extra))
                for i in range(args.requests)]
        start = time.perf_counter()
        done = await asyncio.gather(*asks)
        return sum(d.completion_tokens for d in done) / (time.perf_counter() - start)

    results: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        for name, side in sides.items():  # interleaved: each side once per repeat
            results[name].append(asyncio.run(run(side, repeat)))
    for name, runs in results.items():
        print(json.dumps({"side": name, "tokens_per_s_median": round(statistics.median(runs), 1),
                          "repeats": [round(r, 1) for r in runs]}))
    return 0


def _load_engine(checkout: Path) -> ModuleType:
    """`checkout`'s serve/engine.py as a module of its own name."""
    path = checkout / "raytrain_platform" / "serve" / "engine.py"
    spec = importlib.util.spec_from_file_location("other_engine", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_engine"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.exit(main())
