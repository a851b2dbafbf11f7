"""Benchmarks are not timed in tests; their --smoke mode runs here so they don't rot."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _run(args: list[str], timeout: int = 380) -> str:
    proc = subprocess.run([sys.executable, *args], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.extended  # a benchmark's whole pipeline, minutes on 2 cores: run with -m extended
def test_train_vs_loop_smoke():
    out = _run(["benchmarks/train_vs_loop.py", "--smoke"])
    assert out.count("Ray Data from Parquet vs in-memory hand loop") == 1  # smoke: the small model
    assert "a hand loop with the platform's fused AdamW" in out
    assert "quickstart data wait" in out


@pytest.mark.extended  # a benchmark's whole pipeline, minutes on 2 cores: run with -m extended
def test_serve_bench_smoke():
    out = _run(["benchmarks/serve_bench.py", "--smoke"])
    assert "| mlp-small | on | 4 | 16 |" in out and "| gpt | off | 1 | 4 |" in out
    assert "batching gives" in out


@pytest.mark.extended  # a Ray, a Serve app and a tiny model: ~1 min; the OpenAI API itself is tested by default
def test_serve_llm_smoke():
    out = _run(["benchmarks/serve_llm.py", "--smoke"])
    assert "generate (one at a time)" in out and "served, 4 clients" in out


@pytest.mark.extended  # a benchmark's whole pipeline, minutes on 2 cores: run with -m extended
def test_strategies_smoke():
    """The strategy benchmark still runs: one layout of each kind, 3 steps each."""
    out = _run(["benchmarks/strategies.py", "--smoke"])
    rows = [line for line in out.splitlines() if line.startswith("| ") and "MiB" in line]
    assert len(rows) == 3, out  # none, tp2, pp2 1f1b


@pytest.mark.extended  # a benchmark's whole pipeline, minutes on 2 cores: run with -m extended
def test_run_smoke(tmp_path):
    """The one-command runner's new comparisons at tiny sizes, through its results writer,
    all on one Ray: Ray Data vs DataLoader ingest (and the tuning variants), 2-worker DDP
    with accumulation, and `rtp train` / the bare TorchTrainer script each reaching their
    first optimizer step. Nothing is timed; three Ray Train runs make most of its time."""
    _run(["benchmarks/run.py", "--smoke", "--out-dir", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    variants = results["ingest"]["variants"]
    assert set(variants) == {"ray_data", "dataloader", "ray_rowgroup_blocks", "ray_data_2w"}
    assert all(v["rows"] > 0 and v["rows_per_s"] > 0 for v in variants.values()), variants
    assert variants["ray_data"]["rows"] == variants["dataloader"]["rows"]  # the same batches
    assert results["scaling"]["samples_per_s"]["2w_accum4"] > 0
    assert results["scaling"]["samples_per_s"]["core_2w"] > 0  # the Ray-free core under torchrun
    assert results["startup"]["rtp_first_step_s"] > 0 and results["startup"]["bare_first_step_s"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| Ray Data ingest as the platform uses it (1 worker) vs torch DataLoader" in table
    assert "| start-up: `rtp train` to the first optimizer step" in table


def test_gpu_train_and_profile_smoke(tmp_path):
    """The GPU benchmark's tiny preset on CPU (gloo, FSDP2, 1 process: its loss must fall)
    and the step profiler on 2 torchrun ranks."""
    _run(["benchmarks/gpu_train.py", "--smoke", "--out", str(tmp_path / "gpu.json")], timeout=120)
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["ok"] and not result["timed_out"], result
    run, = result["runs"]
    assert run["loss_fell"] and run["tokens_per_s"] > 0 and 0 < run["mfu"] < 1, run
    _run(["benchmarks/profile_step.py", "--smoke", "--out", str(tmp_path / "profile.md")], timeout=120)
    profile = (tmp_path / "profile.md").read_text()
    assert "`rtp::micro_step`" in profile and "`aten::mm`" in profile


@pytest.mark.extended  # the GPU benchmark's hf path on CPU, ~25 s (its gpt path runs by default)
def test_gpu_train_hf_smoke(tmp_path):
    """The GPU benchmark's hf path on CPU: a Llama built from a config.json alone (init
    random), FSDP2 per decoder layer through the engine, 1 gloo process, eager and then
    with `parallel.compile` (`--compile`, as on a GPU); its loss must fall, and its MFU
    counts every parameter but the input embedding (a lookup)."""
    _run(["benchmarks/gpu_train.py", "--smoke", "--preset", "hf-smoke", "--compile",
          "--out", str(tmp_path / "gpu.json")], timeout=180)
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["ok"] and not result["timed_out"], result
    assert [run["compile"] for run in result["runs"]] == [False, True], result
    for run in result["runs"]:
        assert run["family"] == "hf" and run["loss_fell"] and run["tokens_per_s"] > 0 and 0 < run["mfu"] < 1, run
        assert run["flops_params"] == run["n_params"] - run["vocab_size"] * run["hidden_size"], run


def test_counted_logits_smoke(tmp_path):
    """The LM-head-on-counted-tokens benchmark (one process, no Ray, seconds): both modes
    timed; on the same batch and weights the same loss, and fewer bytes saved for backward."""
    out = _run(["benchmarks/counted_logits.py", "--smoke", "--out", str(tmp_path / "counted.json")])
    assert "| vocabulary (model) | head share of matmul weights | counted share |" in out
    got, = json.loads((tmp_path / "counted.json").read_text())["vocabs"]
    assert 0 < got["counted_share"] < 1 and got["steps_per_mode"] == 2, got
    assert 0 < got["head_share_of_matmul_weights"] < 1, got
    assert all(v > 0 for v in got["step_s"].values()), got
    assert got["loss_sum"]["counted"] == pytest.approx(got["loss_sum"]["all"], rel=1e-5), got
    assert got["saved_bytes"]["counted"] < got["saved_bytes"]["all"], got


def test_stream_decode_smoke(tmp_path):
    """Serving's detokenizer benchmark (one process, seconds): it runs, and both sides
    release the whole decode's text (the benchmark exits otherwise). Not timed here: the
    cost per token is bounded by `test_serve_text`'s count of decoded ids."""
    out = _run(["benchmarks/stream_decode.py", "--smoke", "--out", str(tmp_path / "s.json")])
    assert "| completion tokens | incremental, µs/token |" in out
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [64, 256], rows
    assert all(r["incremental_us_per_token"] > 0 and r["whole_us_per_token"] > 0 for r in rows), rows


@pytest.mark.extended  # four torchrun launches
def test_hf_load_smoke(tmp_path):
    """Pretrained weights into FSDP2 shards and into pipeline stages on 2 ranks, against
    one process: every side holds the checkpoint's weights exactly, each rank about half."""
    out = _run(["benchmarks/hf_load.py", "--smoke", "--dir", str(tmp_path / "llama")])
    summary = json.loads(out[out.index("{"):])
    assert summary["weights_equal"], summary
    whole = summary["num_params"]
    for side in ("fsdp2", "pp2"):
        held = summary["held_params_per_rank"][side]
        assert len(held) == 2 and all(0.4 * whole < h < 0.6 * whole for h in held), (side, held, whole)


@pytest.mark.extended  # a 2-process count of real JSONL, ~40 s (test_jsonl_data runs the same pass by default)
def test_count_pass_smoke(tmp_path):
    """The count pass batched in one process and on 2 worker processes,
    small files (~15 s): the benchmark itself checks that every side keeps the same
    counts and windows, bit for bit."""
    _run(["benchmarks/count_pass.py", "--smoke", "--processes", "2", "--out", str(tmp_path / "c.json")])
    result = json.loads((tmp_path / "c.json").read_text())
    assert set(result["formats"]) == {"chat", "prompt_completion", "text"}, result
    for fmt, r in result["formats"].items():
        assert set(r["runs"]) == {"batched", "2_processes"}, (fmt, r)
        assert r["windows"][0] > 0 and all(len(runs) == 1 for runs in r["runs"].values()), (fmt, r)


def test_cache_prune_smoke(tmp_path):
    """Looking over, trimming and reading a token cache of 200 entries (~2 s); the
    benchmark itself checks that the trim removed exactly the oldest tenth."""
    _run(["benchmarks/cache_prune.py", "--smoke", "--out", str(tmp_path / "p.json")])
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["entries"] == 200 and len(result["runs"]) == 1, result
    assert result["median"]["cache_bytes"] > 0 and result["median"]["read_us"] > 0, result


@pytest.mark.extended  # two 2-worker Ray Train runs, tiny: ~1.5 min
def test_window_cache_smoke(tmp_path):
    """The fine-tune through Ray with the kept windows and without them, one pair: both
    sides train and are timed; they read the same windows, so their losses are equal."""
    out = _run(["benchmarks/window_cache.py", "--smoke", "--out", str(tmp_path / "w.json")])
    assert "ratio_kept_over_tokenized" in out
    result = json.loads((tmp_path / "w.json").read_text())
    assert result["pairs"] == 1 and len(result["pair_ratios"]) == 1, result
    for side in ("kept", "tokenized"):
        (run,) = result["runs"][side]
        assert run["tokens_per_s"] > 0 and 0 <= run["data_wait_frac"] <= 1, result
    assert result["loss_max_abs_diff"] < 1e-4, result  # the same windows, the same steps


@pytest.mark.extended  # four torchrun runs, two of them compiled: ~1 min
def test_block_options_smoke(tmp_path):
    """Eager, checkpointed, compiled and both, on the tiny fine-tune: every side trains
    the same steps to the same losses, and the activation bytes show what each keeps."""
    _run(["benchmarks/block_options.py", "--smoke", "--out", str(tmp_path / "b.json")])
    result = json.loads((tmp_path / "b.json").read_text())
    assert set(result["runs"]) == {"eager", "checkpointed", "compiled", "both"}, result
    assert all(run["tokens_per_s"] > 0 for runs in result["runs"].values() for run in runs), result
    assert result["loss_max_abs_diff"] < 1e-4, result
    saved = result["activation_bytes"]
    assert saved["checkpointed"] <= saved["both"] <= 1.05 * saved["checkpointed"] < saved["compiled"], saved


@pytest.mark.extended  # a benchmark's whole pipeline (Ray, torchrun and accelerate launch), eager and compiled: ~2 min
def test_vs_accelerate_smoke(tmp_path):
    """The fine-tune through the platform (Ray Train; the torchrun core) and as a plain
    `accelerate launch`ed script, tiny, at 2 processes (DDP on gloo), one repeat, each
    also compiled (`--compile`). Same weights, windows and dealing on every side, so
    every step's loss agrees: the Accelerate script is an independent reference for the
    platform's fine-tune."""
    pytest.importorskip("accelerate", reason="benchmark extra: pip install -e '.[bench]'")
    out = _run(["benchmarks/vs_accelerate.py", "--smoke", "--compile", "--out", str(tmp_path / "vs.json")])
    assert "| processes | platform (Ray) tokens/s |" in out and "| 2, compiled |" in out
    result = json.loads((tmp_path / "vs.json").read_text())
    entry = result["processes"]["2"]
    sides = ("ray", "torchrun", "accelerate")
    assert all(entry[f"{side}{c}_tokens_per_s"] > 0 for side in sides for c in ("", "_compiled")), entry
    assert len(entry["losses_accelerate"]) == result["steps"]
    # Measured: equal to 5 decimals (fused vs default AdamW, and compiled kernels, differ only in rounding).
    for side in ("ray", "torchrun", "ray_compiled", "torchrun_compiled", "accelerate_compiled"):
        assert entry[f"loss_max_abs_diff_{side}"] < 1e-3, entry


@pytest.mark.extended  # one 2-worker Ray Train run over 2 epochs, tiny: ~40 s
def test_hf_data_smoke(tmp_path):
    """Tokenized chat JSONL through Ray Data into 2 DDP workers over 2 epochs: the data
    wait is read per step, over the whole run and at the second epoch's first step, and
    each evaluation (every 5 steps) is timed from outside."""
    out = _run(["benchmarks/hf_data.py", "--smoke", "--eval-every", "5", "--out", str(tmp_path / "d.json")])
    assert "| data_wait_frac_overall |" in out
    result = json.loads((tmp_path / "d.json").read_text())
    assert result["epochs"] == 2 and result["steps"] == 2 * result["steps_per_epoch"], result
    assert len(result["epoch_first_step_wait_s"]) == 1, result
    assert 0 <= result["data_wait_frac_median"] <= result["data_wait_frac_max"] <= 1, result
    assert 0 <= result["data_wait_frac_overall"] <= 1, result
    evals = result["eval_extra_s"]  # every 5th step but the last (it also checkpoints)
    assert [step for step, _ in evals] == list(range(5, result["steps"], 5)), result
    assert result["first_eval_extra_s"] == evals[0][1], result


@pytest.mark.extended  # two Ray Train runs and one torchrun run, tiny: ~1 min
def test_ray_overhead_smoke(tmp_path):
    """Where a 2-process run's time goes (Linux scheduler statistics), through Ray and
    under torchrun: the training threads' shares of wall time are shares, both training
    processes are found in each run's own process tree, and Ray's other processes are
    counted on the Ray side only."""
    import os

    args = ["benchmarks/ray_overhead.py", "--smoke", "--out", str(tmp_path / "o.json")]
    out = _run(args)  # SCHED_IDLE phases as root (the default there), none otherwise
    assert "| 2 processes | step s |" in out
    result = json.loads((tmp_path / "o.json").read_text())
    for side in ("ray", "torchrun"):
        run, = result["runs"][side]
        assert len(run["training_threads"]) == 2 and run["step_s"] > 0, run
        for t in run["training_threads"]:  # shares of the thread's own wall time, read beside it
            assert 0.05 < t["on_cpu"] and 0 <= t["runq_wait"] and t["on_cpu"] + t["runq_wait"] <= 1.05, t
    assert result["ray"]["ray_processes"]["count"] >= 5, result["ray"]
    assert result["torchrun"]["ray_processes"]["count"] == 0, result["torchrun"]
    if os.geteuid() == 0:
        assert result["sched_idle"]["helper_threads_set"] > 0 and result["sched_idle"]["sched_idle_step_s"] > 0


def test_ray_overhead_refuses_a_window_across_an_epoch_boundary(monkeypatch):
    """A Ray run's next epoch restarts its Ray Data pipeline: its first step waits for
    data, which ray_overhead.py would count as time asleep. Row i is step i + 1; the
    window is rows [first, last), checked from the step before it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ray_overhead

    rows = [{"epoch": 0}] * 44 + [{"epoch": 1}] * 16  # step 45 starts epoch 1
    ray_overhead.one_epoch(rows, 10, 44, "run")  # steps 11-44
    ray_overhead.one_epoch(rows, 45, 60, "run")  # steps 46-60: epoch 1 without its first step
    for first, last in ((10, 55), (44, 60)):  # across it; from epoch 1's first step
        with pytest.raises(RuntimeError, match=f"steps {first}-{last} cross an epoch boundary"):
            ray_overhead.one_epoch(rows, first, last, "run")


@pytest.mark.extended  # a tokenizer trained, records encoded, two engines: most of a minute on 2 cores
def test_packing_smoke():
    """The packing benchmark (one process, no Ray): the padding table and both packings' steps."""
    out = _run(["benchmarks/packing.py", "--smoke"])
    assert "| 129 | " in out and "| documents | " in out and "| concat | " in out
    assert "documents / concat tokens/s:" in out and "wrote" not in out  # smoke writes nothing
