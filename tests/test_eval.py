"""`rtp eval` on lm-evaluation-harness, offline: a multiple-choice task made from real
text (the standard library's docstrings that tools/tiny_llm.py writes: the question
names a function, the choices are four docstrings, one its own) in a local JSONL and a
task YAML; a tiny Hugging Face Llama trained two steps with MLflow and TensorBoard on.

lm_eval's ``hf`` model on the export is checked against a `transformers` forward of our
own (each choice's log-likelihood, and so acc and acc_norm); scores land in the run's
eval/ folder, MLflow run and TensorBoard events. Through ``rtp serve`` (lm_eval's
``local-completions``, with an API key) the scores equal the ``hf`` model's: that test
needs the server's ``echo`` + ``logprobs`` and is skipped while the completions schema
has no ``echo``.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from conftest import hf_config, mlp_config, serve_app, train_in_process

from raytrain_platform.cli import main as rtp

TASK = "docmc"
MAX_TOKENS = 64  # question + answer: with three other answers, every request fits the 256 positions
# Per-choice log-likelihoods, lm_eval (float32, padded batches of 8) vs one unpadded forward
# each summed in float64, and vs the server's: the largest difference measured was 2.4e-5 for both.
LL_ATOL = 1e-4


def _choice_rows(pairs_file: Path, model_dir: Path, n: int = 24) -> list[dict]:
    """Questions ("What does `x.y` do?") whose own docstring is one of four choices, the
    other three drawn from the other short answers; the right one's place rotates."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    pairs = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    short = [p for p in pairs if len(tok(p["prompt"] + p["completion"]).input_ids) <= MAX_TOKENS]
    assert len(short) >= n + 3, len(short)
    rng = random.Random(0)
    rows = []
    for i, pair in enumerate(short[:n]):
        others = rng.sample([p["completion"] for j, p in enumerate(short) if j != i], 3)
        label = i % 4
        rows.append({"question": pair["prompt"].strip(), "label": label,
                     "choices": others[:label] + [pair["completion"]] + others[label:]})
    return rows


def _write_task(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
""")
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny) -> dict:
    from raytrain_platform.export import export_checkpoint

    root = tmp_path_factory.mktemp("eval")
    rows = _choice_rows(tiny["prompt_completion"], tiny["model"])
    tasks = _write_task(root / "tasks", rows)
    runs = root / "runs"
    run = train_in_process(runs, hf_config(
        runs, "ft", tiny["model"], train={"max_steps": 2, "lr": 3e-3, "warmup_steps": 0},
        run={"checkpoint_every": 0, "eval_every": 0, "eval_batches": 1, "tracking": ["mlflow", "tensorboard"]}))
    export = export_checkpoint(run, root / "export", format="hf")
    return {"root": root, "rows": rows, "tasks": tasks, "run": run, "export": export, "runs": runs}


def _reference(model_dir: Path, rows: list[dict]) -> tuple[list[list[float]], float, float]:
    """Each choice's log-likelihood after its question (the request lm_eval makes: context
    "question\\nAnswer:", continuation " choice"), from one transformers forward each; acc
    and acc_norm (log-likelihood per character of the choice) as lm_eval defines them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()
    lls, right, right_norm = [], 0, 0
    for row in rows:
        context = row["question"] + "\nAnswer:"
        ctx = tok(context).input_ids
        per_choice = []
        for choice in row["choices"]:
            whole = tok(context + " " + choice).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
            per_choice.append(sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole))))
        lls.append(per_choice)
        right += max(range(4), key=lambda k: per_choice[k]) == row["label"]
        norm = [ll / len(c) for ll, c in zip(per_choice, row["choices"])]
        right_norm += max(range(4), key=lambda k: norm[k]) == row["label"]
    return lls, right / len(rows), right_norm / len(rows)


def _sample_lls(record: dict) -> list[list[float]]:
    samples = sorted(record["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


@pytest.fixture(scope="module")
def hf_record(setup) -> dict:
    from raytrain_platform.evaluation import EvalSpec, evaluate_path

    _, record = evaluate_path(setup["export"], EvalSpec(tasks=[TASK], include=[str(setup["tasks"])],
                                                        log_samples=True))
    return record


def test_lm_eval_hf_scores_equal_a_transformers_forward_of_our_own(setup, hf_record):
    lls, acc, acc_norm = _reference(setup["export"], setup["rows"])
    torch.testing.assert_close(torch.tensor(_sample_lls(hf_record), dtype=torch.float64),
                               torch.tensor(lls, dtype=torch.float64), rtol=0, atol=LL_ATOL)
    assert hf_record["scores"][TASK] == {"acc": acc, "acc_norm": acc_norm}, (hf_record["scores"], acc, acc_norm)
    assert hf_record["step"] == 2 and hf_record["backend"] == "hf"
    assert hf_record["n_samples"][TASK]["effective"] == len(setup["rows"])
    print(f"{TASK} on the 2-step export: acc {acc:.4f}, acc_norm {acc_norm:.4f} ({len(setup['rows'])} questions)")


def test_rtp_eval_of_a_run_records_in_its_folder_mlflow_and_tensorboard(setup, hf_record, capsys):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = setup["run"]
    assert rtp(["eval", str(run), "--tasks", TASK, "--include", str(setup["tasks"])]) == 0
    out = capsys.readouterr().out
    scores = hf_record["scores"][TASK]  # the run's latest checkpoint is the export's
    assert f"{TASK}: acc {scores['acc']:.4f}, acc_norm {scores['acc_norm']:.4f} ({len(setup['rows'])} documents)" \
        in out, out
    files = sorted((run / "eval").glob("step_00000002_*.json"))
    assert len(files) == 1 and f"results in {files[0]}" in out
    saved = json.loads(files[0].read_text())
    assert saved["scores"] == hf_record["scores"] and "samples" not in saved and saved["source"] == str(run)
    state = json.loads((run / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(state["tracking_uri"])
    history = client.get_metric_history(state["run_id"], f"eval/{TASK}/acc")
    assert [(m.step, m.value) for m in history] == [(2, scores["acc"])]
    assert [a.path for a in client.list_artifacts(state["run_id"], "eval")] == [f"eval/{files[0].name}"]
    events = EventAccumulator(str(run))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars(f"eval/{TASK}/acc_norm")] == \
        [(2, pytest.approx(scores["acc_norm"]))]
    assert [e.step for e in events.Scalars("loss")] == [1, 2]  # training's curve, untouched


def test_bad_input_is_one_line_and_exit_2(setup, tmp_path, capsys, monkeypatch):
    import sys

    tasks = str(setup["tasks"])
    mlp = train_in_process(tmp_path / "runs", mlp_config(tmp_path / "runs", "mlp", train={"max_steps": 1}))
    cases = [
        (["eval", str(setup["export"]), "--tasks", "nope", "--include", tasks],
         f"error: --tasks = 'nope': expected a task of the --include folders ({TASK}) or of lm_eval"),
        (["eval", str(tmp_path / "missing"), "--tasks", TASK, "--include", tasks],
         "error: RUN_OR_EXPORT = "),
        (["eval", str(setup["export"]), "--tasks", str(tmp_path / "gone.yaml")], "no such file"),
        (["eval", str(setup["export"]), "--tasks", TASK, "--include", str(tmp_path / "nodir")],
         "error: --include = "),
        (["eval", str(mlp), "--tasks", TASK, "--include", tasks], "a run of a Hugging Face model"),
        (["eval", str(setup["export"]), "--tasks", TASK, "--include", tasks, "--limit", "0"],
         "error: --limit = '0': expected an integer >= 1"),
        (["eval", str(setup["export"]), "--tasks", TASK, "--served-model", "x"], "only with --base-url"),
    ]
    bad_data = tmp_path / "bad"
    bad_data.mkdir()
    (bad_data / "broken.yaml").write_text(f"task: broken\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                          f"    test: {tmp_path / 'none.jsonl'}\noutput_type: multiple_choice\n"
                                          "test_split: test\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: 0\n")
    cases.append((["eval", str(setup["export"]), "--tasks", "broken", "--include", str(bad_data)],
                  "error: --tasks = 'broken': expected a task whose YAML and data load"))
    for argv, expected in cases:
        assert rtp(argv) == 2, argv
        err = capsys.readouterr().err
        assert expected in err and len(err.splitlines()) == 1 and "Traceback" not in err, (argv, err)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: its import fails
    assert rtp(["eval", str(setup["export"]), "--tasks", TASK, "--include", tasks]) == 2
    err = capsys.readouterr().err
    assert "rtp eval needs lm-evaluation-harness" in err and "raytrain_platform[eval]" in err
    assert len(err.splitlines()) == 1


@pytest.mark.ray
def test_scores_through_rtp_serve_equal_lm_eval_hf_on_the_same_export(setup, hf_record, ray_cluster, monkeypatch):
    """lm_eval's local-completions against `rtp serve` of the export (with an API key,
    from RTP_API_KEY as the CLI reads it): the same log-likelihoods, the same scores."""

    from raytrain_platform.evaluation import EvalSpec, evaluate_path
    from raytrain_platform.serve.builder import app

    monkeypatch.setenv("RTP_API_KEY", "sk-eval-test")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    application = app({"checkpoint": f"ft={setup['export']}", "api_key_env": "RTP_API_KEY", "cpus_per_replica": 1})
    with serve_app(application) as url:
        _, served = evaluate_path(setup["export"], EvalSpec(tasks=[TASK], include=[str(setup["tasks"])],
                                                            base_url=url, log_samples=True))
    assert served["backend"] == "local-completions" and served["served_model"] is None
    torch.testing.assert_close(torch.tensor(_sample_lls(served), dtype=torch.float64),
                               torch.tensor(_sample_lls(hf_record), dtype=torch.float64), rtol=0, atol=LL_ATOL)
    assert served["scores"] == hf_record["scores"]
    assert not math.isnan(served["scores"][TASK]["acc"])


def test_run_eval_tasks_are_checked_with_the_config_before_ray(setup, tmp_path, capsys):
    import yaml

    tasks = str(setup["tasks"])
    cases = [({"eval_tasks": ["nope"], "eval_include": [tasks]},
              f"error: run.eval_tasks = 'nope': expected a task of the run.eval_include folders ({TASK})"),
             ({"eval_tasks": [TASK], "eval_include": [str(tmp_path / "nodir")]}, "error: run.eval_include = "),
             ({"eval_tasks": [""]}, "error: run.eval_tasks[0] = '': expected a non-empty string"),
             ({"eval_include": [tasks]}, "error: run.eval_include = ")]
    for run, expected in cases:
        cfg = hf_config(tmp_path, "v", setup["export"], run=run)
        (tmp_path / "v.yaml").write_text(yaml.safe_dump(cfg))
        assert rtp(["validate", str(tmp_path / "v.yaml")]) == 2, run
        err = capsys.readouterr().err
        assert expected in err and len(err.splitlines()) == 1, (run, err)
    mlp = mlp_config(tmp_path, "m", run={"eval_tasks": [TASK], "eval_include": [tasks]})
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(mlp))
    assert rtp(["validate", str(tmp_path / "m.yaml")]) == 2
    assert "run.eval_tasks = ['docmc']: expected [] for model.name 'mlp'" in capsys.readouterr().err
    ok = hf_config(tmp_path, "ok", setup["export"], run={"eval_tasks": TASK, "eval_include": tasks})
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(ok))
    assert rtp(["validate", str(tmp_path / "ok.yaml")]) == 0


@pytest.mark.ray
@pytest.mark.extended
def test_rtp_train_scores_run_eval_tasks_into_its_mlflow_run(setup, ray_cluster, tmp_path, hf_record):
    """`run.eval_tasks` at the end of `rtp train`: the final checkpoint scored, its results
    in eval/ and in the training's own MLflow run, at the last step."""
    from mlflow import MlflowClient

    from raytrain_platform.launch.trainer import train

    runs = tmp_path / "runs"
    cfg = hf_config(runs, "evald", setup["export"], train={"max_steps": 1, "lr": 1e-9, "warmup_steps": 0},
                    run={"checkpoint_every": 0, "eval_every": 0, "eval_batches": 1, "tracking": ["mlflow"],
                         "eval_tasks": [TASK], "eval_include": [str(setup["tasks"])]})
    result = train(cfg, progress=False)
    files = list((result.run_dir / "eval").glob("step_00000001_*.json"))
    assert len(files) == 1
    scores = json.loads(files[0].read_text())["scores"][TASK]
    state = json.loads((result.run_dir / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(state["tracking_uri"])
    assert [(m.step, m.value) for m in client.get_metric_history(state["run_id"], f"eval/{TASK}/acc")] == \
        [(1, scores["acc"])]
    assert client.get_run(state["run_id"]).info.status == "FINISHED"
