"""API keys on the served endpoints: one Serve app on 127.0.0.1 for the module (a tiny
Hugging Face Llama from tools/tiny_llm.py, offline) started with two keys; the official
``openai`` client and plain HTTP as clients. Without Ray: the comparison itself, the
``rtp serve`` checks, the warning for an open non-loopback address, and ``--write-config``
files that carry the setting but no key.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

import openai
import pytest
import requests
import yaml
from conftest import serve_app

from raytrain_platform.cli import main as rtp
from raytrain_platform.errors import ConfigError
from raytrain_platform.serve import auth
from raytrain_platform.serve.options import parse_serve_args

# Distinctive keys: the log scan below looks for these exact strings.
KEYS = [f"sk-rtp-test-{secrets.token_hex(12)}", f"sk-rtp-other-{secrets.token_hex(12)}"]
WRONG = f"sk-rtp-wrong-{secrets.token_hex(12)}"
ROUTES = [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
          ("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
          ("POST", "/v1/generate", {"model": "tiny", "prompt": "a"}),
          ("POST", "/v1/predict", {"model": "tiny", "rows": [[1.0]]})]


# ---- without Ray ---------------------------------------------------------------------------------

def test_every_configured_key_is_compared_whatever_matched(monkeypatch):
    """Constant time: as many `hmac.compare_digest` calls for a match on the first key,
    on the last, and for a miss; a missing header, another scheme or an empty token fail."""
    calls: list[int] = []
    real = hmac.compare_digest

    def counted(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counted)
    keys = auth.digests(["k1", "k2", "k3"])
    for header, expected in (("Bearer k1", True), ("Bearer k3", True), ("bearer k2", True),
                             ("Bearer k4", False), ("Bearer k", False), ("Basic k1", False),
                             ("k1", False), (None, False), ("Bearer ", False)):
        calls.clear()
        assert auth.is_authorized(header, keys) is expected, header
        assert len(calls) == 3, (header, len(calls))


def test_keys_from_flags_and_environment_are_checked_without_showing_them(monkeypatch):
    assert auth.parse_api_keys(["a", "b,c", "a"], source="--api-key") == ("a", "b", "c")
    for bad in ("secret with space", "sécret"):
        with pytest.raises(ConfigError) as err:
            auth.parse_api_keys(bad, source="--api-key")
        assert bad not in str(err.value) and "(not shown)" in str(err.value)
    monkeypatch.delenv("RTP_TEST_KEYS", raising=False)
    with pytest.raises(ConfigError, match="RTP_TEST_KEYS is unset or empty"):
        parse_serve_args({"checkpoint": "/tmp", "api_key_env": "RTP_TEST_KEYS"})
    monkeypatch.setenv("RTP_TEST_KEYS", f" {KEYS[0]} ,{KEYS[1]}")
    opts = parse_serve_args({"checkpoint": "/tmp", "api_key_env": "RTP_TEST_KEYS"})
    assert opts.api_key_digests == auth.digests(KEYS)
    assert KEYS[0] not in repr(opts) and KEYS[0] not in repr(opts.to_args())
    assert opts.to_args()["api_key_env"] == "RTP_TEST_KEYS"
    assert auth.is_loopback("127.0.0.1") and auth.is_loopback("::1") and auth.is_loopback("localhost")
    assert not auth.is_loopback("0.0.0.0") and not auth.is_loopback("10.1.2.3") and not auth.is_loopback("myhost")


def test_write_config_records_the_variable_and_never_a_key(tiny, tmp_path, capsys, monkeypatch):
    """From --api-key or from RTP_API_KEY, the file names RTP_API_KEY and holds no key; the
    builder reads the keys where it runs (`serve deploy`), and refuses to build without them."""
    monkeypatch.delenv("RTP_API_KEY", raising=False)
    model = str(tiny["model"])
    flagged = tmp_path / "flags.yaml"
    assert rtp(["serve", f"tiny={model}", "--write-config", str(flagged), "--api-key", KEYS[0],
                "--api-key", KEYS[1], "--host", "0.0.0.0"]) == 0
    out = capsys.readouterr()
    assert "not written to the config" in out.err and "warning" not in out.err  # keys set: not open
    monkeypatch.setenv("RTP_API_KEY", ",".join(KEYS))
    from_env = tmp_path / "env.yaml"
    assert rtp(["serve", f"tiny={model}", "--write-config", str(from_env)]) == 0
    capsys.readouterr()
    for path in (flagged, from_env):
        text = path.read_text()
        assert not any(k in text for k in KEYS), text
        args = yaml.safe_load(text)["applications"][0]["args"]
        assert args["api_key_env"] == "RTP_API_KEY"
        assert parse_serve_args(args).api_key_digests == auth.digests(KEYS)  # what the builder does there
    monkeypatch.delenv("RTP_API_KEY")
    with pytest.raises(ConfigError, match="RTP_API_KEY is unset or empty"):
        parse_serve_args(yaml.safe_load(flagged.read_text())["applications"][0]["args"])


def test_an_open_address_is_warned_about_and_bad_keys_are_one_line(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RTP_API_KEY", raising=False)
    model = str(tiny["model"])
    assert rtp(["serve", f"tiny={model}", "--write-config", str(tmp_path / "a.yaml"), "--host", "0.0.0.0"]) == 0
    err = capsys.readouterr().err
    assert "warning: --host 0.0.0.0 is reachable from other machines and no API key is set" in err, err
    assert rtp(["serve", f"tiny={model}", "--write-config", str(tmp_path / "b.yaml")]) == 0  # loopback
    assert "warning" not in capsys.readouterr().err
    assert rtp(["serve", f"tiny={model}", "--write-config", str(tmp_path / "c.yaml"), "--api-key", "two words"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --api-key = '(not shown)'") and "two words" not in err and len(err.splitlines()) == 1
    assert rtp(["serve", f"tiny={model}", "--write-config", str(tmp_path / "d.yaml"), "--engine", "vllm",
                "--api-key", KEYS[0]]) == 2
    err = capsys.readouterr().err
    assert "torch with API keys" in err and KEYS[0] not in err and len(err.splitlines()) == 1


# ---- over HTTP -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tiny, ray_cluster):
    """The tiny model served with the two keys, from RTP_API_KEY as `serve deploy` reads them."""
    import os


    from raytrain_platform.serve.builder import app

    os.environ["RTP_API_KEY"] = ",".join(KEYS)
    try:
        application = app({"checkpoint": f"tiny={tiny['model']}", "api_key_env": "RTP_API_KEY",
                           "max_new_tokens": 8, "cpus_per_replica": 1})
    finally:
        del os.environ["RTP_API_KEY"]
    with serve_app(application) as url:
        yield url


def _client(served: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served + "/v1", api_key=key, max_retries=0, timeout=120)


def test_each_key_opens_every_route_through_the_openai_client(served):
    for key in KEYS:
        client = _client(served, key)
        assert [m.id for m in client.models.list()] == ["tiny"]
        done = client.completions.create(model="tiny", prompt="def main():", max_tokens=3, temperature=0)
        assert done.usage.completion_tokens >= 1
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert chat.choices[0].message.role == "assistant"
    health = requests.get(served + "/healthz", headers={"Authorization": f"Bearer {KEYS[1]}"}, timeout=60).json()
    assert health["models"] == ["tiny"] and health["loaded"] == ["tiny"]


def test_no_key_or_a_wrong_one_is_a_401_in_openai_shape_that_shows_no_model(served):
    with pytest.raises(openai.AuthenticationError) as err:
        _client(served, WRONG).models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key", err.value.body
    with pytest.raises(openai.AuthenticationError):
        _client(served, WRONG).completions.create(model="tiny", prompt="a", max_tokens=2)
    for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": f"Basic {KEYS[0]}"},
                    {"Authorization": f"Bearer {KEYS[0]}x"}):
        for method, route, body in ROUTES:
            r = requests.request(method, served + route, json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (route, headers, r.status_code, r.text)
            error = r.json()["error"]
            assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}, r.text
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
            assert r.headers["WWW-Authenticate"] == "Bearer"
            assert "tiny" not in r.text and WRONG not in r.text and KEYS[0] not in r.text, r.text
            assert len(error["message"].splitlines()) == 1
    health = requests.get(served + "/healthz", timeout=60)
    assert health.status_code == 200 and health.json()["models"] == [] and "tiny" not in health.text
    assert requests.get(served + "/docs", timeout=60).status_code == 200  # no model named there


def test_keys_are_never_logged(served):
    """After right and wrong keys were sent (the tests above, and these), no file under
    Ray's logs (Serve's proxy and replica access logs, the controller, the workers) holds
    any of them."""
    import ray

    requests.get(served + "/v1/models", headers={"Authorization": f"Bearer {WRONG}"}, timeout=60)
    _client(served, KEYS[0]).models.list()
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    scanned = 0
    for path in logs.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            scanned += 1
            for key in (*KEYS, WRONG):
                assert key.encode() not in data, f"{key[:12]}... in {path}"
    serve_logs = list((logs / "serve").glob("*.log"))
    assert scanned and serve_logs and any(b"/v1/models" in p.read_bytes() for p in serve_logs)  # access lines
