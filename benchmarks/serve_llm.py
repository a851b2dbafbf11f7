"""LLM serving throughput: generated tokens/s of the OpenAI endpoint (continuous
batching over a KV cache) at 1, 8 and 32 concurrent clients, against one-at-a-time
``transformers`` ``generate`` on the same model, on CPU.

    python benchmarks/serve_llm.py            # about 4 minutes on 2 quiet CPU cores
    python benchmarks/serve_llm.py --smoke    # a few requests; checks it still runs
    python benchmarks/serve_llm.py --logprobs 5   # also 32 clients asking for logprobs (top 5)

The model is a Llama-style decoder made offline by tools/tiny_llm.py (byte-level BPE of
512 tokens; ``--hidden`` 256 and ``--layers`` 4 by default, 4 heads, 2 KV heads), served
from its folder as ``rtp serve DIR`` would: one replica, 1 CPU, 1 torch thread, on a
local Ray with 2 CPUs. Clients are threads in this process, each with a keep-alive HTTP
session, sending ``POST /v1/completions`` (``max_tokens`` 32, temperature 1, a seed per
request) one after the other; with ``--logprobs N``, a side of 32 clients whose requests
also ask ``logprobs: N`` (each token's logprob and the N most likely, in the answer). The baseline is this process with 1 torch thread calling
``model.generate`` (sampling, same ``max_new_tokens``) on the same prompts one at a time.
Both count the tokens actually generated (a sampled end-of-sequence token ends a
request early on either side). Sides alternate per repeat (the machine's load drifts);
the figure is the median over repeats.

Writes benchmarks/serve_llm.json (``--out``; not with --smoke) and prints a table;
``--page`` also writes it to benchmarks/results/serve-llm-DATE.md.
"""

from __future__ import annotations

import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import compare, finish, free_port, harness_parser, interleaved, stamp

MAX_TOKENS = 32
LEVELS = [(1, 6), (8, 32), (32, 96)]  # (clients, requests per repeat)
SMOKE_LEVELS = [(1, 2), (4, 4)]


def _prompt(i: int) -> str:
    return f"def function_{i}(x, y):\n    "


def _make_model(folder: Path, hidden: int, layers: int) -> Path:
    from raytrain_platform.tools.tiny_llm import make_model, make_tokenizer

    model_dir = folder / "model"
    tok = make_tokenizer(model_dir, vocab_size=512)
    eos = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    make_model(model_dir, vocab_size=len(tok), hidden_size=hidden, num_layers=layers, num_heads=4,
               num_kv_heads=2, intermediate_size=2 * hidden, max_position_embeddings=512,
               eos_token_id=eos, pad_token_id=tok.pad_token_id)
    return model_dir


def _baseline(model_dir: Path, requests_total: int):
    """One-at-a-time `generate`: a function of the repeat index -> tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def run(repeat: int) -> dict:
        tokens, start = 0, time.perf_counter()
        for i in range(requests_total):
            ids = torch.tensor([tok(_prompt(i))["input_ids"]])
            torch.manual_seed(repeat * 1000 + i)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                     do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                     pad_token_id=tok.pad_token_id)
            tokens += out.shape[1] - ids.shape[1]
        elapsed = time.perf_counter() - start
        return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed}

    return run


def _served(url: str, clients: int, requests_total: int, logprobs: int | None = None):
    extra = {} if logprobs is None else {"logprobs": logprobs}

    def run(repeat: int) -> dict:
        counts: list[int] = []

        def client(k: int) -> None:
            session = requests.Session()
            for i in range(k, requests_total, clients):
                r = session.post(url + "/v1/completions", timeout=300, json={
                    "model": "llm", "prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 1.0,
                    "seed": repeat * 1000 + i, **extra})
                r.raise_for_status()
                counts.append(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
        elapsed = time.perf_counter() - start
        assert len(counts) == requests_total
        return {"tokens_per_s": sum(counts) / elapsed, "tokens": sum(counts), "seconds": elapsed}

    return run


def _deploy(model_dir: Path) -> str:
    import ray
    from ray import serve

    from raytrain_platform.serve.builder import NORMAL_PRIORITY_ENV, app

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
             runtime_env={"env_vars": NORMAL_PRIORITY_ENV})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app({"checkpoint": f"llm={model_dir}", "cpus_per_replica": 1, "max_batch_size": 32,
                   "max_ongoing_requests": 64}), name="llm", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    requests.post(url + "/v1/completions", json={"model": "llm", "prompt": "warm up", "max_tokens": 4},
                  timeout=300).raise_for_status()
    return url


def main(argv: list[str] | None = None) -> int:
    # --smoke: a few requests to a tiny model, one repeat.
    parser = harness_parser(__doc__, out=ROOT / "benchmarks" / "serve_llm.json", page="serve-llm")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--logprobs", type=int, default=None, help="add a side of 32 clients asking for logprobs")
    args = parser.parse_args(argv)
    levels = SMOKE_LEVELS if args.smoke else LEVELS
    hidden, layers, repeats = (64, 2, 1) if args.smoke else (args.hidden, args.layers, args.repeats or 2)
    from ray import serve

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _make_model(Path(tmp), hidden, layers)
        url = _deploy(model_dir)
        try:
            baseline_requests = levels[0][1] * 2
            sides = {"generate (one at a time)": _baseline(model_dir, baseline_requests)}
            sides.update({f"served, {c} clients": _served(url, c, n) for c, n in levels})
            if args.logprobs is not None:
                clients, total = levels[-1]
                sides[f"served, {clients} clients, logprobs {args.logprobs}"] = _served(url, clients, total,
                                                                                         args.logprobs)
            results = interleaved(sides, repeats, label="serve_llm ")
        finally:
            serve.shutdown()
    # Each repeat also against the baseline run next to it (the same minute of machine load).
    got = compare(results, "tokens_per_s", "generate (one at a time)")
    rows = [{"side": name, "tokens_per_s": round(got["median"][name], 1), "vs_generate": round(got["ratio"][name], 2),
             "repeats": [round(r["tokens_per_s"], 1) for r in runs],
             "vs_generate_per_repeat": [round(x, 2) for x in got["per_repeat"][name]]}
            for name, runs in results.items()]
    table = ["| side | generated tokens/s (median) | vs generate | per repeat |", "|---|---:|---:|---|"]
    table += [f"| {r['side']} | {r['tokens_per_s']:,.1f} | {r['vs_generate']:.2f}x | {r['vs_generate_per_repeat']} |"
              for r in rows]
    finish(args, {**stamp(), "hidden": hidden, "layers": layers, "max_tokens": MAX_TOKENS, "repeats": repeats,
                  "logprobs": args.logprobs, "rows": rows}, script=__file__, argv=argv,
           title="LLM serving: the OpenAI endpoint against one-at-a-time generate", table="\n".join(table))
    return 0

if __name__ == "__main__":
    sys.exit(main())
