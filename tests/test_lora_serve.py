"""Several LoRA runs over one base, served from one deployment (serve/adapters.py): the
base is loaded once per replica, each run's adapters are added under its model id and
chosen per request (Serve multiplexing), and dropped when the LRU cache lets the model
go. Three tiny gpt LoRA runs trained with the Ray-free core (a second each): two on the
same base (gpt, seed 0) with different adapters, one on another base (seed 1)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from conftest import free_port, mlp_config, train_in_process

GPT = {"name": "gpt", "kwargs": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}}


def _train(root: Path, name: str, *, seed: int, lr: float, targets: list[str]) -> Path:
    return train_in_process(root, mlp_config(
        root, name, model={**GPT, "lora": {"r": 4, "target_modules": targets}},
        data={"source": "synthetic", "batch_size": 4, "num_samples": 256},
        train={"max_steps": 3, "lr": lr, "optimizer": "adamw", "seed": seed},
        run={"checkpoint_every": 0, "eval_every": 0, "eval_batches": 1}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora_serve") / "runs"
    _train(root, "a", seed=0, lr=0.05, targets=["q_proj", "v_proj"])
    _train(root, "b", seed=0, lr=0.02, targets=["up_proj", "down_proj", "q_proj"])
    _train(root, "c", seed=1, lr=0.05, targets=["q_proj", "v_proj"])
    return root


def _unmerged(run: Path) -> torch.nn.Module:
    from raytrain_platform.inference import load_model_for_inference

    return load_model_for_inference(run, merge_adapters=False)[0]


def test_one_base_for_runs_that_share_it_and_each_run_its_own_adapters(runs):
    import gc

    from raytrain_platform.serve.adapters import SharedBases

    bases = SharedBases()
    a, b, c = (bases.load(name, str(runs / name)) for name in "abc")
    assert a.base is b.base and c.base is not a.base and bases.num_bases == 2 and bases.adapters() == 3
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        for view, name in ((a, "a"), (b, "b"), (a, "a"), (c, "c")):  # switching back and forth
            torch.testing.assert_close(view(x), _unmerged(runs / name)(x), rtol=0, atol=0)
        assert (a(x) - b(x)).abs().max() > 1e-4
    del a  # nothing holds run a's module any more: its adapters leave the shared base
    gc.collect()
    assert bases.adapters() == 2 and not any(".lora_A.m0_a." in n for n, _ in b.base.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(b(x), _unmerged(runs / "b")(x), rtol=0, atol=0)
    del b
    gc.collect()
    assert bases.num_bases == 1 and bases.adapters() == 1  # a base without adapters goes


@pytest.fixture(scope="module")
def served(runs):
    import ray
    from ray import serve

    from raytrain_platform.serve.builder import NORMAL_PRIORITY_ENV, app

    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": NORMAL_PRIORITY_ENV})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app({"checkpoint": str(runs), "max_models_per_replica": 2, "max_batch_size": 8,
                       "cpus_per_replica": 1}), name="rtp_lora", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_requests_pick_their_runs_adapters_from_one_deployment(served, runs):
    from raytrain_platform.serve.inference import GenerationJob, generate

    expected = {name: generate(_unmerged(runs / name), [GenerationJob(b"def f():", 12, 0.0, None, 0)],
                               context_len=GPT["kwargs"]["block_size"])[0] for name in "abc"}
    assert len(set(expected.values())) == 3, expected  # three runs, three answers
    order = ["a", "b", "a", "c", "b", "a", "c", "c"]  # c evicts a from the 2-model cache and back
    ask = {"prompt": "def f():", "max_new_tokens": 12, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:  # concurrent: different adapters share dynamic batches
        answers = list(pool.map(lambda m: requests.post(served + "/v1/generate", json={**ask, "model": m},
                                                        timeout=60).json(), order))
    for name, body in zip(order, answers, strict=True):
        assert body["model"] == name and body["text"] == expected[name].decode("utf-8", errors="replace"), body


@pytest.mark.slow
@pytest.mark.extended  # ~30-60 s here (3 fresh processes): with the extended tests
@pytest.mark.timeout(300)
def test_the_memory_benchmark_runs():
    """benchmarks/lora_serving.py --smoke: N merged models against one base with N adapters."""
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "benchmarks/lora_serving.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| merged | 2 |" in proc.stdout and "| shared | 2 |" in proc.stdout and "N = 2: shared base" in proc.stdout
