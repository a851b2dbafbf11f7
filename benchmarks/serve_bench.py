"""Serving throughput and latency, with and without dynamic batching, on CPU.

    python benchmarks/serve_bench.py            # full: about 5 minutes on 2 quiet CPU cores
    python benchmarks/serve_bench.py --quick    # the mlp models at 32 clients only, once (~1.5 min)
    python benchmarks/serve_bench.py --smoke    # a few requests; checks it still runs

For each model (a checkpoint trained for one step with the Ray-free core), two Serve
applications side by side on a local Ray (2 CPUs), one replica each (1 CPU, 1 torch
thread): one without batching (``max_batch_size 1``: each request is its own forward),
one with it (``max_batch_size 32``, 5 ms wait). Clients are threads with one keep-alive
HTTP session each, in this process on the same machine. At each level the two variants
alternate 3 times (the machine's load drifts); requests/s is the median of the
repeats, p50/p99 latency are over all their requests.

Models: ``mlp-deep`` (16 -> 16 x 4096 -> 4, 252M parameters, 1 GB of float32 weights:
a one-row forward reads every weight once and is bound by memory bandwidth, ~60 ms
here, while 32 rows cost only ~5x one row, so a batch shares the weight reads and the
model, not HTTP, is the bottleneck without batching), ``mlp-small`` (the tabular
example's 16 -> 64 -> 64 -> 4: a forward is ~0.1 ms, HTTP and Serve dominate, batching
has nothing to win), ``gpt`` (the quickstart's 2 layers, d=128, context 64; 16 new
bytes per request, prompts of equal length). Measured in one process with one thread
(idle machine): 16 -> 4 x 2048 -> 4 takes 3.4 ms for one row and 15 ms for 32, too
cheap against the HTTP path (which tops out at ~170-200 requests/s here, `mlp-small`)
for batching to pay much; 16 -> 8 x 4096 -> 4 takes 29 and 163 ms; 16 x 4096, 63 and
334 ms.

Writes benchmarks/serve_results.json (``--out``) and the table beside it as .md (not with
--smoke or --quick); ``--page`` also writes the table to
benchmarks/results/serve-batching-DATE.md.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import finish, free_port, harness_parser, out_path  # noqa: E402
from raytrain_platform.serve.builder import NORMAL_PRIORITY_ENV, build_application  # noqa: E402
from raytrain_platform.serve.catalog import load_catalog  # noqa: E402
from raytrain_platform.serve.options import parse_serve_args  # noqa: E402

MODELS = {  # name: (model section, data section)
    "mlp-deep": ({"name": "mlp", "kwargs": {"hidden_sizes": [4096] * 16}},
                 {"source": "synthetic", "batch_size": 8, "num_samples": 512}),
    "mlp-small": ({"name": "mlp", "kwargs": {"hidden_sizes": [64, 64]}},
                  {"source": "synthetic", "batch_size": 8, "num_samples": 512}),
    "gpt": ({"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64}},
            {"source": "synthetic", "batch_size": 4, "num_samples": 512}),
}
GEN_TOKENS = 16
LEVELS = {"mlp-deep": [(1, 40), (32, 480)], "mlp-small": [(1, 200), (32, 1000)],
          "gpt": [(1, 40), (32, 320)]}  # (clients, requests per repeat) per model
QUICK_LEVELS = {"mlp-deep": [(32, 256)], "mlp-small": [(32, 480)]}  # also benchmarks/run.py's
SMOKE_LEVELS = {"mlp-small": [(1, 8), (4, 16)], "gpt": [(1, 4), (4, 8)]}


def _checkpoint(storage: Path, name: str) -> Path:
    """One optimizer step with the Ray-free core: a real checkpoint in a real run directory."""
    from raytrain_platform.core.__main__ import main as core_main

    model, data = MODELS[name]
    cfg = {"model": model, "data": {**data, "val_fraction": 0.0},
           "train": {"max_steps": 1, "optimizer": "sgd", "momentum": 0.0},
           "scaling": {"num_workers": 1, "cpus_per_worker": 1, "torch_threads": 1},
           "run": {"name": name, "storage_path": str(storage), "checkpoint_every": 0, "eval_every": 0}}
    path = storage / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert core_main(["--config", str(path)]) == 0, name
    return storage / name


def _body(name: str, i: int) -> tuple[str, dict]:
    if name.startswith("mlp"):
        return "/v1/predict", {"rows": [[((i * 7 + j) % 13) / 13.0 for j in range(16)]]}
    return "/v1/generate", {"prompt": f"def f{i % 10}(x):", "max_new_tokens": GEN_TOKENS, "seed": i}


def _level(url: str, name: str, clients: int, requests_total: int) -> tuple[float, list[float], int]:
    """`requests_total` requests from `clients` threads: (seconds, latencies, errors)."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def client(k: int) -> None:
        session = requests.Session()
        for i in range(k, requests_total, clients):
            path, body = _body(name, i)
            start = time.perf_counter()
            ok = session.post(url + path, json=body, timeout=120).status_code == 200
            with lock:
                latencies.append(time.perf_counter() - start)
                errors[0] += not ok

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return time.perf_counter() - start, latencies, errors[0]


def _deploy(run_dir: Path, batch: int) -> str:
    """One application per variant, side by side, so the two are measured interleaved."""
    from ray import serve

    options = parse_serve_args({"checkpoint": str(run_dir), "max_batch_size": batch,
                                "batch_wait_timeout_s": 0.005, "max_ongoing_requests": 64})
    prefix = f"/batch{batch}"
    serve.run(build_application(load_catalog(options), options), name=f"bench{batch}", route_prefix=prefix)
    return prefix


def _measure(url: str, name: str, levels: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Both variants at each level, alternated `repeats` times (the machine's load drifts):
    median requests/s over the repeats, latency percentiles over all their requests."""
    rows = []
    for clients, total in levels:
        seen: dict[int, list] = {1: [], 32: []}
        for _ in range(repeats):
            for batch in (1, 32):
                seen[batch].append(_level(f"{url}/batch{batch}", name, clients, total))
        for batch, runs in seen.items():
            latencies = [x for _, lat, _ in runs for x in lat]
            cuts = statistics.quantiles(latencies, n=100)
            rows.append({"model": name, "batching": batch > 1, "clients": clients,
                         "requests": len(latencies), "errors": sum(e for _, _, e in runs),
                         "req_per_s": statistics.median(len(lat) / sec for sec, lat, _ in runs),
                         "p50_ms": cuts[49] * 1e3, "p99_ms": cuts[98] * 1e3})
            print(_line(rows[-1]), flush=True)
    return rows


def run(levels: dict[str, list[tuple[int, int]]], port: int, repeats: int) -> list[dict]:
    """Every model of `levels` without and with batching, at each (clients, requests) level."""
    import ray
    from ray import serve

    rows = []
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        run_dirs = {name: _checkpoint(Path(tmp), name) for name in levels}
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": dict(NORMAL_PRIORITY_ENV)})  # what `rtp serve` does
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for name, model_levels in levels.items():
                for batch in (1, 32):
                    _deploy(run_dirs[name], batch)
                    for k in range(32):  # warm-up: the model loaded, the code paths run
                        path, body = _body(name, k)
                        requests.post(f"{url}/batch{batch}{path}", json=body, timeout=120).raise_for_status()
                rows += _measure(url, name, model_levels, repeats)
        finally:
            serve.shutdown()
            ray.shutdown()
    return rows


def _line(r: dict) -> str:
    return (f"| {r['model']} | {'on' if r['batching'] else 'off'} | {r['clients']} | {r['requests']} | "
            f"{r['req_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} |")


def table(rows: list[dict]) -> str:
    head = ("| model | batching | clients | requests | req/s | p50 ms | p99 ms | errors |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|")
    lines = [head, *(_line(r) for r in rows)]
    for name in dict.fromkeys(r["model"] for r in rows):
        at = {(r["batching"], r["clients"]): r["req_per_s"] for r in rows if r["model"] == name}
        top = max(c for _, c in at)
        lines.append(f"\n{name}: batching gives {at[(True, top)] / at[(False, top)]:.2f}x the "
                     f"requests/s at {top} clients")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # --smoke: small models, a few requests.
    p = harness_parser(__doc__, out=ROOT / "benchmarks" / "serve_results.json", page="serve-batching")
    p.add_argument("--quick", action="store_true", help="the mlp models at 32 clients, once; no results files")
    p.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (default: a free one)")
    args = p.parse_args(argv)
    if args.quick:
        args.default_out = None
    port = args.port or free_port()
    levels, repeats = ((SMOKE_LEVELS, 1) if args.smoke else (QUICK_LEVELS, 1) if args.quick
                       else (LEVELS, args.repeats or 3))
    rows = run(levels, port, repeats=repeats)
    errors = sum(r["errors"] for r in rows)
    text = table(rows)
    finish(args, {"repeats": repeats, "rows": rows}, script=__file__, argv=argv,
           title="Ray Serve with and without dynamic batching", table=text)
    if out_path(args):
        out_path(args).with_suffix(".md").write_text(text + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
