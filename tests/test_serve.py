"""Ray Serve endpoints, for real: tiny mlp and gpt checkpoints trained with the Ray-free
core, one Serve app on 127.0.0.1 per module (built from the config `rtp serve
--write-config` writes, through the builder `serve run` calls), a real HTTP client,
Serve and Ray shut down afterwards. Start-up refusals (unsafe, missing, partial,
mismatched checkpoints; bad options) run without Ray."""

from __future__ import annotations

import json
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
import yaml

from conftest import free_port, load_test, mlp_config, train_in_process
from raytrain_platform.cli import main as rtp
from raytrain_platform.errors import CheckpointError, ConfigError
from raytrain_platform.inference import load_model_for_inference
from raytrain_platform.serve.builder import NORMAL_PRIORITY_ENV, deployment_options
from raytrain_platform.serve.inference import GenerationJob, generate
from raytrain_platform.serve.options import parse_serve_args

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

GPT_KWARGS = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}
LIMITS = {"max_batch_rows": 64, "max_prompt_bytes": 256, "max_new_tokens": 24, "max_body_bytes": 65536,
          "max_models_per_replica": 2, "max_batch_size": 16, "cpus_per_replica": 1}


def _train(tmp: Path, name: str, **sections) -> Path:
    """A 2-step run with the Ray-free core, in this process (about a second)."""
    cfg = mlp_config(tmp, name, train={"max_steps": 2},
                     run={"checkpoint_every": 0, "eval_every": 0, "eval_batches": 1})
    for section, values in sections.items():
        cfg[section] = {**cfg[section], **values}
    return train_in_process(tmp, cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A folder of three runs (as a sweep leaves them): two mlp, one gpt."""
    root = tmp_path_factory.mktemp("serve") / "runs"
    _train(root, "clf")
    _train(root, "reg", model={"name": "mlp", "kwargs": {"hidden_sizes": [8], "task": "regression"}},
           data={"source": "synthetic", "batch_size": 8, "num_samples": 256})
    _train(root, "lm", model={"name": "gpt", "kwargs": GPT_KWARGS},
           data={"source": "synthetic", "batch_size": 4, "num_samples": 256})
    return root


@pytest.fixture(scope="module")
def served(runs, tmp_path_factory):
    """The Serve app from `rtp serve --write-config`'s config, as `serve deploy` builds it."""
    import ray
    from ray import serve
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.utils import import_attr

    config_path = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
    assert rtp(["serve", str(runs), "--write-config", str(config_path), *flags]) == 0
    application = yaml.safe_load(config_path.read_text())["applications"][0]
    builder = import_attr(application["import_path"])
    assert import_attr("pipelines.serve:app") is builder
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": NORMAL_PRIORITY_ENV})  # as `rtp serve` starts it
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(call_user_app_builder_with_args_if_necessary(builder, application["args"]),
                  name="rtp", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _post(url: str, path: str, body=None, **kwargs) -> requests.Response:
    return requests.post(url + path, json=body, timeout=60, **kwargs)


def _rows(n: int, features: int = 16, seed: int = 0) -> list[list[float]]:
    return torch.randn(n, features, generator=torch.Generator().manual_seed(seed)).tolist()


# ---- start-up: options and checkpoints, no Ray ------------------------------------------------

def test_options_are_checked_and_map_to_serve_settings(runs):
    from ray.serve.config import AutoscalingConfig

    opts = parse_serve_args({"checkpoint": f"a={runs / 'clf'},{runs / 'lm'}", "min_replicas": "1",
                             "max_replicas": "3", "target_ongoing_requests": "4", "use_gpu": "true",
                             "upscale_delay_s": "0", "downscale_delay_s": 5})
    assert [(s.name, Path(s.path).name) for s in opts.checkpoints] == [("a", "clf"), ("lm", "lm")]
    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4.0,
                   "upscale_delay_s": 0.0, "downscale_delay_s": 5.0, "look_back_period_s": 30.0}
    assert deployment_options(opts) == {
        "max_ongoing_requests": 64, "ray_actor_options": {
            "num_cpus": 1.0, "num_gpus": 1, "runtime_env": {"env_vars": NORMAL_PRIORITY_ENV}},
        "autoscaling_config": autoscaling}
    assert AutoscalingConfig(**autoscaling).model_dump(include=set(autoscaling)) == autoscaling
    assert deployment_options(parse_serve_args({"checkpoint": str(runs), "num_replicas": 2}))["num_replicas"] == 2
    for args, match in [({"checkpoint": str(runs), "max_batch_size": "0"}, "max_batch_size = '0'"),
                        ({"checkpoint": str(runs), "use_gpu": "maybe"}, "use_gpu = 'maybe': expected true or false"),
                        ({"checkpoint": str(runs), "batch_size": 4}, "batch_size = 4: expected a known option"),
                        ({"checkpoint": f"{runs / 'clf'},{runs / 'clf'}"}, "distinct model ids"),
                        ({"checkpoint": str(runs), "min_replicas": 3, "max_replicas": 2}, "<= max_replicas"),
                        ({"checkpoint": str(runs), "downscale_delay_s": "-1"}, "downscale_delay_s = '-1'"),
                        ({}, "checkpoint = None")]:
        with pytest.raises(ConfigError, match=match):
            parse_serve_args(args)


def _cli_error(capsys, *argv: str) -> str:
    assert rtp(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_missing_partial_and_foreign_checkpoints_are_refused_at_start_up(runs, tmp_path, capsys):
    import shutil

    assert "no such file or directory" in _cli_error(capsys, str(tmp_path / "nowhere"))
    partial = tmp_path / "partial"
    shutil.copytree(next((runs / "clf").glob("checkpoint_*")), partial)
    (partial / "model.safetensors").unlink()
    assert "no model.safetensors (partial checkpoint" in _cli_error(capsys, str(partial))
    (partial / "trainer_state.json").unlink()
    assert "not a checkpoint directory" in _cli_error(capsys, str(partial))
    foreign = tmp_path / "foreign"
    shutil.copytree(next((runs / "clf").glob("checkpoint_*")), foreign)
    cfg = yaml.safe_load((foreign / "config.yaml").read_text())
    cfg["model"]["kwargs"]["hidden_sizes"] = [64]
    (foreign / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert "checkpoint is for another model" in _cli_error(capsys, f"x={foreign}")
    assert "--port = '0'" in _cli_error(capsys, str(runs / "clf"), "--port", "0")
    assert "max_new_tokens = '-1'" in _cli_error(capsys, str(runs / "clf"), "--max-new-tokens", "-1")


class _TouchMarker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def test_a_checkpoint_that_runs_code_when_unpickled_is_refused_and_nothing_runs(runs, tmp_path, capsys):
    """Two crafted checkpoints: a pickle where the safetensors weights belong, and a
    sharded checkpoint whose DCP index is a pickle payload. Both are live payloads
    (plain unpickling runs them), both are refused by `rtp serve` and by the builder."""
    import shutil

    from ray.serve._private.utils import import_attr

    from test_checkpoint_safety import _sharded_checkpoint

    marker = tmp_path / "pwned"
    payload = pickle.dumps(_TouchMarker(str(marker)))
    pickle.loads(payload)
    assert marker.exists(), "the payload is live"
    marker.unlink()

    weights = tmp_path / "weights" / "checkpoint_000002"
    shutil.copytree(next((runs / "clf").glob("checkpoint_*")), weights)
    torch.save({"net.0.weight": _TouchMarker(str(marker))}, weights / "model.safetensors")
    sharded = _sharded_checkpoint(tmp_path / "dcp", payload)
    builder = import_attr("pipelines.serve:app")
    for ckpt, match in [(weights, "not a valid safetensors file"), (sharded, "not allowed in a DCP index")]:
        assert match in _cli_error(capsys, str(ckpt))
        with pytest.raises(CheckpointError, match=match):
            builder({"checkpoint": str(ckpt)})
    assert not marker.exists()


def test_a_sharded_fsdp_checkpoint_is_served_from_its_shards(runs, tmp_path):
    """A DCP checkpoint (what FSDP writes) loads through the same safe reader as export."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from raytrain_platform.serve.catalog import load_served_model

    source = next((runs / "clf").glob("checkpoint_*"))
    model, _, _ = load_model_for_inference(source)
    sharded = tmp_path / "run" / "checkpoint_000002"
    sharded.mkdir(parents=True)
    shutil.copy(source / "config.yaml", sharded / "config.yaml")
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(sharded / "sharded"), no_dist=True)
    state = json.loads((source / "trainer_state.json").read_text())
    files = {str(f.relative_to(sharded)): f.stat().st_size for f in sharded.rglob("*") if f.is_file()}
    (sharded / "trainer_state.json").write_text(json.dumps({**state, "sharded": True, "files": files}))
    served_model, info = load_served_model("fsdp", str(sharded.parent))
    assert info["step"] == 2 and info["checkpoint"] == str(sharded)
    x = torch.tensor(_rows(4))
    with torch.no_grad():
        torch.testing.assert_close(served_model(x), model(x))


def test_coalescer_merges_waiting_batches_of_one_kind_up_to_the_limit():
    import asyncio

    from raytrain_platform.serve.coalesce import Coalescer

    calls: list[tuple[str, list]] = []

    async def run(key, items):
        calls.append((key, list(items)))
        await asyncio.sleep(0.01)
        if "boom" in items:
            raise ValueError("boom")
        return [f"{key}{x}" for x in items]

    async def scenario():
        queue = Coalescer(run, max_items=3)
        first = asyncio.ensure_future(queue.submit("p", [0]))  # runs alone, the rest wait
        await asyncio.sleep(0)
        waiting = [queue.submit("p", [1, 2]), queue.submit("g", [9]), queue.submit("p", [3]),
                   queue.submit("p", [4, 5])]
        results = await asyncio.gather(first, *waiting)
        failed = await asyncio.gather(queue.submit("p", ["boom"]), return_exceptions=True)
        return results, failed

    results, failed = asyncio.run(scenario())
    assert results == [["p0"], ["p1", "p2"], ["g9"], ["p3"], ["p4", "p5"]]
    assert calls[:4] == [("p", [0]), ("p", [1, 2, 3]), ("g", [9]), ("p", [4, 5])]
    assert isinstance(failed[0], ValueError)


def test_predict_runs_each_row_width_apart_and_a_refused_width_fails_its_requests_only():
    """A user model of unknown input width: requests of other widths batched with a good
    one (ragged rows would make one tensor fail, and every request with it)."""
    from raytrain_platform.serve.inference import predict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    four = _rows(2, features=4)
    out = predict(model, [four, _rows(1, features=3), four[:1]], classification=True)
    alone = predict(model, [four], classification=True)[0]
    assert len(out) == 3 and out[0].error is None and out[0].predictions == alone.predictions
    torch.testing.assert_close(torch.tensor(out[0].probabilities), torch.tensor(alone.probabilities))
    assert out[2].predictions == alone.predictions[:1]
    assert isinstance(out[1].error, RuntimeError) and out[1].predictions is None


def test_rows_for_a_model_of_unknown_width_share_one_width_per_request():
    from raytrain_platform.serve.app import _check_rows
    from raytrain_platform.serve.http import APIError

    entry = {"id": "user", "inputs": {"num_features": None}}
    _check_rows(entry, [[1.0, 2.0], [3.0, 4.0]], max_rows=8)
    for rows, message in (([[1.0, 2.0], [3.0]], "rows.1: 1 features; rows.0 has 2 (every row of a request needs "
                                                "the same count)"),
                          ([[]], "rows.0: 0 features; at least 1")):
        with pytest.raises(APIError) as caught:
            _check_rows(entry, rows, max_rows=8)
        assert caught.value.status_code == 422 and caught.value.detail == message


def test_a_tiny_temperature_generates_the_greedy_text():
    """/v1/generate's sampling: logits / 1e-300 would overflow (softmax NaN: multinomial raised)."""
    from raytrain_platform.models.gpt import GPT
    from raytrain_platform.models.specs import GPTSpec

    torch.manual_seed(0)
    gpt = GPT(GPTSpec(n_layer=1, n_head=2, n_embd=16, block_size=8)).eval()
    jobs = [GenerationJob(b"hi", 6, temperature, top_k, seed=1)
            for temperature, top_k in ((0.0, None), (1e-300, None), (5e-324, 5), (1e-40, None))]
    out = generate(gpt, jobs, context_len=8)
    assert len(out) == 4 and all(o == out[0] for o in out[1:]) and len(out[0]) == 6, out


def test_a_port_that_is_not_ascii_digits_is_one_line_and_exit_2(runs, capsys):
    assert "--port = '²'" in _cli_error(capsys, str(runs / "clf"), "--port", "²")  # '²'.isdigit() is True


# ---- over HTTP --------------------------------------------------------------------------------

def test_health_models_and_openapi(served, runs):
    health = requests.get(served + "/healthz", timeout=30).json()
    assert health["status"] == "ok" and health["models"] == ["clf", "lm", "reg"]
    listed = requests.get(served + "/v1/models", timeout=30).json()
    assert listed["object"] == "list" and all(m["object"] == "model" for m in listed["data"])  # OpenAI's shape
    models = {m["id"]: m for m in listed["data"]}
    state = json.loads((next((runs / "clf").glob("checkpoint_*")) / "trainer_state.json").read_text())
    assert models["clf"]["step"] == 2 and models["clf"]["metrics"]["val_loss"] == state["metrics"]["val_loss"]
    assert models["clf"]["inputs"] == {"num_features": 16, "num_outputs": 4}
    assert models["lm"]["model"] == {"name": "gpt", "kwargs": {**GPT_KWARGS, "vocab_size": 256, "dropout": 0.0,
                                                               "bias": True, "init_std": 0.02, "task": "lm"}}
    assert models["reg"]["task"] == "regression"
    spec = requests.get(served + "/openapi.json", timeout=30).json()
    assert {"/v1/predict", "/v1/generate", "/v1/models", "/healthz"} <= set(spec["paths"])
    assert {"PredictRequest", "GenerateRequest", "ErrorResponse"} <= set(spec["components"]["schemas"])
    assert requests.get(served + "/docs", timeout=30).status_code == 200


def test_predict_matches_the_checkpoint_computed_locally(served, runs):
    rows = _rows(5)
    for model_id in ("clf", "reg"):
        model, _, _ = load_model_for_inference(runs / model_id)
        with torch.no_grad():
            local = model(torch.tensor(rows))
        r = _post(served, "/v1/predict", {"rows": rows, "model": model_id})
        assert r.status_code == 200, r.text
        body = r.json()
        if model_id == "clf":
            torch.testing.assert_close(torch.tensor(body["probabilities"]), torch.softmax(local, -1))
            assert body["predictions"] == local.argmax(-1).tolist()
        else:
            torch.testing.assert_close(torch.tensor(body["predictions"]), local)
            assert body["probabilities"] is None


def test_generate_same_seed_same_text_and_matches_local_greedy(served, runs):
    ask = {"prompt": "def main():", "max_new_tokens": 12, "temperature": 0.9, "top_k": 40, "seed": 11}
    with ThreadPoolExecutor(4) as pool:  # concurrent: they share dynamic batches
        answers = list(pool.map(lambda s: _post(served, "/v1/generate", {**ask, "seed": s}).json(),
                                [11, 11, 12, 11]))
    assert answers[0]["text"] == answers[1]["text"] == answers[3]["text"]
    assert answers[0]["new_tokens"] == 12 and answers[0]["seed"] == 11
    assert answers[2]["text"] != answers[0]["text"]
    model, _, _ = load_model_for_inference(runs / "lm")
    greedy = generate(model, [GenerationJob(b"hello", 8, 0.0, None, 0)])[0]
    body = _post(served, "/v1/generate", {"prompt": "hello", "max_new_tokens": 8, "temperature": 0}).json()
    assert body["text"] == greedy.decode("utf-8", errors="replace")


def test_models_chosen_by_header_or_field_with_an_lru_bound(served):
    header = {"serve_multiplexed_model_id": "reg"}
    assert _post(served, "/v1/predict", {"rows": _rows(1)}, headers=header).json()["model"] == "reg"
    assert _post(served, "/v1/predict", {"rows": _rows(1), "model": "clf"}).json()["model"] == "clf"
    r = _post(served, "/v1/predict", {"rows": _rows(1), "model": "clf"}, headers=header)
    assert r.status_code == 400 and "differ" in r.json()["error"]["message"]
    assert _post(served, "/v1/generate", {"prompt": "x", "max_new_tokens": 1}).json()["model"] == "lm"
    loaded = requests.get(served + "/healthz", timeout=30).json()["loaded"]
    assert len(loaded) == LIMITS["max_models_per_replica"] and "lm" in loaded  # the least recent went


BAD_REQUESTS = [  # (what, path, raw body or JSON, headers, status, message part)
    ("malformed JSON", "/v1/predict", b'{"rows": [[1, 2', None, 400, "malformed JSON"),
    ("not an object", "/v1/predict", b"[1, 2]", None, 422, "valid dictionary"),
    ("no body", "/v1/predict", b"", None, 422, "missing JSON body"),
    ("missing field", "/v1/predict", {"model": "clf"}, None, 422, "rows: Field required"),
    ("unknown field", "/v1/predict", {"rows": [[1.0] * 16], "colour": 1}, None, 422, "colour: Extra inputs"),
    ("wrong feature count", "/v1/predict", {"rows": [[1.0] * 16, [1.0] * 3], "model": "clf"}, None, 422,
     "rows.1: 3 features; model 'clf' expects 16"),
    ("string feature", "/v1/predict", {"rows": [["1.0"] * 16]}, None, 422, "rows.0.0: Input should be a valid number"),
    ("bool feature", "/v1/predict", {"rows": [[True] * 16]}, None, 422, "rows.0.0"),
    ("NaN", "/v1/predict", b'{"rows": [[NaN' + b", 1" * 15 + b"]]}", None, 422, "finite number"),
    ("infinity", "/v1/predict", b'{"rows": [[1e999' + b", 1" * 15 + b"]]}", None, 422, "finite number"),
    ("beyond float32", "/v1/predict", {"rows": [[1e300] + [1.0] * 15], "model": "clf"}, None, 422,
     "rows.0.0: Value error, 1e+300 is beyond float32"),
    ("output not finite", "/v1/predict", {"rows": [[3e38] * 16], "model": "clf"}, None, 422,
     "rows: the model's output is not finite for these rows"),
    ("empty list", "/v1/predict", {"rows": []}, None, 422, "rows: List should have at least 1 item"),
    ("empty row", "/v1/predict", {"rows": [[]], "model": "clf"}, None, 422, "rows.0: 0 features"),
    ("too many rows", "/v1/predict", {"rows": [[1.0] * 16] * 65, "model": "clf"}, None, 422, "at most 64 per request"),
    ("body over the limit", "/v1/predict", {"rows": [[1.0] * 16] * 4000}, None, 413, "max_body_bytes"),
    ("unknown model id (field)", "/v1/predict", {"rows": [[1.0] * 16], "model": "nope"}, None, 404,
     "unknown model id 'nope'; known ids: clf, lm, reg"),
    ("unknown model id (header)", "/v1/predict", {"rows": [[1.0] * 16]}, {"serve_multiplexed_model_id": "nope"},
     404, "unknown model id 'nope'"),
    ("several models, none named", "/v1/predict", {"rows": [[1.0] * 16]}, None, 400, "2 mlp models served"),
    ("other kind of model", "/v1/predict", {"rows": [[1.0] * 16], "model": "lm"}, None, 400,
     "'lm' is a gpt model: use POST /v1/completions, /v1/chat/completions or /v1/generate"),
    ("prompt over the limit", "/v1/generate", {"prompt": "é" * 129}, None, 422, "258 UTF-8 bytes; at most 256"),
    ("empty prompt", "/v1/generate", {"prompt": ""}, None, 422, "prompt: String should have at least 1"),
    ("too many new tokens", "/v1/generate", {"prompt": "a", "max_new_tokens": 25}, None, 422, "at most 24"),
    ("float token count", "/v1/generate", {"prompt": "a", "max_new_tokens": 2.5}, None, 422, "max_new_tokens"),
    ("negative temperature", "/v1/generate", {"prompt": "a", "temperature": -1}, None, 422, "temperature"),
    ("top_k over the vocabulary", "/v1/generate", {"prompt": "a", "top_k": 257}, None, 422, "top_k"),
    ("prompt not a string", "/v1/generate", {"prompt": 5}, None, 422, "prompt: Input should be a valid string"),
    ("lone surrogate", "/v1/generate", b'{"prompt": "\\ud800"}', None, 422, "prompt"),
    ("unknown path", "/v1/nothing", {}, None, 404, "POST /v1/nothing: not found"),
]


@pytest.mark.parametrize("what,path,body,headers,status,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_a_4xx_naming_the_problem_and_the_server_keeps_serving(served, what, path, body,
                                                                            headers, status, message):
    headers = {"content-type": "application/json", **(headers or {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(served + path, data=data, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]  # OpenAI's shape: message, type, param, code
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert len(error["message"].splitlines()) == 1
    ok = _post(served, "/v1/predict", {"rows": _rows(2), "model": "clf"})
    assert ok.status_code == 200 and len(ok.json()["predictions"]) == 2


def test_a_chunked_body_over_the_limit_is_refused_while_read(served):
    def chunks():
        yield b'{"rows": [['
        for _ in range(4000):
            yield b"1.0, " * 10
        yield b"1.0]]}"

    r = requests.post(served + "/v1/predict", data=chunks(), timeout=60,
                      headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    assert _post(served, "/v1/predict", {"rows": _rows(1), "model": "clf"}).status_code == 200


def _batches(served: str, kind: str) -> dict:
    return requests.get(served + "/healthz", timeout=30).json()["batches"].get(
        kind, {"calls": 0, "requests": 0, "largest": 0})


def test_requests_that_wait_during_a_compute_share_the_next_one(served):
    """16 clients keep generation requests coming: while the compute thread runs one
    call, the requests arriving meanwhile must all go into the next call (Serve forms a
    small batch every few ms; each one must reach the coalescer at once, not queue for
    its turn). Measured from the replica's own counts (/healthz) on this test: 2.9
    requests per call with Serve's default of one batch at a time, 6.4-7.1 with every
    batch let through; 4 is asserted."""
    before = _batches(served, "generate")
    clients, each = 16, 4

    def client(k: int) -> list[int]:
        session = requests.Session()
        return [session.post(served + "/v1/generate", timeout=60, json={
            "prompt": f"def f{k}_{i}():", "max_new_tokens": LIMITS["max_new_tokens"], "seed": k * each + i,
            "model": "lm"}).status_code for i in range(each)]

    with ThreadPoolExecutor(clients) as pool:
        codes = [c for cs in pool.map(client, range(clients)) for c in cs]
    after = _batches(served, "generate")
    calls, answered = after["calls"] - before["calls"], after["requests"] - before["requests"]
    print(f"generate: {answered} requests in {calls} compute calls (largest {after['largest']})")
    assert codes == [200] * clients * each and answered == clients * each
    assert answered / calls >= 4, (calls, answered)


def test_load_2000_requests_from_32_clients_without_errors(served):
    total, clients = 2000, 32
    sessions = threading.local()  # one keep-alive connection per client thread

    def one_request(i: int) -> str | None:
        if not hasattr(sessions, "s"):
            sessions.s = requests.Session()
        body = {"rows": _rows(1 + i % 4, seed=i), "model": "clf" if i % 2 else "reg"}
        r = sessions.s.post(served + "/v1/predict", json=body, timeout=60)
        ok = r.status_code == 200 and len(r.json()["predictions"]) == 1 + i % 4
        return None if ok else f"{r.status_code} {r.text[:200]}"

    failures, elapsed = load_test(total, clients, one_request)
    print(f"load: {total} requests from {clients} clients in {elapsed:.1f} s ({total / elapsed:.0f} req/s)")
    assert not failures, (len(failures), failures[:3])
