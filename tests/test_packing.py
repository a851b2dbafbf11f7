"""``data.packing: documents`` (data/packing.py): whole documents packed into windows,
each apart through position ids that restart, and the loss of a packed window against
transformers' own loss on each document alone. Real tokenizer, data and tiny models
made on the spot (tools/tiny_llm, tests/hf_archs.py); in-process, no Ray, no hub."""

from __future__ import annotations

import dataclasses
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may reach a hub

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers")

from conftest import LM_TRAIN, assert_losses_close, job_config, torchrun_metrics  # noqa: E402
from hf_archs import ARCHS, make_arch  # noqa: E402
from raytrain_platform.models.hf import PACKED_DOCUMENT_TYPES  # noqa: E402
import yaml  # noqa: E402

from raytrain_platform.cli import main as cli_main  # noqa: E402
from raytrain_platform.config import load_config  # noqa: E402
from raytrain_platform.data import sources  # noqa: E402
from raytrain_platform.data.encode import encode_record, load_tokenizer  # noqa: E402
from raytrain_platform.data.packing import DocumentPacker, joined  # noqa: E402
from raytrain_platform.errors import ConfigError  # noqa: E402
from raytrain_platform.models.tasks import get_task  # noqa: E402
from raytrain_platform.resolve import resolve_job  # noqa: E402
from raytrain_platform.tools import tiny_llm  # noqa: E402

SEQ_LEN = 257  # tokens per window (256 of context + 1): the tiny chat records are 50 to 340 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("pack")
    tiny_llm.make_tokenizer(out / "tok")
    return {"tokenizer": out / "tok", **tiny_llm.make_instruction_jsonl(out / "data", n=120)}


def spec_for(tiny: dict, fmt: str = "chat", **kw) -> sources.SourceSpec:
    return sources.SourceSpec(**{"kind": "jsonl", "task": "lm", "path": str(tiny[fmt]), "format": fmt,
                                 "tokenizer": str(tiny["tokenizer"]), "seq_len": SEQ_LEN, "val_fraction": 0.2,
                                 "packing": "documents", "cache_root": str(tiny["tokenizer"].parent / "ds"), **kw})


def ready(spec: sources.SourceSpec) -> sources.SourceSpec:
    """`spec` with its tokenized dataset (written in this process)."""
    return dataclasses.replace(spec, prepared=sources.describe(spec, on_ray=False).prepared)


def jsonl_windows(spec: sources.SourceSpec, split: str) -> dict[str, np.ndarray]:
    """The source's whole `split` as one batch."""
    return joined(sources.iter_source(ready(spec), split), spec.seq_len, spec.packing)


def documents_of(window: dict[str, np.ndarray], row: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, loss mask) of each piece of window `row` whose positions run 0, 1, ...: its
    documents, then the padding (if any)."""
    starts = np.flatnonzero(window["position_ids"][row] == 0).tolist() + [window["tokens"].shape[1]]
    return [(window["tokens"][row, a:b], window["loss_mask"][row, a:b]) for a, b in zip(starts, starts[1:])]


def test_documents_are_whole_apart_and_every_one_is_packed_once(tiny):
    spec = spec_for(tiny)
    tok = load_tokenizer(spec.tokenizer, need_chat_template=True)
    windows = {s: jsonl_windows(spec, s) for s in ("train", "val")}
    records = [json.loads(line) for line in Path(spec.path).read_text().splitlines()]
    expected = sorted(tuple(encode_record(tok, r, spec.token_spec())[0][:SEQ_LEN]) for r in records)
    found, padding = [], 0
    for w in windows.values():
        assert w["position_ids"].dtype == np.int32 and w["tokens"].shape == w["position_ids"].shape
        for row in range(len(w["sample_id"])):
            for ids, mask in documents_of(w, row):
                if (ids == tok.pad_token_id).all():  # a chat document starts with <|im_start|>
                    assert not mask.any()
                    padding += ids.size
                else:
                    found.append(tuple(ids))
                    assert mask[0] == 0  # a document's first token is not predicted from another's
    # Every record (train and val) is in exactly one window, whole or cut to the window.
    assert sorted(found) == expected
    truncated = sum(len(encode_record(tok, r, spec.token_spec())[0]) > SEQ_LEN for r in records)
    assert truncated > 0
    counted = sources.describe(spec)
    assert (counted.num_train, counted.num_val, counted.truncated) == (
        len(windows["train"]["sample_id"]), len(windows["val"]["sample_id"]), truncated)
    # Best-fit decreasing leaves little room: 6.3% padding measured on these 120 records,
    # most of it in each split's last windows (benchmarks/packing.py: larger sets).
    assert padding / sum(w["tokens"].size for w in windows.values()) < 0.08


def test_the_windows_are_the_same_by_chunk(tiny):
    spec = ready(spec_for(tiny))
    whole = jsonl_windows(spec, "train")
    for rows in (1, 7):
        chunks = list(sources.token_windows(0, spec, "train", rows=rows))
        assert all(len(c["sample_id"]) <= rows for c in chunks)
        together = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
        assert together.keys() == whole.keys() and all(np.array_equal(together[k], whole[k]) for k in whole)
    concat = jsonl_windows(spec_for(tiny, packing="concat"), "train")
    assert "position_ids" not in concat and len(concat["sample_id"]) < len(whole["sample_id"])


def test_the_packer_bounds_its_buffer_and_cuts_long_documents():
    packer = DocumentPacker(seq_len=8, first_id=5 << 32, rows=2, pad_id=-1, buffer=3)
    lengths = [3, 12, 5, 2, 8]
    ids = np.arange(sum(lengths))
    out = packer.add(ids, np.ones(ids.size), lengths)
    assert len(out) == 1  # the first 3 documents were packed as soon as they were held
    out += packer.end()
    rows = np.concatenate([c["tokens"] for c in out])
    assert packer.truncated == 1 and packer.done == len(rows) == 4
    assert np.concatenate([c["sample_id"] for c in out]).tolist() == [(5 << 32) | i for i in range(4)]
    # Buffer 1: the 12-token document cut to 8 alone, then 5 + 3; buffer 2: 8 alone, then 2.
    assert rows[0].tolist() == list(range(3, 11)) and rows[1].tolist() == [15, 16, 17, 18, 19, 0, 1, 2]
    assert rows[3].tolist() == [20, 21, -1, -1, -1, -1, -1, -1]


# ---------------------------------------------------------------- config


def _config(tmp_path: Path, tiny: dict, model: dict, **data) -> dict:
    return job_config(tmp_path, "p", dict(
        model=model, data={"source": "jsonl", "path": str(tiny["chat"]), "format": "chat",
                           "tokenizer": str(tiny["tokenizer"]), "batch_size": 2, "seq_len": 128,
                           "val_fraction": 0.1, **data},
        train={"max_steps": 2}))


LLAMA = {"name": "user_models:tiny_llama", "task": "lm", "kwargs": {"vocab_size": 512, "max_positions": 128}}
GPT = {"name": "gpt", "kwargs": {"block_size": 128, "n_layer": 1, "n_head": 2, "n_embd": 16}}


def test_the_default_packing_and_its_refusals(tiny, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # user_models
    sys.modules.pop("user_models", None)
    job = resolve_job(load_config(_config(tmp_path, tiny, LLAMA)))
    assert job.config.data.packing == "documents" and job.data.truncated > 0
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, tiny, LLAMA)))
    assert cli_main(["validate", str(path)]) == 0
    assert (f"data.packing documents: whole documents in windows of 128 + 1 tokens; {job.data.truncated} longer "
            "than that, truncated") in capsys.readouterr().out
    assert sources.SourceSpec.from_config(job.config, prepared=job.data.prepared).token_spec().packing == "documents"
    for fmt, expected in (("text", "concat"), ("prompt_completion", "documents")):
        cfg = _config(tmp_path, tiny, LLAMA, format=fmt, path=str(tiny[fmt]))
        assert resolve_job(load_config(cfg)).config.data.packing == expected
    # The builtin gpt takes no position ids: concat by default (then its byte vocabulary is
    # what refuses this tokenizer), documents refused before the tokenizer is looked at.
    with pytest.raises(ConfigError, match="data.tokenizer .* at most the model's vocab_size 256"):
        resolve_job(load_config(_config(tmp_path, tiny, GPT)))
    hf = {"name": "hf", "kwargs": {"path": str(make_arch(tmp_path / "llama", "llama", tiny["tokenizer"]))}}
    refusals = [
        (_config(tmp_path, tiny, GPT, packing="documents"), "data.packing = 'documents': expected concat for "
         "model 'gpt' (its forward is not shown to keep packed documents apart"),
        (_config(tmp_path, tiny, LLAMA, packing="whole"), "data.packing = 'whole': expected documents, concat"),
        ({**_config(tmp_path, tiny, hf, packing="documents"), "parallel": {"strategy": "ddp", "pp_size": 2},
          "scaling": {"num_workers": 2}}, "data.packing = 'documents': expected concat for parallel.pp_size > 1"),
        ({**_config(tmp_path, tiny, GPT), "data": {"source": "text", "batch_size": 2, "seq_len": 16,
                                                    "packing": "documents"}},
         "data.packing = 'documents': expected concat for data.source text"),
    ]
    for cfg, needle in refusals:
        with pytest.raises(ConfigError) as exc:
            resolve_job(load_config(cfg))
        assert str(exc.value).startswith(needle) and "\n" not in str(exc.value), str(exc.value)


# ---------------------------------------------------------------- the loss against transformers


def _platform_loss(model: torch.nn.Module, window: dict[str, np.ndarray]) -> torch.Tensor:
    """The task's loss on the packed windows, as the engine computes it."""
    task = get_task("lm")
    batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in window.items()}
    batch["tokens"] = batch["tokens"].long()
    inputs, targets = task.split(batch)
    return task.loss(model(inputs, **task.forward_kwargs(batch)), targets)


@torch.no_grad()
def _reference_loss(model: torch.nn.Module, window: dict[str, np.ndarray]) -> torch.Tensor:
    """transformers' own loss on each document alone, token-weighted."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for row in range(window["tokens"].shape[0]):
        for ids, mask in documents_of(window, row):
            labels = np.where(mask == 1, ids, -100)
            n = int((labels[1:] != -100).sum())  # transformers shifts: the first token is no target
            if n == 0:  # the padding, or a document cut before its answer
                continue
            out = model(torch.from_numpy(ids).long()[None], labels=torch.from_numpy(labels).long()[None])
            total, count = total + out.loss.double() * n, count + n
    return total / count


def packed_windows(tiny: dict) -> dict[str, np.ndarray]:
    """Two windows of several documents each, and the last one (the most padding). Not
    the first: a document cut to the whole window, which gpt2's 256 positions cannot
    take alone (transformers' loss reads all its 257 tokens)."""
    window = jsonl_windows(spec_for(tiny, val_fraction=0.0), "train")
    rows = [r for r in range(len(window["sample_id"])) if len(documents_of(window, r)) >= 3][:2] + [-1]
    window = {k: v[rows] for k, v in window.items()}
    assert window["tokens"][-1, -1] == window["tokens"][-1, -2]  # padded
    return window


@pytest.mark.parametrize("arch", PACKED_DOCUMENT_TYPES)
def test_a_packed_window_has_the_loss_of_its_documents_alone(tiny, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    model_dir = make_arch(tmp_path / arch, arch, tiny["tokenizer"])
    window = packed_windows(tiny)
    reference_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reference = _reference_loss(reference_model, window)
    for attn in dict.fromkeys((reference_model.config._attn_implementation, "eager")):  # the default (sdpa) and eager
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn).eval()
        with torch.no_grad():
            loss = _platform_loss(model, window)
        # fp32: packed and one-document forwards differ in summation order only (measured <= 1.3e-6)
        torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=1e-5)
        # Without the position ids a document's first tokens see the one before it.
        tokens = torch.from_numpy(window["tokens"][:, :-1]).long()
        with torch.no_grad():
            apart = model(tokens, **get_task("lm").forward_kwargs(
                {"position_ids": torch.from_numpy(window["position_ids"])})).logits
            mixed = model(tokens).logits
        assert (apart - mixed).abs().max() > 1e-2


def test_an_architecture_not_shown_to_keep_documents_apart_gets_concat(tiny, tmp_path):
    """OPT's forward builds its mask without the position ids: its packed documents would
    attend to each other. Unset, it gets concat; asked for, documents is one line."""
    assert set(ARCHS) - set(PACKED_DOCUMENT_TYPES) == {"opt"}
    opt = make_arch(tmp_path / "opt", "opt", tiny["tokenizer"])
    opt = {"name": "hf", "kwargs": {"path": str(opt)}}
    assert resolve_job(load_config(_config(tmp_path, tiny, opt))).config.data.packing == "concat"
    with pytest.raises(ConfigError) as exc:
        resolve_job(load_config(_config(tmp_path, tiny, opt, packing="documents")))
    assert str(exc.value).startswith("data.packing = 'documents': expected concat for model 'hf' (its forward is "
                                     "not shown to keep packed documents apart")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_hf_family_meta_device_build_keeps_documents_apart(tiny, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from raytrain_platform.models.registry import get_family

    model_dir = make_arch(tmp_path / arch, arch, tiny["tokenizer"])
    family = get_family("hf")
    kwargs = family.resolve_kwargs({"path": str(model_dir)})
    model = family.build(kwargs, device="meta").to_empty(device="cpu")
    family.init_buffers(model, torch.device("cpu"))
    reference_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.load_state_dict(reference_model.state_dict())
    window = packed_windows(tiny)
    with torch.no_grad():
        loss = _platform_loss(model.eval(), window)
    torch.testing.assert_close(loss.double(), _reference_loss(reference_model, window), rtol=1e-5, atol=1e-5)


@pytest.mark.extended
@pytest.mark.timeout(420)
def test_fsdp_on_two_ranks_trains_packed_documents_as_one_process(tiny, tmp_path):
    """The hf family under FSDP2 (a meta-device build, weights loaded into shards) on
    packed documents: 2 ranks of 2 windows equal 1 process of 4, step by step."""
    model_dir = make_arch(tmp_path / "llama", "llama", tiny["tokenizer"])

    def config(name: str, workers: int, batch: int) -> dict:
        return job_config(tmp_path, name, dict(
            model={"name": "hf", "kwargs": {"path": str(model_dir)}},
            data={"source": "jsonl", "path": str(tiny["chat"]), "format": "chat", "batch_size": batch,
                  "seq_len": 256, "val_fraction": 0.0},
            train={**LM_TRAIN, "max_steps": 4}, run={"checkpoint_every": 0, "eval_every": 0},
            parallel={"strategy": "fsdp" if workers > 1 else "none"}, scaling={"num_workers": workers}))

    one = torchrun_metrics(config("one", 1, 4), tmp_path / "one.yaml", 1)
    two = torchrun_metrics(config("two", 2, 2), tmp_path / "two.yaml", 2)
    # fp32 on gloo: the ranks' gradient reduction sums in another order (<= 3e-7 relative measured elsewhere)
    assert_losses_close([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
