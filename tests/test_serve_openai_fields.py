"""OpenAI's request fields beyond the basics, for real: prompt lists and token ids, ``n``,
``logprobs`` / ``top_logprobs``, ``echo``, penalties, ``logit_bias``, ``response_format``
(xgrammar), over one Serve app on 127.0.0.1 serving a tiny Hugging Face Llama folder
(tools/tiny_llm.py, offline; its final norm scaled up so its next-token distributions are
peaked, as a trained model's are, not near-uniform).

Independent references: every answer, streamed or not, through the ``openai`` client and
plain HTTP, is validated with `jsonschema` against the schemas of OpenAI's own API
description (tests/openai_conformance.py), and the table of requests x schema is
printed; logprobs equal a ``transformers`` forward's log-softmax on the same tokens;
penalties and ``logit_bias`` equal a greedy loop written from OpenAI's formula.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
import requests
import torch
from conftest import serve_app
from openai_conformance import OpenAISchemas

from raytrain_platform.serve.engine import SamplingParams, adjusted
from raytrain_platform.serve.text import HFTokenizer

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

LIMITS = {"max_models_per_replica": 1, "max_batch_size": 32, "max_new_tokens": 64, "cpus_per_replica": 1}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
          "required": ["ok", "kind"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
# float32 logits from a batched KV-cache forward vs one unbatched forward: 2e-6 measured
# at most; OpenAI's logprobs are rounded far coarser than the 1e-4.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def folder(tiny, tmp_path_factory) -> Path:
    """The tiny Llama with its final norm x 8: logits x 8, peaked distributions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("sharp") / "model"
    model = AutoModelForCausalLM.from_pretrained(str(tiny["model"]), local_files_only=True)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tiny["model"]), local_files_only=True).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def served(folder, ray_cluster):

    from raytrain_platform.serve.builder import app

    with serve_app(app({"checkpoint": f"tiny={folder}", **LIMITS})) as url:
        yield url


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval(), HFTokenizer(str(folder))


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab): position i's log-softmax over the token after it."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


# ---- without Ray ---------------------------------------------------------------------------

def test_penalties_and_bias_follow_openais_formula():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((0, 10.0), (3, -100.0)))
    out = adjusted(logits, params, {1: 3, 3: 1}, None)  # token 1 generated 3 times, token 3 once
    torch.testing.assert_close(out, torch.tensor([11.0, 2.0 - 3 * 0.25 - 0.5, 3.0, 4.0 - 100 - 0.25 - 0.5]))
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0]  # the raw logits (the logprobs') are left as they were


def test_tool_choice_none_is_a_plain_answer_and_any_tool_is_refused():
    from pydantic import ValidationError

    from raytrain_platform.serve.openai_schemas import ChatRequest

    messages = [{"role": "user", "content": "hi"}]
    assert ChatRequest.model_validate({"messages": messages, "tool_choice": "none", "tools": []}).tools == []
    for field, value in (("tool_choice", "auto"), ("tools", [{"type": "function"}])):
        with pytest.raises(ValidationError, match="tool calling is not supported"):
            ChatRequest.model_validate({"messages": messages, field: value})


# ---- over HTTP ---------------------------------------------------------------------------------

def _requests(prompt_ids: list[int]) -> list[tuple[str, str, dict]]:
    """(name, route, body) covering every field."""
    c, chat = "completions", "chat/completions"
    msgs = [{"role": "user", "content": "Name a colour."}]
    return [
        ("prompt: string", c, {"prompt": "def f(x):", "max_tokens": 6}),
        ("prompt: list of strings", c, {"prompt": ["def f(x):", "import os"], "max_tokens": 6}),
        ("prompt: token ids", c, {"prompt": prompt_ids, "max_tokens": 6}),
        ("prompt: list of token-id lists", c, {"prompt": [prompt_ids, prompt_ids[:2]], "max_tokens": 6}),
        ("n: 3, seed", c, {"prompt": "x = ", "n": 3, "seed": 1, "max_tokens": 6}),
        ("logprobs: 5", c, {"prompt": "def f(x):", "logprobs": 5, "max_tokens": 6}),
        ("logprobs: 0", c, {"prompt": "def f(x):", "logprobs": 0, "max_tokens": 4}),
        ("echo", c, {"prompt": "def f(x):", "echo": True, "max_tokens": 4}),
        ("echo + logprobs: 2", c, {"prompt": "def f(x):", "echo": True, "logprobs": 2, "max_tokens": 4}),
        ("echo + logprobs, max_tokens: 0", c, {"prompt": ["def f(x):", "import"], "echo": True, "logprobs": 1,
                                              "max_tokens": 0}),
        ("lm-evaluation-harness's loglikelihood request", c, {"prompt": [prompt_ids, prompt_ids[:3]], "echo": True,
                                                              "logprobs": 1, "max_tokens": 1, "temperature": 0,
                                                              "seed": 1234}),
        ("penalties", c, {"prompt": "a a a", "presence_penalty": 1.5, "frequency_penalty": -1.0, "max_tokens": 6}),
        ("logit_bias", c, {"prompt": "def", "logit_bias": {"65": 5, "66": -100}, "max_tokens": 6}),
        ("response_format: json_schema", c, {"prompt": "JSON:", "response_format": JSON_SCHEMA, "max_tokens": 24}),
        ("stop, temperature 0, top_p", c, {"prompt": "def", "stop": ["\n"], "temperature": 0, "top_p": 0.5,
                                           "max_tokens": 6}),
        ("chat: plain", chat, {"messages": msgs, "max_tokens": 6}),
        ("chat: n: 2, seed", chat, {"messages": msgs, "n": 2, "seed": 4, "max_tokens": 6}),
        ("chat: logprobs, top_logprobs: 3", chat, {"messages": msgs, "logprobs": True, "top_logprobs": 3,
                                                  "max_tokens": 6}),
        ("chat: penalties, logit_bias", chat, {"messages": msgs, "presence_penalty": -2, "frequency_penalty": 2,
                                              "logit_bias": {"70": 3}, "max_completion_tokens": 6}),
        ("chat: response_format json_object", chat, {"messages": msgs, "response_format": {"type": "json_object"},
                                                     "max_tokens": 12}),
        ("chat: response_format json_schema", chat, {"messages": msgs, "response_format": JSON_SCHEMA,
                                                     "max_tokens": 24}),
    ]


ERRORS = [  # (name, route, body, param, words in the message)
    ("n over the bound", "completions", {"prompt": "a", "n": 17}, "n", "17 is out of range: 1..16"),
    ("presence_penalty 2.5", "completions", {"prompt": "a", "presence_penalty": 2.5}, "presence_penalty",
     "2.5 is out of range: -2.0..2.0"),
    ("frequency_penalty -3", "chat/completions", {"frequency_penalty": -3}, "frequency_penalty",
     "-3.0 is out of range: -2.0..2.0"),
    ("logit_bias 101", "completions", {"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias",
     "token 5: 101 is out of range: -100..100"),
    ("logit_bias key", "completions", {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "'x' is not a token id"),
    ("logit_bias id over the vocabulary", "completions", {"prompt": "a", "logit_bias": {"512": 1}}, "logit_bias",
     "token id 512; this model's ids are 0..511"),
    ("prompt id over the vocabulary", "completions", {"prompt": [1, 999]}, "prompt", "token id 999"),
    ("logprobs 6", "completions", {"prompt": "a", "logprobs": 6}, "logprobs", "6 is out of range: 0..5"),
    ("top_logprobs 21", "chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
    ("top_logprobs without logprobs", "chat/completions", {"top_logprobs": 2}, "top_logprobs",
     "only with logprobs: true"),
    ("max_tokens 0 without echo", "completions", {"prompt": "a", "max_tokens": 0}, "max_tokens",
     "0 only with echo: true"),
    ("65 prompts", "completions", {"prompt": ["a"] * 65}, "prompt", "65 prompts; 1..64"),
    ("tools", "chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tool calling is not supported"),
    ("best_of 2", "completions", {"prompt": "a", "best_of": 2}, "best_of", "best_of = 1 only"),
    ("response_format: a schema xgrammar refuses", "chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "response_format.json_schema.schema: xgrammar cannot compile it"),
]


def _send(client: openai.OpenAI, served: str, via: str, route: str, body: dict, stream: bool) -> list:
    """The JSON objects of one answer (the response, or each chunk) as sent on the wire."""
    body = {"model": "tiny", **body, **({"stream": True, "stream_options": {"include_usage": True}} if stream else {})}
    if via == "http":
        r = requests.post(f"{served}/v1/{route}", json=body, stream=stream, timeout=120)
        assert r.status_code == 200, r.text
        if not stream:
            return [r.json()]
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    else:
        endpoint = client.completions if route == "completions" else client.chat.completions
        fields = {k: v for k, v in body.items() if k not in ("model", "prompt", "messages", "stream")}
        known = {"model": "tiny", **({"prompt": body["prompt"]} if "prompt" in body else {"messages": body["messages"]})}
        if not stream:
            raw = endpoint.with_raw_response.create(**known, extra_body=fields)
            return [raw.http_response.json()]
        with endpoint.with_streaming_response.create(**known, stream=True, extra_body=fields) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines), lines[-3:]
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# Two places where OpenAI's document and OpenAI's API (which this server follows) part:
# the document types completions' token_logprobs items as number and top_logprobs items
# as object, while the API sends null for an echoed prompt's first token; and it gives
# streamed completion chunks the whole response's schema, whose finish_reason is a
# string, while the API sends null until a choice's last chunk. These are the only
# errors the table lets through, only where they apply, and it names them.
_ECHO_NULLS = {"logprobs/token_logprobs/0: None is not of type 'number'",
               "logprobs/top_logprobs/0: None is not of type 'object'"}
_STREAM_NULLS = {"finish_reason: None is not of type 'string'",
                 "finish_reason: None is not one of ['stop', 'length', 'content_filter']"}


def _verdict(name: str, errors: list[str], streamed_completion: bool = False) -> str:
    allowed = (_ECHO_NULLS if "echo + logprobs" in name or "loglikelihood" in name else set()) | (_STREAM_NULLS if streamed_completion else set())
    found = {e.split("/", 2)[-1] for e in errors}  # without "choices/N/"
    assert found <= allowed, (name, sorted(found - allowed))
    notes = (["echo's first logprob null"] if found & _ECHO_NULLS else []) + (
        ["finish_reason null before the last chunk"] if found & _STREAM_NULLS else [])
    return "valid" + (f" except the document's gap: {', '.join(notes)}" if notes else "")


def test_every_answer_validates_against_openais_schemas(client, served, local):
    schemas = OpenAISchemas()
    rows: list[tuple[str, str, str, str]] = []
    prompt_ids = local[1].encode("def f(x):")
    for name, route, body in _requests(prompt_ids):
        chat = route.startswith("chat")
        for stream in (False, True):
            schema = ("CreateChatCompletionStreamResponse" if stream else "CreateChatCompletionResponse") if chat \
                else "CreateCompletionResponse"
            for via in ("openai", "http"):
                objects = _send(client, served, via, route, body, stream)
                errors = [e for obj in objects for e in schemas.validate(schema, obj)]
                verdict = _verdict(name, errors, streamed_completion=stream and not chat)
                rows.append((name, f"{via}{' stream' if stream else ''}", schema, verdict))
                if chat and not stream:
                    assert all(c["message"]["refusal"] is None for c in objects[0]["choices"])
    msgs = [{"role": "user", "content": "hi"}]
    for name, route, body, param, words in ERRORS:
        full = {"model": "tiny", **({"messages": msgs} if route.startswith("chat") else {}), **body}
        r = requests.post(f"{served}/v1/{route}", json=full, timeout=60)
        error = r.json()
        message = error["error"]["message"]
        assert r.status_code == 400 and error["error"]["param"] == param and message.startswith(param), (name, error)
        assert words in message, \
            (name, r.status_code, error)
        assert len(error["error"]["message"].splitlines()) == 1
        rows.append((f"error: {name}", "http", "ErrorResponse", _verdict(name, schemas.validate("ErrorResponse", error))))
    listed = requests.get(f"{served}/v1/models", timeout=30).json()
    rows.append(("GET /v1/models", "http", "ListModelsResponse", _verdict("", schemas.validate("ListModelsResponse", listed))))
    one = client.models.with_raw_response.retrieve("tiny").http_response.json()
    rows.append(("GET /v1/models/tiny", "openai", "Model", _verdict("", schemas.validate("Model", one))))
    print("\n| request | via | schema | result |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    assert len(rows) == 4 * len(_requests(prompt_ids)) + len(ERRORS) + 2


def _check_choice_logprobs(model, prompt: list[int], tokens: list[int], logprobs: list[float],
                           tops: list[dict[int, float]]) -> float:
    """The server's logprobs of `tokens` after `prompt` (and its top alternatives) against
    one forward of transformers; returns the largest difference."""
    reference = _forward_logprobs(model, prompt + tokens)[len(prompt) - 1:-1]  # row i predicts tokens[i]
    expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=0, atol=TOLERANCE)
    worst = float((torch.tensor(logprobs) - expected).abs().max())
    for row, top in zip(reference, tops):
        ids = list(top)
        torch.testing.assert_close(torch.tensor([top[i] for i in ids]), row[ids], rtol=0, atol=TOLERANCE)
        assert set(row.topk(len(top) - 1 if len(top) > 1 else 1).indices.tolist()) <= set(ids)
    return worst


def test_logprobs_equal_a_transformers_forward_batched_or_alone_streamed_or_not(client, served, local):
    model, tok = local
    prompts = ["def f(x):", "import os\nimport sys\n", "class A:"]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 12,
            "logprobs": 5, "echo": True, "return_tokens_as_token_ids": True}
    worst = 0.0

    def check(choices: list[dict], asked: list[str] = prompts) -> list[list[int]]:
        nonlocal worst
        out = []
        for choice in sorted(choices, key=lambda c: c["index"]):
            prompt = tok.encode(asked[choice["index"] // 2])
            lp = choice["logprobs"]
            ids = _ids(lp["tokens"])
            assert ids[:len(prompt)] == prompt and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            tops = [{int(k.removeprefix("token_id:")): v for k, v in t.items()} for t in lp["top_logprobs"][1:]]
            worst = max(worst, _check_choice_logprobs(model, prompt[:1], ids[1:], lp["token_logprobs"][1:], tops))
            out.append(ids[len(prompt):])
        return out

    whole = requests.post(f"{served}/v1/completions", json=body, timeout=120).json()
    batched = check(whole["choices"])
    with ThreadPoolExecutor(8) as pool:  # the same request while others share its decode steps
        others = [pool.submit(requests.post, f"{served}/v1/completions", timeout=120,
                              json={"model": "tiny", "prompt": "x" * i, "max_tokens": 20, "seed": i}) for i in range(1, 7)]
        again = pool.submit(requests.post, f"{served}/v1/completions", json=body, timeout=120)
        assert all(o.result().status_code == 200 for o in others)
        assert check(again.result().json()["choices"]) == batched  # same seed, same samples
    alone = requests.post(f"{served}/v1/completions", json={**body, "prompt": prompts[1]}, timeout=120).json()
    assert check(alone["choices"], [prompts[1]]) == batched[2:4]  # prompt 1's choices, alone: the same tokens, same logprobs
    streamed: dict[int, dict] = {}
    for chunk in _send(client, served, "openai", "completions", {**body, "model": "tiny"}, stream=True):
        for c in chunk["choices"]:
            merged = streamed.setdefault(c["index"], {"index": c["index"], "logprobs": {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}})
            for key in merged["logprobs"]:
                merged["logprobs"][key] += (c["logprobs"] or {}).get(key, [])
    assert check(list(streamed.values())) == batched
    for choice in whole["choices"]:  # the chunks' lists, joined, are the whole answer's
        for key in ("tokens", "text_offset"):
            assert streamed[choice["index"]]["logprobs"][key] == choice["logprobs"][key], key
    # chat: content logprobs of each choice against the rendered conversation's forward
    messages = [{"role": "user", "content": "Say something."}]
    prompt = tok.encode_rendered(tok.render_chat(messages))
    chat_body = {"messages": messages, "n": 2, "seed": 9, "max_tokens": 10, "logprobs": True, "top_logprobs": 4,
                 "return_tokens_as_token_ids": True}
    for stream in (False, True):
        contents: dict[int, list] = {}
        for obj in _send(client, served, "http", "chat/completions", chat_body, stream):
            for c in obj["choices"]:
                contents.setdefault(c["index"], []).extend((c.get("logprobs") or {}).get("content") or [])
        for content in contents.values():
            ids = _ids([t["token"] for t in content])
            tops = [{int(t["token"].removeprefix("token_id:")): t["logprob"] for t in e["top_logprobs"]}
                    | {ids[i]: e["logprob"]} for i, e in enumerate(content)]
            worst = max(worst, _check_choice_logprobs(model, prompt, ids, [e["logprob"] for e in content], tops))
    print(f"logprobs: largest difference from transformers' log_softmax {worst:.2e}")


def test_n_samples_with_a_seed_are_reproducible(client):
    def texts(**kw) -> list[str]:
        r = client.completions.create(model="tiny", prompt="def g(", max_tokens=12, temperature=1.0, **kw)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    three = texts(n=3, seed=21)
    assert texts(n=3, seed=21) == three and len(set(three)) > 1  # reproducible, and not one sample thrice
    assert [texts(seed=21 + k)[0] for k in range(3)] == three  # choice k samples with seed + k


def _greedy_reference(model, prompt: list[int], steps: int, bias: dict[int, float], presence: float,
                      frequency: float) -> list[int]:
    """Greedy decoding with OpenAI's penalties and logit_bias, written out here."""
    ids, counts = list(prompt), {}
    for _ in range(steps):
        logits = _forward_logprobs(model, ids)[-1].clone()  # log_softmax: argmax unchanged by the shift
        for token, b in bias.items():
            logits[token] += b
        for token, count in counts.items():
            logits[token] -= count * frequency + presence
        token = int(logits.argmax())
        ids.append(token)
        counts[token] = counts.get(token, 0) + 1
    return ids[len(prompt):]


def test_penalties_and_logit_bias_match_a_greedy_loop_of_openais_formula(client, local):
    model, tok = local
    prompt = tok.encode("for i in range(")
    free = _ids(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                                          extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.tokens)
    cases = [({}, 1.5, 0.0), ({}, 0.0, 1.0), ({str(free[0]): -100, "100": 4.0}, 0.5, 0.5)]
    for bias, presence, frequency in cases:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                                      presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias,
                                      extra_body={"return_tokens_as_token_ids": True})
        got = _ids(r.choices[0].logprobs.tokens)
        expected = _greedy_reference(model, prompt, len(got), {int(k): v for k, v in bias.items()}, presence, frequency)
        assert got == expected, (bias, presence, frequency, got, expected)
        assert not bias or got[0] != free[0]  # the free run's first token, banned
    forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, seed=0, logit_bias={"100": 100},
                                       logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    assert _ids(forced.choices[0].logprobs.tokens) == [100] * 5


def test_response_format_json_schema_and_json_object_hold_per_sequence(client, local):
    messages = [{"role": "user", "content": "Answer in JSON."}]
    r = client.chat.completions.create(model="tiny", messages=messages, n=4, seed=3, max_tokens=30,
                                       response_format=JSON_SCHEMA)
    answers = [json.loads(c.message.content) for c in r.choices]  # each its own grammar state, in one batch
    for answer, choice in zip(answers, r.choices):
        jsonschema.validate(answer, SCHEMA)
        assert choice.finish_reason == "stop"
    plain = client.chat.completions.create(model="tiny", messages=messages, seed=3, max_tokens=30)
    with pytest.raises(json.JSONDecodeError):  # the same sample unconstrained is no JSON
        json.loads(plain.choices[0].message.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, seed=3, max_tokens=30, response_format=JSON_SCHEMA, stream=True)
        if c.choices)
    assert streamed == r.choices[0].message.content
    completion = client.completions.create(model="tiny", prompt="{", n=2, seed=1, max_tokens=30,
                                           extra_body={"response_format": JSON_SCHEMA})
    for choice in completion.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    # json_object: any object; "}" favoured by a bias, and where the grammar allows it the
    # object closes, then only the end-of-sequence token is allowed
    closing = local[1].encode("}")
    assert len(closing) == 1
    obj = client.chat.completions.create(model="tiny", messages=messages, seed=2, max_tokens=40,
                                         response_format={"type": "json_object"}, logit_bias={str(closing[0]): 30})
    assert json.loads(obj.choices[0].message.content) == {} and obj.choices[0].finish_reason == "stop"
