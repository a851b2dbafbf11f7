"""Serving's text side without Ray: `TextStream` (stop strings across split characters,
the completion's leading space with SentencePiece-style tokenizers), the engine and the
OpenAI request checks over real tokenizers trained here, offline, on a few strings."""

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from raytrain_platform.serve import openai_api
from raytrain_platform.serve.engine import GenerationEngine
from raytrain_platform.serve.openai_schemas import ChatRequest, CompletionRequest
from raytrain_platform.serve.schemas import GenerateRequest
from raytrain_platform.serve.text import ByteTokenizer, HFTokenizer, TextStream

CORPUS = ["Hello world, hello there world. The world is big.", "hello, hello again; say hello to the world",
          "def main():\n    return 0\n"] * 50


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory) -> HFTokenizer:
    """A byte-level BPE (as tools/tiny_llm.py builds one): characters outside the corpus
    are split into their UTF-8 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    out = tmp_path_factory.mktemp("byte_bpe")
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(str(out))
    return HFTokenizer(str(out))


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory) -> HFTokenizer:
    """A SentencePiece-style BPE (Llama-2, Mistral): Metaspace pre-tokenizer, byte fallback,
    and a decoder that strips the text's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    out = tmp_path_factory.mktemp("metaspace")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", bos_token="<s>",
                            unk_token="<unk>").save_pretrained(str(out))
    return HFTokenizer(str(out))


def _run(stream: TextStream, ids: list[int]) -> str:
    """Every delta the stream releases, joined (what a streamed response shows)."""
    deltas = []
    for token in ids:
        deltas.append(stream.push(token))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    return "".join(deltas)


# ---- 1. a stop string whose first character is split across tokens -----------------------

@pytest.mark.parametrize("text, stop, expected", [("xaé", "aé", "x"), ("ok\n日本語", "\n日本", "ok"),
                                                  ("xé", "é", "x"), ("ab\n\nc", "\n\n", "ab")])
def test_stop_split_character_byte_tokenizer(text, stop, expected):
    stream = TextStream(ByteTokenizer(), stop=(stop,))
    assert _run(stream, list(text.encode())) == expected
    assert stream.text == expected and stream.stopped


def test_stop_split_character_byte_level_bpe(byte_bpe):
    ids = byte_bpe.encode("hello, 日本")
    assert len(byte_bpe.encode("日本")) > 2  # 日 and 本 come as several byte tokens each
    stream = TextStream(byte_bpe, stop=(", 日",))
    assert _run(stream, ids) == "hello"
    assert stream.text == "hello" and stream.stopped


@pytest.mark.parametrize("tokenizer", ["bytes", "byte_bpe"])
def test_stop_never_leaks(tokenizer, request):
    """Every stop string cut from a text with multi-byte characters: the released text
    (streamed deltas and the whole text alike) is the text before its first occurrence."""
    tok = ByteTokenizer() if tokenizer == "bytes" else request.getfixturevalue("byte_bpe")
    text = "say aé, 日本 ok—é! 日"
    ids = tok.encode(text)
    for start in range(len(text)):
        for end in range(start + 1, min(start + 4, len(text)) + 1):
            stop = text[start:end]
            stream = TextStream(tok, stop=(stop, "zz"))
            streamed = _run(stream, ids)
            assert streamed == stream.text == text[:text.find(stop)], (stop, streamed)


# ---- 2. the completion's leading space (SentencePiece-style decoders) --------------------

def test_completion_keeps_leading_space_metaspace(metaspace):
    prompt, generated = metaspace.encode("Hello"), metaspace.encode("Hello world")
    assert metaspace._tok.convert_ids_to_tokens(generated[len(prompt):]) == ["▁world"]
    stream = TextStream(metaspace, prompt=prompt)
    assert _run(stream, generated[len(prompt):]) == stream.text == " world"


def test_byte_level_text_unchanged_by_prompt(byte_bpe):
    """Byte-level BPE: the text with the prompt's ids decoded first is the generated
    ids' own text, whatever the prompt (its last ids may begin inside a character)."""
    generated = byte_bpe.encode(" world, 日本 again")
    for prompt in ("hello", "日本", "say 本", "x"):
        stream = TextStream(byte_bpe, prompt=byte_bpe.encode(prompt))
        assert _run(stream, generated) == stream.text == byte_bpe.decode(generated)


# ---- 2b. incremental decoding: the whole decode's text, at a bounded cost a token ---------

LONG = ("Hello world, hello there. 日本語 ok—é! def main():\n    return 0\n  say hello again; 😀 "
        "the world is big.\n\n") * 8


class CountingTokenizer(HFTokenizer):
    """The real tokenizer, counting the ids it is asked to decode."""

    def __init__(self, real: HFTokenizer):
        self.__dict__.update(real.__dict__)
        self.decoded_ids = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded_ids += len(ids)
        return super().decode(ids)


@pytest.mark.parametrize("tokenizer", ["byte_bpe", "metaspace"])
def test_incremental_text_is_the_whole_decode(tokenizer, request):
    """Streamed deltas, token by token, join to what decoding prompt and completion in
    one go adds to the prompt's text: multi-byte characters split across tokens, words
    with SentencePiece's stripped space, newlines and an emoji; for several prompts."""
    tok = request.getfixturevalue(tokenizer)
    for prompt_text in ("Hello", "say 本", "x", "def main():"):
        prompt, generated = tok.encode(prompt_text), tok.encode(prompt_text + LONG)
        assert generated[:len(prompt)] == prompt
        completion = generated[len(prompt):]
        expected = tok.decode(generated)[len(tok.decode(prompt)):]
        stream = TextStream(tok, prompt=prompt)
        assert _run(stream, completion) == stream.text == expected, prompt_text


def test_special_tokens_inside_a_completion_are_skipped_as_in_the_whole_decode(byte_bpe):
    """Ids with no text of their own (skipped special tokens) widen the window until text
    comes; the text is the whole decode's, and the window then moves on."""
    eos = byte_bpe._tok.eos_token_id
    completion = byte_bpe.encode(" hello") + [eos, eos] + byte_bpe.encode(" 日本 world") + [eos]
    stream = TextStream(byte_bpe, prompt=byte_bpe.encode("say"))
    assert _run(stream, completion) == stream.text == byte_bpe.decode(completion) == " hello 日本 world"
    assert len(stream._window) <= 6, stream._window  # not the whole completion


@pytest.mark.parametrize("tokenizer", ["byte_bpe", "metaspace"])
def test_decode_work_per_token_is_bounded(tokenizer, request):
    """Each token decodes a window of a few ids, not the whole completion: the ids
    decoded over a long completion grow with its length, not its square (a whole
    re-decode per token would decode n(n+1)/2 of them)."""
    real = request.getfixturevalue(tokenizer)
    prompt, generated = real.encode("Hello"), real.encode("Hello" + LONG * 4)
    completion, n = generated[len(prompt):], len(generated) - len(prompt)
    tok = CountingTokenizer(real)
    stream = TextStream(tok, stop=("never appears",), prompt=prompt)
    assert _run(stream, completion) == real.decode(generated)[len(real.decode(prompt)):]
    assert n > 1000 and tok.decoded_ids < 20 * n, (n, tok.decoded_ids)


class ScriptedLM(nn.Module):
    """A causal LM that continues `script`: at position t its logits pick script[t + 1]
    (then `eos`), so greedy decoding of a prompt that is script's start writes the rest."""

    def __init__(self, script: list[int], eos: int, vocab: int):
        super().__init__()
        self.script, self.eos, self.vocab = script, eos, vocab
        self.anchor = nn.Parameter(torch.zeros(()))  # the engine reads the device from one

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        nxt = [self.script[t + 1] if t + 1 < len(self.script) else self.eos for t in range(ids.shape[1])]
        return torch.nn.functional.one_hot(torch.tensor(nxt), self.vocab).float().expand(ids.shape[0], -1, -1) * 10


def _serve(body, tokenizer: HFTokenizer, script_text: str, max_new_tokens: int = 64) -> tuple[dict, str]:
    """A completion through openai_api.answer and the engine: the whole response and
    the streamed text."""
    eos = tokenizer._tok.eos_token_id
    model = ScriptedLM(tokenizer.encode(script_text), eos, len(tokenizer._tok))
    engine = GenerationEngine(model, tokenizer, kv_cache=False, logits_of=lambda out: out)
    entry = {"id": "m", "context_len": 0, "kv_cache": False, "stop_token_ids": [eos]}

    async def both() -> tuple[dict, str]:
        whole = await openai_api.answer(body, entry, tokenizer, engine, max_new_tokens=max_new_tokens, step=0)
        streamed = body.model_copy(update={"stream": True})
        stream = await openai_api.answer(streamed, entry, tokenizer, engine, max_new_tokens=max_new_tokens, step=0)
        events = [e async for e in stream]
        chunks = [json.loads(e[len("data: "):]) for e in events if e != "data: [DONE]\n\n"]
        return whole, "".join(c["choices"][0]["text"] for c in chunks)

    return asyncio.run(both())


def test_completions_endpoint_keeps_leading_space(metaspace):
    body = CompletionRequest.model_validate({"prompt": "Hello", "temperature": 0})
    whole, streamed = _serve(body, metaspace, "Hello world")
    assert whole["choices"][0]["text"] == streamed == " world"
    assert whole["choices"][0]["finish_reason"] == "stop"


def test_completions_endpoint_stop_split_character(byte_bpe):
    body = CompletionRequest.model_validate({"prompt": "hello", "temperature": 0, "stop": ", 日"})
    whole, streamed = _serve(body, byte_bpe, "hello there, 日本")
    assert whole["choices"][0]["text"] == streamed == " there"


# ---- 3. /v1/generate without max_new_tokens under a deployment maximum below 32 --------

def test_generate_unset_max_new_tokens_within_deployment_limit():
    from raytrain_platform.serve.app import ModelServer
    from raytrain_platform.serve.options import ServeOptions

    replica = SimpleNamespace(options=ServeOptions(max_new_tokens=16))
    job = ModelServer.func_or_class._job(replica, GenerateRequest.model_validate({"prompt": "hi"}))
    assert job.max_new_tokens == 16
    job = ModelServer.func_or_class._job(replica, GenerateRequest.model_validate({"prompt": "hi", "max_new_tokens": 5}))
    assert job.max_new_tokens == 5
    with pytest.raises(Exception, match="max_new_tokens: 20; at most 16") as caught:
        ModelServer.func_or_class._job(replica, GenerateRequest.model_validate({"prompt": "hi", "max_new_tokens": 20}))
    assert caught.value.status_code == 422
    roomy = SimpleNamespace(options=ServeOptions(max_new_tokens=256))
    assert ModelServer.func_or_class._job(roomy, GenerateRequest.model_validate({"prompt": "hi"})).max_new_tokens == 32


# ---- 4. max_tokens: null on /v1/completions is OpenAI's default ---------------------------

ENTRY = {"id": "m", "context_len": 0, "kv_cache": False, "stop_token_ids": []}


@pytest.mark.parametrize("deployment, expected", [(256, 16), (8, 8)])
def test_completion_null_max_tokens_is_default(deployment, expected):
    for body in ({"prompt": "hello"}, {"prompt": "hello", "max_tokens": None}):
        [(_, params)] = openai_api.prepare(CompletionRequest.model_validate(body), ENTRY, ByteTokenizer(),
                                           max_new_tokens=deployment)
        assert params.max_tokens == expected, body


def test_chat_null_max_tokens_unchanged(byte_bpe):
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": None})
    [(_, params)] = openai_api.prepare(body, ENTRY, byte_bpe, max_new_tokens=100)
    assert params.max_tokens == 100  # chat: up to the deployment's maximum (and the context)


# ---- 5. stream_options without stream: true -------------------------------------------------

@pytest.mark.parametrize("schema, base", [(CompletionRequest, {"prompt": "a"}),
                                          (ChatRequest, {"messages": [{"role": "user", "content": "a"}]})])
def test_stream_options_needs_stream(schema, base):
    from fastapi.exceptions import RequestValidationError
    from starlette.requests import Request

    from raytrain_platform.serve.http import make_api

    assert schema.model_validate({**base, "stream": True, "stream_options": {"include_usage": True}}).include_usage()
    schema.model_validate({**base, "stream_options": None})
    for body in ({**base, "stream_options": {"include_usage": True}},
                 {**base, "stream": False, "stream_options": {}}):
        with pytest.raises(ValidationError) as caught:
            schema.model_validate(body)
        # As FastAPI hands it to the app's handler (the body's fields under "body").
        exc = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()])
        api = make_api("t", "0")
        path = "/v1/completions" if schema is CompletionRequest else "/v1/chat/completions"
        request = Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b"",
                           "server": ("t", 80), "scheme": "http", "root_path": "", "app": api})
        response = asyncio.run(api.exception_handlers[RequestValidationError](request, exc))
        assert response.status_code == 400
        error = json.loads(response.body)["error"]
        assert error["param"] == "stream_options" and error["type"] == "invalid_request_error"
        assert "only with stream: true" in error["message"] and "\n" not in error["message"]
