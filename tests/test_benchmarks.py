"""Benchmarks are not timed in tests; their --smoke mode runs here so they don't rot, and
every script is named in benchmarks/README.md and uses the package's public names only."""

import ast
import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.timeout(400)
BENCH = ROOT / "benchmarks"


def _private_names(tree: ast.Module) -> list[str]:
    """`_private` names a module takes from raytrain_platform: imported (``from
    raytrain_platform.x import _y``, a module path with a ``_part``) or reached as an
    attribute of a module it imported from there (``mod._y``)."""
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "raytrain_platform":
            parts = node.module.split(".")
            found += [f"{node.module} (module)" for part in parts if part.startswith("_") and part != "__main__"]
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            modules |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names
                        if a.name.split(".")[0] == "raytrain_platform"}
    found += [f"{node.value.id}.{node.attr} (line {node.lineno})" for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
              and node.attr.startswith("_") and not node.attr.startswith("__")]
    return found


def test_every_benchmark_is_in_the_readme_and_uses_public_names_only():
    """benchmarks/README.md names every script (`name.py`), and no script imports a
    `_private` name of the package: a benchmark times what a user can call."""
    readme = (BENCH / "README.md").read_text()
    named = set(re.findall(r"`([A-Za-z_][\w]*\.py)`", readme))
    scripts = sorted(BENCH.glob("*.py"))
    assert len(scripts) >= 10, scripts  # the glob found the folder
    assert [p.name for p in scripts if p.name not in named] == []
    private = {p.name: _private_names(ast.parse(p.read_text(), filename=str(p))) for p in scripts}
    assert {name: got for name, got in private.items() if got} == {}


def test_the_private_name_check_finds_each_form():
    """The check above on code that does each thing it forbids (and one it allows)."""
    code = ("from raytrain_platform.launch.worker import _as_tensors\n"
            "from raytrain_platform.data import packing\n"
            "import raytrain_platform.tools.tiny_llm as t\n"
            "from raytrain_platform._compat import x\n"
            "from raytrain_platform.core.__main__ import main\n"
            "packing._CONCAT_ARRAYS(1)\nt._qa_pairs(3)\nt.make_model()\nother._fine()\n")
    assert _private_names(ast.parse(code)) == [
        "raytrain_platform.launch.worker._as_tensors", "raytrain_platform._compat (module)",
        "packing._CONCAT_ARRAYS (line 6)", "t._qa_pairs (line 7)"]


def test_the_harness_writes_a_dated_page_and_compares_within_one_run(tmp_path, monkeypatch):
    """benchmarks/common.py: a results page states date, exact command and machine (CPU
    model, cores, torch and Ray versions), and a second run of the same day is appended,
    never written over; `compare` takes ratios of medians and repeat by repeat."""
    import importlib.metadata

    monkeypatch.syspath_prepend(str(BENCH))
    import common

    page = common.write_page("demo", "A demo", "| a | b |\n|---|---|\n| 1 | 2 |",
                             command="python benchmarks/demo.py --repeats 3", results_dir=tmp_path, date="2026-01-02")
    assert page == tmp_path / "demo-2026-01-02.md"
    text = page.read_text()
    header = text.splitlines()[2]
    assert text.startswith("# A demo\n\nDate: 2026-01-02 ") and "| 1 | 2 |" in text, text
    assert "Command: `python benchmarks/demo.py --repeats 3`" in header, header
    m = common.machine()
    assert m["cores"] >= 1 and m["cpu"] and f"{m['cpu']}, {m['cores']} cores" in header, header
    for package in ("torch", "ray"):
        assert f"{package} {importlib.metadata.version(package)}" in header, header
    common.write_page("demo", "A demo", "| 3 | 4 |", command="python benchmarks/demo.py", results_dir=tmp_path,
                      date="2026-01-02")
    again = page.read_text()
    assert again.startswith(text.rstrip("\n")) and again.count("Date: 2026-01-02") == 2 and "| 3 | 4 |" in again
    runs = {"base": [{"s": 2.0}, {"s": 4.0}, {"s": 3.0}], "new": [{"s": 3.0}, {"s": 4.0}, {"s": 6.0}]}
    got = common.compare(runs, "s", "base")
    assert got["median"] == {"base": 3.0, "new": 4.0} and got["ratio"]["new"] == pytest.approx(4 / 3)
    assert got["per_repeat"]["new"] == [1.5, 1.0, 2.0]


def _run(args: list[str], timeout: int = 380) -> str:
    proc = subprocess.run([sys.executable, *args], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.extended  # a benchmark's whole pipeline, minutes on 2 cores: run with -m extended
@pytest.mark.slow
def test_train_vs_loop_smoke():
    out = _run(["benchmarks/train_vs_loop.py", "--smoke"])
    assert out.count("Ray Data from Parquet vs in-memory hand loop") == 1  # smoke: the small model
    assert "a hand loop with the platform's fused AdamW" in out
    assert "quickstart data wait" in out


@pytest.mark.extended  # a benchmark's whole pipeline, minutes on 2 cores: run with -m extended
@pytest.mark.slow
def test_serve_bench_smoke():
    out = _run(["benchmarks/serve_bench.py", "--smoke"])
    assert "| mlp-small | on | 4 | 16 |" in out and "| gpt | off | 1 | 4 |" in out
    assert "batching gives" in out


@pytest.mark.extended  # a Ray, a Serve app and a tiny model: ~1 min; the OpenAI API itself is tested by default
@pytest.mark.slow
def test_serve_llm_smoke():
    out = _run(["benchmarks/serve_llm.py", "--smoke"])
    assert "generate (one at a time)" in out and "served, 4 clients" in out


@pytest.mark.extended  # a benchmark's whole pipeline, minutes on 2 cores: run with -m extended
@pytest.mark.slow
def test_strategies_smoke():
    """The strategy benchmark still runs: one layout of each kind, 3 steps each."""
    out = _run(["benchmarks/strategies.py", "--smoke"])
    rows = [line for line in out.splitlines() if line.startswith("| ") and "MiB" in line]
    assert len(rows) == 3, out  # none, tp2, pp2 1f1b


@pytest.mark.extended  # a benchmark's whole pipeline, minutes on 2 cores: run with -m extended
@pytest.mark.slow
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


@pytest.mark.slow
def test_gpu_train_smoke(tmp_path):
    """The GPU benchmark's tiny preset on CPU (gloo, FSDP2, 1 process: its loss must fall)."""
    _run(["benchmarks/gpu_train.py", "--smoke", "--out", str(tmp_path / "gpu.json")], timeout=120)
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["ok"] and not result["timed_out"], result
    run, = result["runs"]
    assert run["loss_fell"] and run["tokens_per_s"] > 0 and 0 < run["mfu"] < 1, run


@pytest.mark.extended  # the GPU benchmark's hf path on CPU, ~25 s (its gpt path runs by default)
@pytest.mark.slow
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


@pytest.mark.extended  # four torchrun launches (three for the MoE)
@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True])
def test_hf_load_smoke(tmp_path, moe):
    """Pretrained weights into FSDP2 shards and into pipeline stages (the MoE: FSDP2
    only, its per-expert tensors fused while loading) on 2 ranks, against one process:
    every side holds the checkpoint's weights exactly, each rank about half."""
    out = _run(["benchmarks/hf_load.py", "--smoke", "--dir", str(tmp_path / "model")] + (["--moe"] if moe else []))
    summary = json.loads(out[out.index("{"):])
    assert summary["weights_equal"], summary
    whole = summary["num_params"]
    assert sorted(summary["held_params_per_rank"]) == (["fsdp2"] if moe else ["fsdp2", "pp2"]), summary
    for side in summary["held_params_per_rank"]:
        held = summary["held_params_per_rank"][side]
        assert len(held) == 2 and all(0.4 * whole < h < 0.6 * whole for h in held), (side, held, whole)


@pytest.mark.extended  # a benchmark's whole pipeline (Ray, torchrun and accelerate launch), eager and compiled: ~2 min
@pytest.mark.slow
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


@pytest.mark.extended  # a tokenizer trained, records encoded, two engines: most of a minute on 2 cores
@pytest.mark.slow
def test_packing_smoke():
    """The packing benchmark (one process, no Ray): the padding table and both packings' steps."""
    out = _run(["benchmarks/packing.py", "--smoke"])
    assert "| 129 | " in out and "| documents | " in out and "| concat | " in out
    assert "documents / concat tokens/s:" in out and "wrote" not in out  # smoke writes nothing


@pytest.mark.extended  # an embedded Ray, a tokenizer trained, three tokenizing sides: about a minute on 2 cores
@pytest.mark.slow
def test_tokenize_pass_smoke():
    """The tokenizing pass against Ray Data and datasets.map, on 1 MB: every side counts the same tokens."""
    out = _run(["benchmarks/tokenize_pass.py", "--smoke"])
    assert "| pass | " in out and "| ray_data | " in out and "| datasets | " in out and "wrote" not in out


@pytest.mark.extended  # a tokenizer trained, TRL's DPOTrainer at 1 and 2 processes: about a minute on 2 cores
@pytest.mark.slow
def test_dpo_vs_trl_smoke(tmp_path):
    """TRL's DPOTrainer and the platform's torchrun core on the tiny model's preference
    pairs at 1 and 2 processes (DDP on gloo)."""
    pytest.importorskip("trl", reason="benchmark extra: pip install -e '.[bench]'")
    out = _run(["benchmarks/dpo_vs_trl.py", "--smoke", "--out", str(tmp_path / "dpo.json")])
    assert "| processes | TRL tokens/s |" in out
    summary = json.loads((tmp_path / "dpo.json").read_text())["summary"]
    assert summary["trl_1_tokens_per_s"] > 0 and summary["trl_2_tokens_per_s"] > 0, summary
    assert summary["platform_1_tokens_per_s"] > 0 and summary["platform_2_tokens_per_s"] > 0, summary
