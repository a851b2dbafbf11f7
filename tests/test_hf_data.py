"""Tokenized data (issue 17, "Data"): ``data.source: jsonl`` (text, prompt_completion,
chat) and text folders read through a tokenizer, end to end: config, the checks
before Ray, the Ray-free reader, Ray Data, sharding over 2 DDP workers, loss masks
and resume. Real tokenizer and data from `tools/tiny_llm.py`, a real `transformers`
Llama as a user model (`tests/user_models.py:tiny_llama`), real Ray; no mocks, no hub.

Tiers: pure (config, resolve, the readers), ``rtp validate`` as a subprocess, then one
local Ray for the module and the torchrun core for resume.
"""

from __future__ import annotations

import os

# Before transformers is imported: nothing here may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

pytest.importorskip("transformers")

from conftest import LM_TRAIN, ROOT, assert_losses_close, job_config, torchrun_metrics  # noqa: E402
from raytrain_platform.config import load_config  # noqa: E402
from raytrain_platform.data import sources  # noqa: E402
from raytrain_platform.data.local import LocalBatches  # noqa: E402
from raytrain_platform.errors import ConfigError  # noqa: E402
from raytrain_platform.resolve import resolve_job  # noqa: E402
from raytrain_platform.tools import tiny_llm  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # user_models, as model.name "user_models:..."
ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}
# fp32 on gloo: DDP's all-reduce and one process's accumulation sum the same gradients
# in another order (test_ray_train.py / test_families.py measure <= 3e-7 relative).
RTOL = 1e-5
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer (512 tokens, ChatML template), model folder and 300 Q/A records."""
    return tiny_llm.make_all(tmp_path_factory.mktemp("tiny"), samples=300)


def hf_config(tmp: Path, name: str, tiny: dict, **sections) -> dict:
    """The tiny Llama (user builder, 512-token vocabulary) on chat JSONL, 64-token context."""
    return job_config(tmp, name, dict(
        model={"name": "user_models:tiny_llama", "task": "lm",
                          "kwargs": {"vocab_size": 512, "max_positions": 64}},
        data={"source": "jsonl", "path": str(tiny["chat"]), "format": "chat",
              "tokenizer": str(tiny["tokenizer"]), "batch_size": 4, "seq_len": 64, "val_fraction": 0.1},
        train={**LM_TRAIN, "max_steps": 8}, run={"checkpoint_every": 8, "eval_every": 8}), **sections)


def split_rows(spec: sources.SourceSpec, split: str) -> dict[str, np.ndarray]:
    """The whole split from the Ray-free reader, pieces joined."""
    pieces = list(sources.iter_source(spec, split))
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


# ---------------------------------------------------------------- pure: config and the readers


@pytest.mark.parametrize("fmt", ["chat", "prompt_completion", "text"])
def test_describe_counts_what_the_reader_yields(tiny, tmp_path, fmt):
    job = resolve_job(load_config(hf_config(tmp_path, "d", tiny, data={"path": str(tiny[fmt]), "format": fmt})))
    spec = sources.SourceSpec.from_config(job.config, prepared=job.data.prepared)
    train, val = split_rows(spec, "train"), split_rows(spec, "val")
    assert (len(train["sample_id"]), len(val["sample_id"])) == (job.data.num_train, job.data.num_val)
    assert job.data.num_train > 100 and job.data.num_val > 5
    ids = np.concatenate([train["sample_id"], val["sample_id"]])
    assert len(np.unique(ids)) == len(ids)  # unique, so train and val are disjoint
    assert train["tokens"].dtype == np.int32 and train["tokens"].shape[1] == 65  # seq_len + 1
    assert int(train["tokens"].max()) < 512
    counted = train["loss_mask"].mean()
    # chat / prompt_completion: only the answers count; text: every token. Chat and
    # prompt_completion pack whole documents (data.packing's default): in 65 tokens most
    # conversations (85 tokens on average) are cut, and with them answers (0.18 measured).
    assert (0.1 < counted < 0.8) if fmt != "text" else counted == 1.0
    assert job.config.data.packing == ("concat" if fmt == "text" else "documents")
    assert (job.data.truncated > 0) == (fmt != "text")


@pytest.mark.parametrize("fmt", ["chat", "prompt_completion"])
def test_batches_carry_the_loss_mask_into_the_targets(tiny, tmp_path, fmt):
    from raytrain_platform.models.tasks import IGNORE_INDEX, get_task

    job = resolve_job(load_config(hf_config(tmp_path, "m", tiny, data={"path": str(tiny[fmt]), "format": fmt})))
    batch = next(iter(LocalBatches(job, rank=0, world_size=1).train_epoch(0)))
    assert set(batch) == {"tokens", "loss_mask", "sample_id", "position_ids"}  # documents packed
    assert batch["tokens"].dtype == torch.int32 and batch["loss_mask"].shape == batch["position_ids"].shape == (4, 65)
    _, targets = get_task("lm").split({**batch, "tokens": batch["tokens"].long()})
    counted = targets != IGNORE_INDEX
    assert torch.equal(counted, batch["loss_mask"][:, 1:] == 1) and 0 < counted.float().mean() < 1


def _text_folder(tmp_path: Path) -> tuple[Path, list[str]]:
    texts = [f"# file {i}\n" + "".join(f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(40 + 7 * i))
             for i in range(6)]
    folder = tmp_path / "corpus"
    for i, text in enumerate(texts):
        (folder / f"sub{i % 2}").mkdir(parents=True, exist_ok=True)
        (folder / f"sub{i % 2}" / f"m{i}.txt").write_text(text)
    order = sorted(folder.rglob("*.txt"))  # the reader's order: sorted paths
    return folder, [p.read_text() for p in order]


def test_text_folder_through_the_tokenizer_packs_files_with_eos(tiny, tok, tmp_path):
    folder, texts = _text_folder(tmp_path)
    data = {"source": "text", "path": str(folder), "glob": "**/*.txt", "format": "text",
            "val_fraction": 0.0}
    job = resolve_job(load_config(hf_config(tmp_path, "t", tiny, data=data)))
    rows = split_rows(sources.SourceSpec.from_config(job.config, prepared=job.data.prepared), "train")
    assert rows["tokens"].dtype == np.int32 and len(rows["sample_id"]) == job.data.num_train > 20
    assert (rows["loss_mask"] == 1).all() and not job.data.num_val
    # Windows concatenated are the files in order, each ended by EOS, inside windows too.
    flat = rows["tokens"].ravel()
    ends = np.flatnonzero(flat == tok.eos_token_id)
    assert len(ends) == len(texts) - 1 and any(e % 65 != 64 for e in ends)  # not only at window ends
    docs = np.split(flat, ends + 1)
    assert [tok.decode(d[:-1]) for d in docs[:-1]] == texts[:-1]
    assert texts[-1].startswith(tok.decode(docs[-1]))  # the tail of the last file is dropped
    # With a held-out share: exact counts, disjoint ids.
    job = resolve_job(load_config(hf_config(tmp_path, "t", tiny, data={**data, "val_fraction": 0.2})))
    spec = sources.SourceSpec.from_config(job.config, prepared=job.data.prepared)
    train, val = split_rows(spec, "train"), split_rows(spec, "val")
    assert (len(train["sample_id"]), len(val["sample_id"])) == (job.data.num_train, job.data.num_val)
    assert not set(train["sample_id"]) & set(val["sample_id"]) and job.data.num_val > 0


def test_text_groups_read_in_chunks_of_the_same_windows(tiny, tmp_path):
    """A text group's windows read a chunk at a time: any chunk size, the same windows."""
    folder, _ = _text_folder(tmp_path)
    data = {"source": "text", "path": str(folder), "glob": "**/*.txt", "format": "text", "val_fraction": 0.2}
    job = resolve_job(load_config(hf_config(tmp_path, "g", tiny, data=data)))
    spec = sources.SourceSpec.from_config(job.config, prepared=job.data.prepared)
    for split in ("train", "val"):
        (piece,) = sources.token_pieces(spec, split)
        whole = split_rows(spec, split)
        for rows in (3, 10_000):
            chunks = list(sources.token_windows(piece, spec, split, rows=rows))
            assert len(chunks) > (rows == 3) and all(0 < len(c["sample_id"]) <= rows for c in chunks)
            for key in whole:
                assert np.array_equal(np.concatenate([c[key] for c in chunks]), whole[key]), (split, rows, key)


def test_text_without_a_tokenizer_stays_bytes(tiny, tmp_path):
    folder, texts = _text_folder(tmp_path)
    data = {"source": "text", "path": str(folder), "glob": "**/*.txt", "format": "text",
            "tokenizer": None, "val_fraction": 0.0}
    job = resolve_job(load_config(hf_config(tmp_path, "b", tiny, data=data)))
    rows = split_rows(sources.SourceSpec.from_config(job.config, prepared=job.data.prepared), "train")
    assert set(rows) == {"tokens", "sample_id"} and rows["tokens"].dtype == np.uint8
    first = texts[0].encode()
    assert bytes(rows["tokens"][0]) == first[:65]
    assert job.data.num_train == sum(len(t.encode()) // 65 for t in texts)


def test_an_hf_model_reads_text_with_its_own_tokenizer(tiny, tmp_path):
    """``data.tokenizer`` unset: the model family's default (an hf model's directory)."""
    from raytrain_platform.models import family_names

    if "hf" not in family_names():
        pytest.skip("needs the hf model family")
    folder, _ = _text_folder(tmp_path)
    cfg = hf_config(tmp_path, "own", tiny, data={"source": "text", "path": str(folder), "glob": "**/*.txt",
                                                 "format": "text", "tokenizer": None, "val_fraction": 0.0})
    cfg["model"] = {"name": "hf", "kwargs": {"path": str(tiny["model"])}}
    job = resolve_job(load_config(cfg))
    spec = sources.SourceSpec.from_config(job.config, prepared=job.data.prepared)
    assert spec.tokenizer == str(tiny["model"]) and job.config.data.tokenizer is None
    assert split_rows(spec, "train")["tokens"].dtype == np.int32


@pytest.mark.parametrize("patch,field,needle", [
    ({"data": {"tokenizer": None}}, "data.tokenizer",
     "a local tokenizer folder for data.source jsonl (model 'user_models:tiny_llama' has no tokenizer"),
    ({"data": {"path": None}}, "data.path", "a .jsonl file, a folder of them or a URI"),
    ({"data": {"source": "text"}}, "data.format", "'text' for data.source text"),
    ({"data": {"format": "csv"}}, "data.format", "one of ['text', 'prompt_completion', 'chat', 'alpaca', 'sharegpt', 'preference']"),
    ({"data": {"source": "synthetic", "format": "text"}}, "data.tokenizer", "null for data.source synthetic"),
    ({"data": {"messages_field": ""}}, "data.messages_field", "a JSON field name"),
    ({"model": {"name": "mlp", "task": None, "kwargs": {}}, "data": {"seq_len": None}}, "data.source",
     "jsonl needs an lm model"),
])
def test_config_rejects_in_one_line(tiny, tmp_path, patch, field, needle):
    cfg = hf_config(tmp_path, "c", tiny, **patch)
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert err.value.field == field and needle in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- rtp validate (no Ray)


def _no_template(tiny, tmp_path: Path) -> str:
    plain = tmp_path / "plain_tok"
    plain.mkdir()
    shutil.copy(tiny["tokenizer"] / "tokenizer.json", plain)
    config = json.loads((tiny["tokenizer"] / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    return str(plain)


def _bad_lines(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
VALIDATE_CASES = {
    # case: (config patch, the error line's start, what it must say)
    "not_json": (lambda tiny, tmp: {"data": {"path": _bad_lines(tmp, [GOOD, "", "{oops"])}},
                 "error: {tmp}/bad.jsonl:3: ", "not valid JSON"),
    "nested_too_deep": (lambda tiny, tmp: {"data": {"path": _bad_lines(tmp, [GOOD, "[" * 100_000 + "]" * 100_000])}},
                        "error: {tmp}/bad.jsonl:2: ", "JSON nested too deeply to read"),
    "missing_field": (lambda tiny, tmp: {"data": {"path": _bad_lines(tmp, [GOOD, '{"msgs": []}'])}},
                      "error: {tmp}/bad.jsonl:2: ", "expected a field 'messages' (data.format chat)"),
    "no_chat_template": (lambda tiny, tmp: {"data": {"tokenizer": _no_template(tiny, tmp)}},
                         "error: data.tokenizer = ", "a tokenizer with a chat_template for data.format chat"),
    "tokenizer_missing": (lambda tiny, tmp: {"data": {"tokenizer": str(tmp / "nope")}},
                          "error: data.tokenizer = ", "a local folder with tokenizer files"),
    "no_tokenizer": (lambda tiny, tmp: {"data": {"tokenizer": None}},
                     "error: data.tokenizer = None", "has no tokenizer of its own"),
    "seq_len_over_positions": (
        lambda tiny, tmp: {"model": {"name": "gpt", "kwargs": {"block_size": 32}}},
        "error: data.seq_len = 64: ", "at most 32 (the context of model 'gpt')"),
    "vocab_over_embeddings": (
        lambda tiny, tmp: {"model": {"name": "hf", "kwargs": {"path": _small_vocab_model(tmp)}}},
        "error: data.tokenizer = ", "a tokenizer of at most the model's vocab_size 300 tokens (this one has 512)"),
}


def _small_vocab_model(tmp_path: Path) -> str:
    """An hf model folder whose embeddings have 300 rows (the tokenizer has 512 ids)."""
    return str(tiny_llm.make_model(tmp_path / "small_vocab", vocab_size=300, num_layers=1))


@pytest.fixture(scope="module")
def validate_runs(tiny, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """``rtp validate`` of every case, run side by side (each is an interpreter start and
    a transformers import: seconds of one core)."""
    from concurrent.futures import ThreadPoolExecutor

    from raytrain_platform.models import family_names

    def run(case: str) -> tuple[Path, subprocess.CompletedProcess]:
        tmp = tmp_path_factory.mktemp(case)
        patch = VALIDATE_CASES[case][0](tiny, tmp)
        cfg = hf_config(tmp, "v", tiny, **patch)
        if "model" in patch:
            cfg["model"] = patch["model"]
        (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
        return tmp, subprocess.run([sys.executable, "-m", "raytrain_platform", "validate", str(tmp / "c.yaml")],
                                   capture_output=True, text=True, cwd=ROOT, env={**os.environ, **ENV},
                                   timeout=180, check=False)

    cases = [c for c in VALIDATE_CASES if c != "vocab_over_embeddings" or "hf" in family_names()]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(cases, pool.map(run, cases)))


@pytest.mark.parametrize("case", list(VALIDATE_CASES))
def test_rtp_validate_rejects_bad_input_in_one_line(validate_runs, case):
    if case not in validate_runs:
        pytest.skip("needs the hf model family (it knows its embedding rows)")
    _, start, needle = VALIDATE_CASES[case]
    tmp, proc = validate_runs[case]
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start.format(tmp=tmp)) and needle in lines[0], lines
    assert proc.stdout == ""


# ---------------------------------------------------------------- Ray


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_data_tokenizes_the_same_windows_in_the_same_order(ray_cluster, tiny, tmp_path):
    """Ray Data's tokenizing tasks and the Ray-free reader: the same arrays, in order
    (chat JSONL, and a text folder through the tokenizer). The validation split is what
    evaluation reads, its first `run.eval_batches` micro-batches, already in memory: no
    read task (which could wait for a CPU the train split's task holds)."""
    from ray.data.dataset import MaterializedDataset

    from raytrain_platform.data.ray_data import build_datasets, ingest_options

    folder, _ = _text_folder(tmp_path)
    for data in ({}, {"source": "text", "path": str(folder), "glob": "**/*.txt", "format": "text"}):
        job = resolve_job(load_config(hf_config(tmp_path, "r", tiny, data=data, run={"eval_batches": 1})))
        spec = sources.SourceSpec.from_config(job.config, prepared=job.data.prepared)
        assert job.data.num_val > 4  # so that the validation dataset is cut short
        datasets = build_datasets(job.config, job.data)
        assert set(datasets) == {"train", "val"} and isinstance(datasets["val"], MaterializedDataset)
        for split, ds in datasets.items():
            ds.context.execution_options = ingest_options()
            got = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
            got = {k: np.concatenate([b[k] for b in got]) for k in got[0]}
            want = split_rows(spec, split)
            if split == "val":  # eval_batches x batch_size x 1 worker
                want = {k: v[:4] for k, v in want.items()}
            # chat packs whole documents (their position ids too), the text folder concatenates
            packed = ("position_ids",) if data == {} else ()
            assert set(got) == set(want) == {"tokens", "loss_mask", "sample_id", *packed}
            for key in want:
                assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), (split, key)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_data_streams_each_chunk_as_its_own_block(ray_cluster, tiny, tmp_path):
    """A read task's chunks reach the consumer as blocks of their own, in order,
    not as one block per file after the whole file: a consumer waits for one chunk.
    With one task over several files (a dealt train split: one micro-batch per block)
    the chunks stay exact across the files' ends. Ray Data cuts blocks by size;
    `_source_dataset` sets that size from the chunk (this fails if a Ray release cuts
    blocks another way)."""
    from raytrain_platform.data import ray_data
    from raytrain_platform.data.ray_data import _source_dataset, ingest_options

    lines = tiny["chat"].read_text().splitlines()
    for i in range(3):  # the same records in 3 files
        (tmp_path / "parts").mkdir(exist_ok=True)
        (tmp_path / "parts" / f"{i}.jsonl").write_text("\n".join(lines[i * 100:(i + 1) * 100]) + "\n")
    for path, rows, one_task in ((tiny["chat"], 5, False), (tiny["chat"], None, False),
                                 (tmp_path / "parts", 3, True)):
        job = resolve_job(load_config(hf_config(tmp_path, "s", tiny, data={"path": str(path)})))
        spec = sources.SourceSpec.from_config(job.config, prepared=job.data.prepared)
        ds = _source_dataset(spec, "train", (), rows=rows, one_task=one_task)
        ds.context.execution_options = ingest_options()
        blocks = [b["sample_id"] for b in ds.iter_batches(batch_size=None, batch_format="numpy")]
        per = rows or max(1, ray_data.STREAM_TOKENS // spec.seq_len)
        sizes = [len(b) for b in blocks]
        assert len(sizes) >= 3 and sizes[:-1] == [per] * (len(sizes) - 1) and 0 < sizes[-1] <= per, sizes
        assert np.array_equal(np.concatenate(blocks), split_rows(spec, "train")["sample_id"])
        assert one_task == (len(set(np.concatenate(blocks) >> 32)) == 3)


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_two_ddp_workers_on_chat_shard_disjointly_and_match_one_process(ray_cluster, tiny, tmp_path):
    """2 DDP workers x 4 on chat JSONL: each step's two micro-batches are disjoint and
    together are the one-process reader's 8 samples of that step; the ranks trained on
    disjoint samples (the profiler's record of every rank's ids); the losses equal one
    process with the same global batch of 8 under torchrun: the loss mask counts a
    different number of tokens on each rank, and every counted token still weighs the same
    (`Engine.loss_scale`)."""
    import ray

    from raytrain_platform.core.profile import PROFILE_FILE
    from raytrain_platform.data.ray_data import build_datasets, ingest_options
    from raytrain_platform.launch.trainer import prepare, run_job

    ddp = dict(parallel={"strategy": "ddp"}, scaling={"num_workers": 2, "cpus_per_worker": 0.5,
                                                      "torch_threads": 1})
    job = prepare(hf_config(tmp_path, "ddp", tiny, **ddp))
    # Ray Data's split, as Ray Train deals it: micro-batch j to rank j % 2.
    ds = build_datasets(job.config, job.data)["train"]
    ds.context.execution_options = ingest_options()

    @ray.remote(num_cpus=0)
    def ids_of(it):
        return [b["sample_id"].tolist() for b in it.iter_batches(batch_size=4, drop_last=True)]

    per_rank = ray.get([ids_of.remote(s) for s in ds.streaming_split(2, equal=True)])
    rounds = job.data.num_train // 8
    assert len(per_rank[0]) == len(per_rank[1]) == rounds
    assert not {i for b in per_rank[0] for i in b} & {i for b in per_rank[1] for i in b}
    one = resolve_job(load_config(hf_config(tmp_path, "one", tiny, data={"batch_size": 8})))
    steps = [b["sample_id"].tolist() for b in LocalBatches(one, rank=0, world_size=1).train_epoch(0)]
    assert len(steps) == rounds
    assert [sorted(a + b) for a, b in zip(*per_rank)] == [sorted(s) for s in steps]

    result = run_job(job, emit=lambda line: None, tail=False,
                     profile={"measure_from": 0, "breakdown_from": 10**6})
    dup = json.loads((result.run_dir / PROFILE_FILE).read_text())["duplicates"]
    assert dup["on_several_ranks"] == 0 and dup["samples"] == dup["distinct"] == 8 * 8, dup
    reference = torchrun_metrics(hf_config(tmp_path / "torchrun", "one", tiny, data={"batch_size": 8}),
                                 tmp_path / "one.yaml", 1, env=ENV, timeout=240)
    losses = [r["loss"] for r in result.metrics]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    assert_losses_close(losses, [r["loss"] for r in reference], rtol=RTOL)
    assert 0.0 <= result.metrics[-1]["data_wait_frac"] <= 1.0
    # The same validation windows (the first rounds, dealt over 2 ranks or read by one).
    assert result.metrics[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], rel=RTOL)
    assert result.metrics[-1]["eval_s"] > 0


# ---------------------------------------------------------------- resume (torchrun, no Ray)


@pytest.mark.timeout(420)
def test_resume_continues_at_the_data_position(tiny, tmp_path):
    """A run stopped after its step-4 checkpoint (an uninterrupted run's directory with
    its later checkpoints removed), resumed to step 12 across two epoch ends: its
    losses equal the uninterrupted run's, so it went on at the data position it
    stopped at. The first 40 chat records, a window each (whole documents, most cut to
    the window): 5 steps per epoch."""
    from raytrain_platform.core.rundir import checkpoint_name

    small = tmp_path / "small.jsonl"
    small.write_text("".join(tiny["chat"].read_text().splitlines(keepends=True)[:40]))
    cfg = hf_config(tmp_path, "whole", tiny, data={"path": str(small), "batch_size": 8, "val_fraction": 0.0},
                    train={"max_steps": 12}, run={"checkpoint_every": 4, "eval_every": 0, "keep_checkpoints": 5})
    assert resolve_job(load_config(cfg)).steps_per_epoch == 5
    whole = torchrun_metrics(cfg, tmp_path / "whole.yaml", 1, env=ENV, timeout=240)
    stopped = tmp_path / "stopped"
    shutil.copytree(tmp_path / "whole", stopped)
    for step in (8, 12):
        shutil.rmtree(stopped / checkpoint_name(step))
    resumed = torchrun_metrics({**cfg, "run": {**cfg["run"], "name": "stopped"}}, tmp_path / "stopped.yaml", 1,
                               env=ENV, timeout=240)
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == list(range(1, 13))
    assert [r["epoch"] for r in resumed] == [0] * 5 + [1] * 5 + [2] * 2
    assert resumed[:4] == whole[:4]  # the rows before the checkpoint are kept as they were
    assert_losses_close([r["loss"] for r in resumed[4:]], [r["loss"] for r in whole[4:]], rtol=RTOL)
