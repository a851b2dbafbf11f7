"""Preference pairs (issue 49, points 2, 9, 10): ``data.format: preference`` from JSONL
records to pair rows. Real tokenizer and data from `tools/tiny_llm.py` (docstrings
chosen, damaged copies rejected), TRL's own tokenizing helpers as the reference for chat
pairs; no mocks, no hub.

Tiers: pure (`data/preference.py`, the tokenizing pass in this process and its dataset
read through `sources`), then ``rtp validate`` as subprocesses (bad input: one line
with file:line, exit 2), then Ray Data (marked ``ray``).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

pytest.importorskip("transformers")

from conftest import ROOT, job_config  # noqa: E402
from raytrain_platform.config import load_config  # noqa: E402
from raytrain_platform.data import sources  # noqa: E402
from raytrain_platform.data.preference import PAIR_ARRAYS, PairSpec, check_pair, encode_pairs  # noqa: E402
from raytrain_platform.errors import DataError  # noqa: E402
from raytrain_platform.tools import tiny_llm  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}
L = 65  # tokens per row: data.seq_len 64 + 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer (512 tokens, ChatML template), model folder and 300 Q/A records as pairs."""
    return tiny_llm.make_all(tmp_path_factory.mktemp("tiny"), samples=300)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def encode(tok, recs: list[dict], row_len: int = L):
    return encode_pairs(tok, recs, PairSpec(row_len), np.arange(len(recs), dtype=np.int64))


# ---------------------------------------------------------------- pure: records to rows


def test_the_example_data_is_real_text_and_every_pair_differs(tiny):
    text, chat = records(tiny["preference"]), records(tiny["preference_chat"])
    assert len(text) == len(chat) == 300
    assert text[0]["prompt"].startswith("What does `") and text[0]["chosen"] == chat[0]["chosen"][0]["content"]
    assert all(r["chosen"] != r["rejected"] for r in text)
    # Half shuffled (the same words), half cut (a prefix of the words).
    shuffled = sum(sorted(r["chosen"].split()) == sorted(r["rejected"].split()) for r in text)
    assert 100 < shuffled < 200, shuffled


def test_text_pairs_train_only_the_responses_and_eos(tok, tiny):
    rec = records(tiny["preference"])[0]
    rows, cut = encode(tok, [rec])
    prompt = tok(rec["prompt"], add_special_tokens=False)["input_ids"]
    assert not cut.any() and set(rows) == set(PAIR_ARRAYS) and rows["chosen_tokens"].dtype == np.int32
    for side in ("chosen", "rejected"):
        response = tok(rec[side], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        tokens, mask = rows[f"{side}_tokens"][0], rows[f"{side}_mask"][0]
        n = len(prompt) + len(response)
        assert tokens[:n].tolist() == prompt + response  # the tiny tokenizer has no BOS
        assert mask.tolist() == [0] * len(prompt) + [1] * len(response) + [0] * (L - n)
        assert (tokens[n:] == tok.pad_token_id).all()
    assert rows["chosen_mask"].dtype == np.uint8


def test_chat_pairs_train_what_trl_calls_the_completion(tok, tiny):
    """TRL's DPOTrainer tokenizes a conversation pair with its own helpers: the prompt
    with the generation prompt, then prompt + response; the completion is what follows
    their common prefix. Our trained tokens are exactly those, and the rest the prompt."""
    data_utils = pytest.importorskip("trl.data_utils")
    recs = records(tiny["preference_chat"])[:20]
    rows, _ = encode(tok, recs, row_len=200)
    for k, rec in enumerate(recs):
        prompt_ids = data_utils._tokenize(tok, rec["prompt"], add_generation_prompt=True)["input_ids"]
        for side in ("chosen", "rejected"):
            full = data_utils._tokenize(tok, rec["prompt"] + rec[side])["input_ids"]
            start = data_utils.common_prefix_length(prompt_ids, full)
            tokens, mask = rows[f"{side}_tokens"][k], rows[f"{side}_mask"][k].astype(bool)
            assert tokens[:len(full)].tolist() == full
            assert tokens[mask].tolist() == full[start:]
            assert mask[:start].sum() == 0 and mask[len(full):].sum() == 0


def test_a_batch_encodes_as_each_record_alone(tok, tiny):
    mixed = records(tiny["preference"])[:12] + records(tiny["preference_chat"])[12:24]
    together, _ = encode(tok, mixed)
    for k, rec in enumerate(mixed):
        alone, _ = encode(tok, [rec])
        for name in PAIR_ARRAYS[:-1]:
            assert (alone[name][0] == together[name][k]).all(), (k, name)


def test_a_long_pair_keeps_its_start_as_trl_does(tok):
    """TRL's default truncation_mode keep_start: the whole prompt, the response's start."""
    rec = {"prompt": "Say it:\n", "chosen": "word " * 100, "rejected": "no"}
    rows, cut = encode(tok, [rec], row_len=16)
    full = tok(rec["prompt"] + "", add_special_tokens=False)["input_ids"]
    response = tok(rec["chosen"], add_special_tokens=False)["input_ids"]
    assert cut.tolist() == [True]
    assert rows["chosen_tokens"][0].tolist() == (full + response)[:16]
    assert rows["chosen_mask"][0].tolist() == [0] * len(full) + [1] * (16 - len(full))


@pytest.mark.parametrize("rec, needle", [
    ({"prompt": "q", "chosen": "a"}, "expected a field 'rejected' (data.format preference"),
    ({"prompt": "q", "rejected": "a"}, "expected a field 'chosen'"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "'chosen' equals 'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": ["b"]}, "expected 'rejected' to be a string like 'prompt'"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"},
     "expected 'chosen' to be a list of assistant messages"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "expected 'chosen' to hold at least one message"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, "expected 'prompt' to be a string or a list of messages"),
    (["q", "a", "b"], "expected a JSON object, got list"),
])
def test_a_bad_record_is_one_line(rec, needle):
    with pytest.raises(DataError) as err:
        check_pair(rec, PairSpec(L))
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_prompt_that_fills_the_row_is_an_error_naming_the_record(tok):
    ok = {"prompt": "q\n", "chosen": "a", "rejected": "b"}
    long = {"prompt": "word " * 40, "chosen": "a", "rejected": "b"}
    with pytest.raises(DataError) as err:
        encode_pairs(tok, [ok, long], PairSpec(16), np.arange(2), where=lambda k: f"f.jsonl:{k + 1}: ")
    assert str(err.value).startswith("f.jsonl:2: the prompt takes ") and "data.seq_len = 15" in str(err.value)
    # One token of room is enough: the response's first token is a target.
    room = len(tok(long["prompt"], add_special_tokens=False)["input_ids"]) + 1
    rows, cut = encode_pairs(tok, [long], PairSpec(room), np.arange(1))
    assert rows["chosen_mask"][0].tolist() == [0] * (room - 1) + [1] and cut.tolist() == [True]


# ---------------------------------------------------------------- the reader (sources, no Ray)


def pair_config(tmp: Path, tiny: dict, **data) -> dict:
    """DPO of the tiny Llama on preference JSONL, 64-token context."""
    return job_config(tmp, "p", dict(
        model={"name": "hf", "kwargs": {"path": str(tiny["model"])}},
        data={"source": "jsonl", "path": str(tiny["preference"]), "format": "preference",
              "tokenizer": str(tiny["tokenizer"]), "batch_size": 4, "seq_len": 64, "val_fraction": 0.1, **data},
        train={"max_steps": 4, "lr": 1e-3, "seed": 0, "objective": "dpo"}))


def split_rows(spec: sources.SourceSpec, split: str) -> dict[str, np.ndarray]:
    parts = list(sources.iter_source(spec, split))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def prepared_spec(cfg: dict) -> tuple[sources.SourceSpec, sources.DataInfo]:
    """The config's source with its tokenized dataset, the pass run in this process."""
    spec = sources.SourceSpec.from_config(load_config(cfg))
    info = sources.describe(spec, on_ray=False)
    return dataclasses.replace(spec, prepared=info.prepared), info


def test_the_pass_writes_pairs_by_jsonl_ids_and_splits(tiny, tmp_path, monkeypatch):
    """The tokenizing pass in this process, each file cut into several byte ranges: every
    record is one pair row, ids and splits by jsonl's rules, as each record encodes alone."""
    from raytrain_platform.data import jsonl

    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 4096)  # ranges end mid-file: pairs cross them in order
    folder = tmp_path / "pairs"
    folder.mkdir()
    lines = tiny["preference"].read_text().splitlines(keepends=True)
    (folder / "a.jsonl").write_text("".join(lines[:150]))
    (folder / "b.jsonl").write_text("".join(lines[150:]))
    assert (folder / "a.jsonl").stat().st_size > 3 * 4096
    spec, info = prepared_spec(pair_config(tmp_path, tiny, path=str(folder)))
    train, val = split_rows(spec, "train"), split_rows(spec, "val")
    assert sources.prepared(spec).content["format"] == "preference"
    assert (info.num_train, info.num_val) == (len(train["sample_id"]), len(val["sample_id"]))
    assert info.num_train + info.num_val == 300 and 10 < info.num_val < 60
    assert train["chosen_tokens"].shape == (info.num_train, 65) and set(train) == set(PAIR_ARRAYS)
    # Each file's val lines are those jsonl's split rule (its name, the line index) picks.
    for i, name in enumerate(("a.jsonl", "b.jsonl")):
        keys = sources.split_keys(sources.split_key(str(folder / name), str(folder)), np.arange(150))
        is_val = sources.split_mask(keys, 0.1, "val")
        for split, rows, bit in (("train", train, 0), ("val", val, 1 << 31)):
            ids = rows["sample_id"][rows["sample_id"] >> 32 == i]
            n = int((is_val if split == "val" else ~is_val).sum())
            assert ids.tolist() == [(i << 32) | bit | j for j in range(n)]
        # The first val pair of the file is its first val line, encoded alone.
        first = int(np.flatnonzero(is_val)[0])
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tiny["tokenizer"]), local_files_only=True)
        alone, _ = encode(tok, [json.loads(lines[150 * i + first])])
        at = int(np.flatnonzero(val["sample_id"] == ((i << 32) | (1 << 31)))[0])
        assert (val["chosen_tokens"][at] == alone["chosen_tokens"][0]).all()


def test_a_bad_pair_past_the_first_range_names_its_file_line(tiny, tmp_path, monkeypatch):
    """The pass tokenizes byte ranges apart; the error still names the line in the file."""
    from raytrain_platform.data import jsonl

    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 4096)
    lines = tiny["preference"].read_text().splitlines(keepends=True)[:150]
    lines.insert(119, json.dumps({"prompt": "q", "chosen": "x", "rejected": "x"}) + "\n")
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(lines))
    assert len("".join(lines[:119]).encode()) > 2 * 4096  # not in the first range
    with pytest.raises(DataError) as err:
        prepared_spec(pair_config(tmp_path, tiny, path=str(path)))
    assert str(err.value) == (f"{path}:120: 'chosen' equals 'rejected': a preference pair needs two different "
                              "responses")


@pytest.mark.parametrize("train, data, expected", [
    ({"objective": "sft"}, {}, "data.format = 'preference': expected not preference with train.objective sft"),
    ({}, {"format": "chat", "path": "x.jsonl"}, "train.objective = 'dpo': expected sft for data.format chat"),
])
def test_dpo_and_preference_pairs_go_together(tiny, tmp_path, train, data, expected):
    from raytrain_platform.errors import ConfigError

    cfg = pair_config(tmp_path, tiny, **data)
    cfg["train"].update(train)
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value), str(err.value)


# ---------------------------------------------------------------- rtp validate (no Ray)


def _bad(tiny: dict, tmp: Path, line: dict) -> str:
    """A copy of the example pairs with `line` as line 4."""
    lines = tiny["preference"].read_text().splitlines(keepends=True)[:20]
    lines.insert(3, json.dumps(line) + "\n")
    (tmp / "bad.jsonl").write_text("".join(lines))
    return str(tmp / "bad.jsonl")


def _dpo_yaml(tiny: dict, tmp: Path) -> dict:
    """pipelines/configs/dpo.yaml on this tiny model."""
    cfg = yaml.safe_load((ROOT / "pipelines/configs/dpo.yaml").read_text())
    cfg["model"]["kwargs"]["path"] = str(tiny["model"])
    cfg["data"]["path"] = str(tiny["preference"])
    cfg["run"]["storage_path"] = str(tmp)
    return cfg


VALIDATE_CASES = {
    # case: (data patch or whole config, exit code, the stderr line's start, what it says)
    "no_rejected": (lambda tiny, tmp: {"path": _bad(tiny, tmp, {"prompt": "q", "chosen": "a"})},
                    2, "error: {tmp}/bad.jsonl:4: ", "expected a field 'rejected' (data.format preference"),
    "no_chosen": (lambda tiny, tmp: {"path": _bad(tiny, tmp, {"prompt": "q", "rejected": "a"})},
                  2, "error: {tmp}/bad.jsonl:4: ", "expected a field 'chosen'"),
    "chosen_is_rejected": (lambda tiny, tmp: {"path": _bad(tiny, tmp, {"prompt": "q", "chosen": "x", "rejected": "x"})},
                           2, "error: {tmp}/bad.jsonl:4: ", "'chosen' equals 'rejected'"),
    "no_room": (lambda tiny, tmp: {"path": _bad(tiny, tmp, {"prompt": "word " * 80, "chosen": "a", "rejected": "b"})},
                2, "error: {tmp}/bad.jsonl:4: ", "leaving no room for the 'chosen' response within data.seq_len = 64"),
    "documents": (lambda tiny, tmp: {"packing": "documents"}, 2, "error: data.packing = 'documents': ",
                  "null or concat for data.format preference"),
    "sft_on_pairs": (lambda tiny, tmp: {**pair_config(tmp, tiny), "train": {"max_steps": 4}}, 2,
                     "error: data.format = 'preference': ", "not preference with train.objective sft"),
    "dpo_yaml": (_dpo_yaml, 0, "", ""),
}


@pytest.fixture(scope="module")
def validate_runs(tiny, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    from concurrent.futures import ThreadPoolExecutor

    def run(case: str) -> tuple[Path, subprocess.CompletedProcess]:
        tmp = tmp_path_factory.mktemp(case)
        made = VALIDATE_CASES[case][0](tiny, tmp)
        cfg = made if "model" in made else pair_config(tmp, tiny, **made)
        (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
        return tmp, subprocess.run([sys.executable, "-m", "raytrain_platform", "validate", str(tmp / "c.yaml")],
                                   capture_output=True, text=True, cwd=ROOT, env={**os.environ, **ENV},
                                   timeout=180, check=False)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(VALIDATE_CASES, pool.map(run, VALIDATE_CASES)))


@pytest.mark.parametrize("case", list(VALIDATE_CASES))
def test_rtp_validate_on_preference_data(validate_runs, case):
    _, code, start, needle = VALIDATE_CASES[case]
    tmp, proc = validate_runs[case]
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    if code == 0:
        assert "data.format preference: one pair per row of 128 + 1 tokens per side" in proc.stdout, proc.stdout
        return
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start.format(tmp=tmp)) and needle in lines[0], lines
    assert proc.stdout == ""


# ---------------------------------------------------------------- Ray Data


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_data_reads_the_same_pairs_in_blocks_of_one_micro_batch(ray_cluster, tiny, tmp_path):
    """Ray Data's read tasks and the Ray-free reader give the same pair rows in order;
    a dealt train split (2 workers) comes in blocks of exactly one micro-batch, which
    the streaming split deals round-robin. Pair rows are wider than windows: the block
    size Ray Data cuts at is set from a pair chunk (`ray_data._chunk_bytes`)."""
    from raytrain_platform.data.ray_data import _source_dataset, build_datasets, ingest_options
    from raytrain_platform.resolve import resolve_job

    job = resolve_job(load_config(pair_config(tmp_path, tiny, path=str(tiny["preference_chat"]),
                                              seq_len=128, batch_size=3)))
    spec = sources.SourceSpec.from_config(job.config, prepared=job.data.prepared)
    for split, ds in build_datasets(job.config, job.data).items():
        ds.context.execution_options = ingest_options()
        got = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
        got = {k: np.concatenate([b[k] for b in got]) for k in got[0]}
        want = split_rows(spec, split)
        if split == "val":  # eval_batches x batch_size x 1 worker
            want = {k: v[:6] for k, v in want.items()}
        assert set(got) == set(want) == set(PAIR_ARRAYS)
        for key in want:
            assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), (split, key)
    ds = _source_dataset(spec, "train", (), rows=3, one_task=True)
    ds.context.execution_options = ingest_options()
    sizes = [len(b["sample_id"]) for b in ds.iter_batches(batch_size=None, batch_format="numpy")]
    assert sizes[:-1] == [3] * (len(sizes) - 1) and 0 < sizes[-1] <= 3 and sum(sizes) == job.data.num_train


# ---------------------------------------------------------------- sweeps (point 6)


def test_a_sweep_plans_trials_over_dpo_beta_and_loss(tiny, tmp_path):
    """`rtp sweep` takes any dotted config path, `train.dpo.beta` and `train.dpo.loss`
    too; each trial's config is validated with its data before Ray, and a bad loss is
    that trial's one-line error."""
    from raytrain_platform.tune.planning import plan_trials
    from raytrain_platform.tune.space import parse_space

    cfg = pair_config(tmp_path, tiny)
    axes = parse_space({"train.dpo.beta": [0.1, 0.5], "train.dpo.loss": ["sigmoid", "ipo", "nope"]})
    trials = plan_trials(load_config(cfg), axes, num_samples=1, seed=0, runs_dir=str(tmp_path / "runs"),
                         metric="loss")
    ran = [(t.config["train"]["dpo"]["beta"], t.config["train"]["dpo"]["loss"]) for t in trials if t.config]
    assert ran == [(0.1, "sigmoid"), (0.1, "ipo"), (0.5, "sigmoid"), (0.5, "ipo")]
    refused = [t.error for t in trials if t.config is None]
    assert len(refused) == 2 and all("train.dpo.loss" in e and "\n" not in e for e in refused), refused
