"""The OpenAI-compatible API, for real: a tiny Hugging Face Llama (tools/tiny_llm.py,
offline), trained two steps in two runs (a sweep's trials), one exported with
``rtp export --format hf``, plus a byte-level gpt run and a user LM
(``user_models:tiny_llama``); one Serve app on 127.0.0.1 for the module, the official
``openai`` client as the client.

Without Ray: the engine against ``transformers``' own ``generate`` (greedy, token for
token, with requests joining a running batch), seeds, stop strings, the request limits,
and ``--engine vllm`` configs checked with Ray Serve LLM's own ``LLMConfig``.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
import torch
import yaml
from conftest import hf_config, load_test, serve_app, train_in_process
from test_serve import GPT_KWARGS, _train

from raytrain_platform.cli import main as rtp
from raytrain_platform.errors import CheckpointError
from raytrain_platform.serve.engine import GenerationEngine, SamplingParams
from raytrain_platform.serve.text import ByteTokenizer, HFTokenizer, TextStream

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

LIMITS = {"max_models_per_replica": 2, "max_batch_size": 32, "max_new_tokens": 64, "cpus_per_replica": 1}


def _hf_run(root: Path, name: str, model_dir: Path, lr: float) -> Path:
    return train_in_process(root, hf_config(
        root, name, model_dir, train={"max_steps": 2, "lr": lr, "warmup_steps": 0},
        run={"checkpoint_every": 0, "eval_every": 0, "eval_batches": 1}))


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny) -> dict[str, Path]:
    """Two hf trials in a sweep folder, an hf export of the first, a gpt run, a user LM run
    and a user classifier run."""
    from raytrain_platform.export import export_checkpoint

    root = tmp_path_factory.mktemp("openai")
    sweep = root / "sweep"
    sweep.mkdir()
    a = _hf_run(sweep, "a", tiny["model"], lr=3e-3)
    _hf_run(sweep, "b", tiny["model"], lr=1e-2)
    assert not list(sweep.glob("*.yaml"))  # the sweep folder holds run directories only
    exported = export_checkpoint(a, root / "a_hf", format="hf")
    others = root / "others"
    gpt = _train(others, "gpt", model={"name": "gpt", "kwargs": GPT_KWARGS},
                 data={"source": "synthetic", "batch_size": 4, "num_samples": 256})
    user = train_in_process(others, {**hf_config(others, "user", tiny["model"]),
                                     "model": {"name": "user_models:tiny_llama", "task": "lm",
                                               "kwargs": {"max_positions": 64}},
                                     "train": {"max_steps": 2, "lr": 3e-3, "seed": 0},
                                     "run": {"name": "user", "storage_path": str(others), "checkpoint_every": 0,
                                             "eval_every": 0, "eval_batches": 1}})
    user_clf = _train(others, "user_clf", model={"name": "user_models:slow_mlp", "kwargs": {"delay_s": 0.0}})
    return {"sweep": sweep, "export": exported, "gpt": gpt, "user": user, "user_clf": user_clf}


def test_a_user_builder_run_is_served_only_when_trusted(models, tmp_path, capsys):
    """A run directory names the code that builds its model (``model.name:
    "pkg.module:fn"``): loading it imports and calls that. Like transformers' remote code,
    serving such a run needs ``--trust-builder``; without it `rtp serve` exits 2 before
    importing anything, and a run rewritten to name any other function runs nothing."""
    import shutil

    from raytrain_platform.serve.catalog import load_catalog
    from raytrain_platform.serve.options import parse_serve_args

    assert rtp(["serve", f"user={models['user']}", "--write-config", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err
    assert "model.name 'user_models:tiny_llama' is a Python import path" in err and "--trust-builder" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "s.yaml").exists()
    assert rtp(["serve", f"user={models['user']}", "--trust-builder", "--write-config", str(tmp_path / "s.yaml")]) == 0
    assert rtp(["export", str(models["user"]), "--out", str(tmp_path / "x")]) == 2  # export: the same rule
    assert "--trust-builder" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert rtp(["export", str(models["user"]), "--out", str(tmp_path / "x"), "--trust-builder"]) == 0
    # A copied run whose config names a function with a side effect: refused, nothing ran;
    # trusted, the function runs (then its weights do not fit: refused all the same).
    evil, marker = tmp_path / "evil", tmp_path / "ran"
    shutil.copytree(models["user_clf"], evil)
    for config in evil.rglob("config.yaml"):
        cfg = yaml.safe_load(config.read_text())
        cfg["model"].update(name="user_models:leaves_a_mark", kwargs={"path": str(marker)})
        config.write_text(yaml.safe_dump(cfg))
    for path in (evil, next(evil.glob("checkpoint_*"))):
        with pytest.raises(CheckpointError, match="user_models:leaves_a_mark' is a Python import path"):
            load_catalog(parse_serve_args({"checkpoint": f"evil={path}"}))
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        load_catalog(parse_serve_args({"checkpoint": f"evil={evil}", "trust_builder": True}))
    assert marker.read_text() == "built"


# ---- without Ray -------------------------------------------------------------------------------

def _reference_greedy(model, tok: HFTokenizer, prompt_ids: list[int], n: int, eos=None) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_engine_matches_transformers_generate_with_requests_joining_a_running_batch(tiny):
    """Greedy, token for token, 6 prompts of different lengths through a batch of at most
    3 rows (so rows leave and join mid-flight), against one-at-a-time `generate`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny["model"]), local_files_only=True).eval()
    tok = HFTokenizer(str(tiny["model"]))
    prompts = ["def main():", "import os\n", "The quick brown fox jumps over the lazy dog", "x",
               "class Foo(object):\n    def", "return"]
    lengths = [12, 5, 9, 14, 3, 8]
    expected = [tok.decode(_reference_greedy(model, tok, tok.encode(p), n)) for p, n in zip(prompts, lengths)]
    steps: list[int] = []

    async def run() -> list:
        engine = GenerationEngine(model, tok, kv_cache=True, logits_of=lambda o: o.logits, context_len=256,
                                  max_batch=3, on_step=steps.append)

        async def one(i: int):
            await asyncio.sleep(0.002 * i)
            return await engine.generate(tok.encode(prompts[i]), SamplingParams(max_tokens=lengths[i], temperature=0))
        return await asyncio.gather(*[one(i) for i in range(len(prompts))])

    done = asyncio.run(run())
    assert [d.text for d in done] == expected
    assert [d.completion_tokens for d in done] == lengths and all(d.finish_reason == "length" for d in done)
    assert max(steps) == 3 and sum(steps) == sum(lengths)  # every token came from a shared step


def test_seeded_sampling_is_the_same_alone_and_batched_and_stops_at_stop_strings(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny["model"]), local_files_only=True).eval()
    tok = HFTokenizer(str(tiny["model"]))
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7)

    async def run(others: int) -> list:
        engine = GenerationEngine(model, tok, kv_cache=True, logits_of=lambda o: o.logits, context_len=256)
        asks = [engine.generate(tok.encode("def f(x):"), params)]
        asks += [engine.generate(tok.encode("y" * (i + 1)), SamplingParams(max_tokens=20, seed=i)) for i in range(others)]
        return await asyncio.gather(*asks)

    alone, batched = asyncio.run(run(0))[0], asyncio.run(run(5))[0]
    assert alone.text == batched.text and alone.seed == 7
    other_seed = _run_one(model, tok, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=8))
    assert other_seed.text != alone.text
    cut = alone.text[3:5]
    stopped = _run_one(model, tok, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7, stop=(cut,)))
    assert stopped.finish_reason == "stop" and stopped.text == alone.text[:alone.text.index(cut)]


async def _one(model, tok, params: SamplingParams):
    engine = GenerationEngine(model, tok, kv_cache=True, logits_of=lambda o: o.logits, context_len=256)
    return await engine.generate(tok.encode("def f(x):"), params)


def _run_one(model, tok, params: SamplingParams):
    return asyncio.run(_one(model, tok, params))


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    stream = TextStream(ByteTokenizer(), stop=("END",))
    out = [stream.push(b) for b in "é!EN".encode()]
    assert out == ["", "é", "!", "", ""]  # é's first byte held; "EN" may start END
    assert stream.push(ord("D")) == "" and stream.stopped and stream.text == "é!"
    stream = TextStream(ByteTokenizer(), stop=("END",))
    for b in b"ENx":
        stream.push(b)
    assert stream.text == "ENx" and stream.finish() == ""


def test_requests_are_checked_against_the_context_and_the_deployment_limits():
    from raytrain_platform.serve.openai_api import prepare
    from raytrain_platform.serve.openai_schemas import ChatRequest, CompletionRequest

    entry = {"id": "m", "context_len": 16, "kv_cache": True, "stop_token_ids": [0]}
    tok = ByteTokenizer()

    def status(body: dict) -> tuple[int, str]:
        try:
            prepare(CompletionRequest.model_validate(body), entry, tok, max_new_tokens=8)
        except Exception as exc:  # starlette's HTTPException
            return exc.status_code, exc.detail
        return 200, ""

    [(ids, params)] = prepare(CompletionRequest.model_validate({"prompt": "abcdefghijkl"}), entry, tok,
                              max_new_tokens=8)
    assert len(ids) == 12 and params.max_tokens == 4 and params.stop_token_ids == (0,)  # default 16, room 4
    assert status({"prompt": "a" * 16})[1] == "prompt: 16 tokens; this model's maximum context length is 16 tokens " \
                                               "(prompt and completion together)"
    assert "at most 4" in status({"prompt": "a" * 12, "max_tokens": 5})[1]
    assert "at most 8 (the deployment's max_new_tokens)" in status({"prompt": "a", "max_tokens": 9})[1]
    with pytest.raises(Exception, match="chat template"):
        prepare(ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]}), entry, tok,
                max_new_tokens=8)


def test_a_limit_over_the_bounds_names_the_field_the_client_sent(tiny):
    from raytrain_platform.serve.http import APIError
    from raytrain_platform.serve.openai_api import prepare
    from raytrain_platform.serve.openai_schemas import ChatRequest

    tok = HFTokenizer(str(tiny["model"]))
    entry = {"id": "m", "context_len": 64, "kv_cache": True, "stop_token_ids": []}
    messages = [{"role": "user", "content": "hi"}]
    for field in ("max_tokens", "max_completion_tokens"):
        for asked, deployment_max, message in ((9, 8, f"{field}: 9; at most 8 (the deployment's max_new_tokens)"),
                                               (63, 100, f"{field}: 63; this model's maximum context length is 64")):
            with pytest.raises(APIError) as caught:
                prepare(ChatRequest.model_validate({"messages": messages, field: asked}), entry, tok,
                        max_new_tokens=deployment_max)
            assert caught.value.detail.startswith(message) and caught.value.param == field, caught.value.detail


class _NextId(torch.nn.Module):
    """A 512-id LM whose greedy next token is the last one plus 1: after a prompt of 253 it
    reaches 256, an id that is no byte (the byte tokenizer's decode raises)."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(512, 512)
        self.table.weight.data = 10 * torch.eye(512).roll(1, dims=1)  # row t peaks at t + 1

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)  # (B, T, vocab)


class _Refuses(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(256, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise ValueError("this model refuses\nwith a second line of detail")


def _byte_engine(model: torch.nn.Module) -> GenerationEngine:
    return GenerationEngine(model, ByteTokenizer(), kv_cache=False, logits_of=lambda out: out, context_len=8)


def test_a_token_the_tokenizer_cannot_decode_ends_that_request_only():
    """The error reaches that request; the others in the step, and later ones, are served."""
    greedy = SamplingParams(max_tokens=4, temperature=0)

    async def run() -> tuple:
        engine = _byte_engine(_NextId())
        bad, good = await asyncio.wait_for(asyncio.gather(
            engine.generate([253], greedy), engine.generate(list(b"a"), greedy), return_exceptions=True), 30)
        later = await asyncio.wait_for(engine.generate(list(b"k"), greedy), 30)
        return bad, good, later, engine.running

    bad, good, later, running = asyncio.run(run())
    assert isinstance(bad, ValueError) and "range(0, 256)" in str(bad), bad
    assert (good.text, good.finish_reason, later.text) == ("bcde", "length", "lmno") and running == []


def test_an_error_in_a_stream_is_one_event_of_one_line_then_done():
    from raytrain_platform.serve.openai_api import answer
    from raytrain_platform.serve.openai_schemas import CompletionRequest

    async def run() -> list[str]:
        body = CompletionRequest.model_validate({"prompt": "hi", "stream": True, "max_tokens": 2})
        entry = {"id": "m", "context_len": 8, "kv_cache": False, "stop_token_ids": []}
        stream = await answer(body, entry, ByteTokenizer(), _byte_engine(_Refuses()), max_new_tokens=8, step=0)
        return [event async for event in stream]

    events = asyncio.run(run())
    assert len(events) == 2 and events[-1] == "data: [DONE]\n\n", events
    error = json.loads(events[0].removeprefix("data: "))["error"]
    assert error["message"] == "internal error: ValueError: this model refuses" and error["type"] == "server_error"


def test_a_tiny_temperature_samples_the_argmax_and_zero_stays_greedy():
    """logits / 1e-300 would overflow to inf (softmax: NaN, the last id drawn)."""
    from raytrain_platform.serve.engine import sample_next

    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    for temperature in (0.0, 1e-300, 5e-324, 1e-40):
        for top_p in (1.0, 0.5):
            token = sample_next(logits, SamplingParams(temperature=temperature, top_p=top_p),
                                torch.Generator().manual_seed(0))
            assert token == 1, (temperature, top_p, token)


def test_text_stream_ends_before_the_earliest_stop_string_whatever_their_order():
    for stop in (("c", "abc"), ("abc", "c")):
        stream = TextStream(ByteTokenizer(), stop=stop)
        assert [stream.push(b) for b in b"xabc"] == ["x", "", "", ""], stop
        assert stream.stopped and stream.text == "x" and stream.finish() == ""


def test_vllm_config_for_an_hf_export_validates_against_ray_serve_llm(models, tmp_path, capsys):
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    out = tmp_path / "llm.yaml"
    assert rtp(["serve", f"tiny={models['export']}", "--write-config", str(out), "--engine", "vllm",
                "--min-replicas", "1", "--max-replicas", "4", "--downscale-delay-s", "120"]) == 0
    config = yaml.safe_load(out.read_text())
    app = config["applications"][0]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    llm = LLMConfig.model_validate(app["args"]["llm_configs"][0])
    assert llm.model_id == "tiny" and llm.model_loading_config.model_source == str(models["export"])
    assert llm.engine_kwargs["max_model_len"] == 256
    scaling = llm.deployment_config["autoscaling_config"]
    assert scaling["max_replicas"] == 4 and scaling["downscale_delay_s"] == 120 and scaling["upscale_delay_s"] == 30
    torch_config = tmp_path / "serve.yaml"  # --engine torch (default): this package's builder, hf paths as given
    assert rtp(["serve", f"tiny={models['export']}", str(models["sweep"]), "--write-config", str(torch_config)]) == 0
    args = yaml.safe_load(torch_config.read_text())["applications"][0]["args"]
    assert args["checkpoint"] == [f"tiny={models['export']}", f"a={models['sweep'] / 'a'}", f"b={models['sweep'] / 'b'}"]
    for argv, message in [([str(models["sweep"] / "a"), "--write-config", str(out), "--engine", "vllm"],
                           "--engine = 'vllm': expected Hugging Face folders (model 'a' is a hf checkpoint"),
                          ([str(models["export"]), "--engine", "vllm"], "add --write-config FILE"),
                          ([str(models["export"]), "--engine", "tgi"], "--engine = 'tgi': expected one of")]:
        assert rtp(["serve", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


# ---- over HTTP ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(models, ray_cluster):
    """One Serve app: the sweep (sweep/a, sweep/b), the export, the gpt and the user LM,
    on the module's Ray (whose workers import tests/user_models.py, as training did)."""

    from raytrain_platform.serve.builder import app

    checkpoint = (f"sweep={models['sweep']},tiny={models['export']},gpt={models['gpt']},user={models['user']},"
                  f"user_clf={models['user_clf']}")
    application = app({"checkpoint": checkpoint, **LIMITS, "trust_builder": True})  # the user runs
    with serve_app(application) as url:
        yield url


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(models):
    """The export, loaded by transformers itself, and its tokenizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(models["export"]), local_files_only=True).eval()
    return model, HFTokenizer(str(models["export"]))


def test_models_list_in_openai_shape_with_step_and_metrics(client, models):
    listed = {m.id: m for m in client.models.list()}
    assert set(listed) == {"sweep/a", "sweep/b", "tiny", "gpt", "user", "user_clf"}
    for name in ("tiny", "sweep/a"):  # OpenAI's retrieval: the model as listed
        assert client.models.retrieve(name).model_dump() == listed[name].model_dump()
    tiny_model = listed["tiny"]
    assert tiny_model.object == "model" and tiny_model.owned_by == "raytrain_platform" and tiny_model.created > 0
    extra = tiny_model.model_extra
    info = json.loads((models["export"] / "export.json").read_text())
    assert extra["step"] == 2 and extra["metrics"] == info["metrics"] and extra["context_len"] == 256
    assert extra["kv_cache"] and extra["stop_token_ids"] and listed["gpt"].model_extra["tokenizer"] is None


def test_completion_and_chat_match_transformers_greedy_with_usage(client, local):
    model, tok = local
    eos = list(model.generation_config.eos_token_id)
    prompt = "def main():\n"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    ids = tok.encode(prompt)
    reference = _reference_greedy(model, tok, ids, 12, eos)
    assert r.choices[0].text == tok.decode(reference) and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(reference)
    assert r.choices[0].finish_reason == ("stop" if reference[-1] in eos else "length")
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is os.path?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    chat_ids = tok.encode_rendered(tok.render_chat(messages))
    assert "<|im_start|>assistant" in tok.render_chat(messages)
    assert chat.choices[0].message.content == tok.decode(_reference_greedy(model, tok, chat_ids, 10, eos))
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == len(chat_ids)


def test_streaming_gives_the_same_text_as_one_response_and_ends_with_done(client, served):
    ask = {"model": "tiny", "prompt": "import sys\n", "max_tokens": 16, "temperature": 0.8, "seed": 3}
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # include_usage: last chunk
    messages = [{"role": "user", "content": "Say hi"}]
    chat_whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=5)
    chat_chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=5,
                                                      stream=True))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_whole.choices[0].message.content
    raw = requests.post(served + "/v1/completions", json={**ask, "stream": True}, stream=True, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.iter_lines(decode_unicode=True) if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    gone = requests.post(served + "/v1/completions", json={**ask, "max_tokens": 64, "stream": True}, stream=True,
                         timeout=60)
    next(gone.iter_lines())
    gone.close()  # a client that leaves mid-stream: its request leaves the batch, the server goes on
    assert client.completions.create(**ask).choices[0].text == whole.choices[0].text


def test_same_seed_same_text_while_batched_with_other_requests(client):
    def ask(seed: int, prompt: str = "class A:\n") -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=1.0,
                                         seed=seed).choices[0].text

    alone = ask(11)
    with ThreadPoolExecutor(12) as pool:
        jobs = [pool.submit(ask, 11)] + [pool.submit(ask, s, "x" * s) for s in range(1, 10)] + [pool.submit(ask, 11)]
        batched = [j.result() for j in jobs]
    assert batched[0] == batched[-1] == alone
    assert ask(12) != alone


def test_stop_strings_end_the_text_before_them(client):
    full = client.completions.create(model="tiny", prompt="def f():", max_tokens=20, temperature=1.0,
                                     seed=1).choices[0]
    stop = full.text[4:6]
    cut = client.completions.create(model="tiny", prompt="def f():", max_tokens=20, temperature=1.0, seed=1,
                                    stop=[stop, "zzzz"]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]


def test_typed_errors_in_openai_shape_and_the_server_lives_on(client, served):
    cases = [
        (openai.NotFoundError, {"model": "nope", "prompt": "a"}, "unknown model id 'nope'", "model"),
        (openai.BadRequestError, {"model": "tiny", "prompt": "word " * 400}, "maximum context length is 256 tokens",
         "prompt"),
        (openai.BadRequestError, {"model": "tiny", "prompt": "a", "max_tokens": 65}, "at most 64", "max_tokens"),
        (openai.BadRequestError, {"model": "tiny", "prompt": "a", "temperature": 3}, "temperature", "temperature"),
        (openai.BadRequestError, {"model": "tiny", "prompt": "a", "n": 17}, "17 is out of range: 1..16", "n"),
        (openai.BadRequestError, {"model": "tiny", "prompt": "a", "n": 0}, "0 is out of range: 1..16", "n"),
        (openai.BadRequestError, {"model": "tiny", "prompt": ""}, "non-empty", "prompt"),
        (openai.BadRequestError, {"model": "sweep/a", "prompt": "a", "extra_body": {"colour": 1}}, "colour", "colour"),
        # a field of two types names the field, and what each type needed (not pydantic's
        # union branch, "prompt.str"); a bad list item is named by its index
        (openai.BadRequestError, {"model": "tiny", "prompt": 123},
         "prompt: Input should be a valid string, or Input should be a valid list (got 123)", "prompt"),
        (openai.BadRequestError, {"model": "tiny", "prompt": "a", "stop": ["a", 5]},
         "stop.1: Input should be a valid string (got 5)", "stop.1"),
        (openai.BadRequestError, {"model": "tiny", "prompt": "a", "stream_options": {"include_usage": True}},
         "only with stream: true", "stream_options"),
    ]
    for kind, kwargs, message, param in cases:
        with pytest.raises(kind) as err:
            client.completions.create(**{"max_tokens": 4, **kwargs})
        body = err.value.body
        assert message in body["message"] and body["param"] == param, body
        assert len(body["message"].splitlines()) == 1
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:  # only text parts
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert err.value.body["param"] == "messages.0.content.0.type", err.value.body
    assert err.value.body["message"].startswith("messages.0.content.0.type: Input should be 'text' (got 'image_url')")
    r = requests.post(f"{served}/v1/completions", data=b'\xff\xfe{"prompt": "a"}', timeout=60,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "body: not a JSON object in UTF-8 (could not be read as UTF-8 JSON)", r.text
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("nope")
    assert err.value.body["code"] == "model_not_found" and "known ids: " in err.value.body["message"]
    r = requests.post(served + "/v1/generate", json={"prompt": "a", "model": "tiny"}, timeout=60)
    assert r.status_code == 400 and "use POST /v1/completions" in r.json()["error"]["message"]
    # JSON's \ud800 escape parses into a lone surrogate, which no tokenizer encodes: a 400, not a 500.
    for route, body in (("completions", {"model": "tiny", "prompt": "a\ud800b"}),
                        ("completions", {"model": "gpt", "prompt": "ok", "stop": ["\udfff"]}),
                        ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]})):
        r = requests.post(f"{served}/v1/{route}", data=json.dumps(body), timeout=60,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], (r.status_code, r.text)
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens >= 1


def test_byte_level_and_user_models_generate_through_their_family_hooks(client, served):
    gpt = client.completions.create(model="gpt", prompt="def main():", max_tokens=8, temperature=0)
    legacy = requests.post(served + "/v1/generate", json={"model": "gpt", "prompt": "def main():",
                                                         "max_new_tokens": 8, "temperature": 0}, timeout=60).json()
    assert gpt.choices[0].text == legacy["text"] and gpt.usage.prompt_tokens == len(b"def main():")
    user = client.completions.create(model="user", prompt="import os", max_tokens=6, seed=0)
    assert user.usage.completion_tokens == 6 and user.choices[0].finish_reason == "length"



def test_a_byte_level_model_scores_an_echoed_prompt_as_its_own_forward(client, models):
    """echo + logprobs through the re-running batch (no KV cache): the prompt's bytes'
    logprobs equal the gpt's own forward (float32, one forward each: 1e-4 as for hf)."""
    from raytrain_platform.inference import load_model_for_inference

    prompt = "def main():"
    r = client.completions.create(model="gpt", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and lp.tokens == list(prompt) and lp.token_logprobs[0] is None
    model, _, _ = load_model_for_inference(models["gpt"])
    ids = list(prompt.encode())
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)[:-1].gather(
            1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), reference, rtol=0, atol=1e-4)
    sampled = client.completions.create(model="gpt", prompt=prompt, max_tokens=3, logprobs=1, seed=0)
    assert len(sampled.choices[0].logprobs.token_logprobs) == sampled.usage.completion_tokens == 3


def test_a_user_classifier_predicts_through_its_family_hook(served, models, client):
    from raytrain_platform.inference import load_model_for_inference

    listed = {m.id: m.model_extra for m in client.models.list()}
    assert listed["user_clf"]["inputs"] == {"num_features": 16, "num_outputs": 4}  # read off the module
    rows = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).tolist()
    r = requests.post(served + "/v1/predict", json={"model": "user_clf", "rows": rows}, timeout=60)
    model, _, _ = load_model_for_inference(models["user_clf"], trust_builder=True)
    with torch.no_grad():
        local = torch.softmax(model(torch.tensor(rows)), -1)
    assert r.status_code == 200, r.text
    torch.testing.assert_close(torch.tensor(r.json()["probabilities"]), local)
    bad = requests.post(served + "/v1/predict", json={"model": "user_clf", "rows": [[1.0] * 3]}, timeout=60)
    assert bad.status_code == 422 and "expects 16" in bad.json()["error"]["message"]


def test_sweep_trials_by_model_field_with_an_lru_bound(client, served):
    def texts(model: str) -> list[str]:  # sampled with fixed seeds: the weights decide the text
        return [client.completions.create(model=model, prompt="def", max_tokens=12, seed=seed).choices[0].text
                for seed in (1, 2, 3)]

    a, b, exported = texts("sweep/a"), texts("sweep/b"), texts("tiny")
    assert a == exported and a != b and "".join(a), (a, b)  # the export is trial a; b trained differently
    loaded = requests.get(served + "/healthz", timeout=30).json()["loaded"]
    assert len(loaded) == LIMITS["max_models_per_replica"] and "tiny" in loaded


def _decode_stats(served: str) -> dict:
    return requests.get(served + "/healthz", timeout=30).json()["batches"].get(
        "decode", {"calls": 0, "requests": 0, "largest": 0})


def test_load_1000_requests_from_32_clients_without_errors_sharing_decode_steps(client, served):
    total, clients = 1000, 32
    before = _decode_stats(served)

    def one_request(i: int) -> str | None:
        r = client.completions.create(model="tiny", prompt=f"def f{i}(x):", max_tokens=4, seed=i)
        return None if r.usage.completion_tokens >= 1 else f"request {i}: no completion tokens"

    failures, elapsed = load_test(total, clients, one_request)
    after = _decode_stats(served)
    steps, rows = after["calls"] - before["calls"], after["requests"] - before["requests"]
    print(f"load: {total} requests from {clients} clients in {elapsed:.1f} s ({total / elapsed:.0f} req/s); "
          f"{rows / max(steps, 1):.1f} rows per forward step, largest {after['largest']}")
    assert not failures, (len(failures), failures[:3])
    assert rows / steps >= 3, (steps, rows)  # concurrent requests share forwards (5.6 measured)
