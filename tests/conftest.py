import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")


def job_config(tmp: Path, name: str, own: dict, **sections) -> dict:
    """A small job config every module's builder starts from: one process on half a CPU
    with one torch thread, evaluations and checkpoints every 5 steps; `own` (the
    builder's model, data, train and any run keys) then `sections` (a test's changes)
    update it section by section, key by key."""
    cfg: dict = {
        "parallel": {"strategy": "none"},
        "scaling": {"num_workers": 1, "cpus_per_worker": 0.5, "torch_threads": 1},
        "run": {"name": name, "storage_path": str(tmp), "checkpoint_every": 5, "eval_every": 5,
                "eval_batches": 2},
    }
    for changes in (own, sections):
        for section, values in changes.items():
            cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


# The transformer jobs' optimizer: 10 steps of AdamW with warm-up and clipping.
LM_TRAIN = {"max_steps": 10, "lr": 3e-3, "warmup_steps": 2, "grad_clip": 1.0, "seed": 0}


def mlp_config(tmp: Path, name: str, **sections) -> dict:
    return job_config(tmp, name, dict(
        model={"name": "mlp", "kwargs": {"hidden_sizes": [32]}},
        data={"source": "synthetic", "batch_size": 8, "num_samples": 1024, "val_fraction": 0.1},
        train={"max_steps": 10, "lr": 0.05, "optimizer": "sgd", "grad_clip": 0.0, "seed": 3}), **sections)


def hf_config(tmp: Path, name: str, model_dir: Path, **sections) -> dict:
    """A 10-step job on the hf model in `model_dir` (synthetic tokens), one process;
    `sections` update the config's sections key by key."""
    return job_config(tmp, name, dict(
        model={"name": "hf", "kwargs": {"path": str(model_dir)}},
        data={"source": "synthetic", "batch_size": 8, "num_samples": 1024, "seq_len": 32,
              "val_fraction": 0.05},
        train=dict(LM_TRAIN), run={"keep_checkpoints": 4}), **sections)


def tied_copy(model_dir: Path, out: Path) -> Path:
    """The Hugging Face model in `model_dir` with its LM head tied to the embedding (as
    Llama 3.2 1B and the small Qwens), saved in `out` by `save_pretrained` as such a model
    is published: the file holds ``model.embed_tokens.weight`` and no head."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(model_dir, out)
    (out / "model.safetensors").unlink()
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config)
    state = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    model.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"}, strict=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    return out


def train_in_process(root: Path, cfg: dict) -> Path:
    """Train `cfg` with the Ray-free core in this process (no Ray: about a second for a
    small model); its YAML goes beside `root`. Returns the run directory."""
    import yaml

    from raytrain_platform.core.__main__ import main as core_main

    path = root.parent / f"{cfg['run']['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    assert core_main(["--config", str(path)]) == 0
    return root / cfg["run"]["name"]


def load_test(total: int, clients: int, one_request) -> tuple[list[str], float]:
    """`total` requests from `clients` threads, thread k sending requests k, k + clients,
    ...; `one_request(i)` returns None when request i was answered right, else what was
    wrong (an exception counts as wrong, with its text). Returns the failures (all of
    them: a load test reports every error, not the first) and the seconds taken."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    failures: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(k, total, clients):
            try:
                wrong = one_request(i)
            except Exception as exc:  # noqa: BLE001 - counted, not raised
                wrong = f"{type(exc).__name__}: {exc}"
            if wrong is not None:
                with lock:
                    failures.append(wrong[:200])

    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return failures, time.monotonic() - start


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A pretrained tiny Llama (2 layers of 64, GQA 4/2), its tokenizer and data
    (tools/tiny_llm.py); a module may define its own `tiny` with other sizes."""
    from raytrain_platform.tools.tiny_llm import make_all

    return make_all(tmp_path_factory.mktemp("tiny"), samples=200, hidden_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def tok(tiny):
    """The tokenizer of the module's `tiny` (loaded as transformers loads it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny["tokenizer"]), local_files_only=True)


def assert_losses_close(actual: list[float], expected: list[float], *, rtol: float, atol: float = 1e-6) -> None:
    """Two loss curves equal step by step within `rtol` (relative) + `atol`, lengths first."""
    import torch

    assert len(actual) == len(expected), (len(actual), len(expected))
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=rtol, atol=atol)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for torchrun's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(application):
    """A Serve `application` (serve/builder.py's `app`) on a free port of 127.0.0.1,
    as "rtp", at "/": yields its base URL; Serve is shut down after."""
    from ray import serve

    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application, name="rtp", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def torchrun_launch(nproc: int) -> list[str]:
    """The launcher's command line for `nproc` ranks on 127.0.0.1 at a free port; the
    script or ``-m module`` and its arguments follow."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port())]


def torchrun_metrics(cfg: dict, config_path: Path, nproc: int, *, timeout: int = 300,
                     env: dict | None = None) -> list[dict]:
    """Train `cfg` with the Ray-free core under torchrun (`nproc` ranks on 127.0.0.1);
    returns the metrics rows it logged in its run directory."""
    import json
    import subprocess

    import yaml

    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(cfg))
    cmd = [*torchrun_launch(nproc), "-m", "raytrain_platform.core", "--config", str(config_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = Path(cfg["run"]["storage_path"]) / cfg["run"]["name"]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_torchrun(tmp: Path, name: str, nproc: int, **patch) -> list[float]:
    """`mlp_config(tmp, name, **patch)` under torchrun; returns its losses."""
    rows = torchrun_metrics(mlp_config(tmp, name, **patch), tmp / f"{name}.yaml", nproc)
    return [r["loss"] for r in rows]


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left."""
    if proc.poll() is not None and not _group_alive(proc.pid):
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline and _group_alive(proc.pid):
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        if not _group_alive(proc.pid):
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"process exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


@pytest.fixture(scope="module")
def ray_cluster():
    """One real local Ray per test module (start-up is the expensive part)."""
    import ray

    from raytrain_platform.launch.session import DRIVER_ENV, JOB_ENV

    for key, value in DRIVER_ENV.items():  # the driver's side of it, as `rtp train` sets it
        os.environ.setdefault(key, value)
    # The job's environment as `rtp train` sets it.
    # Workers import tests/user_models.py (model.name "user_models:..."), as the driver does.
    paths = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**JOB_ENV, "PYTHONPATH": paths}})
    yield
    ray.shutdown()


class LayoutRuns:
    """Each layout's run under torchrun (no Ray), trained when a test first asks for it,
    in ``root / name``. `layouts` maps a name to (processes, config sections), or
    (processes, sections, environment), the environment's values formatted with
    ``{root}``; "one" is one process as configured. `config(root, name, **sections)`
    builds the job config. A layout that failed is reported to later readers, not rerun."""

    def __init__(self, root: Path, layouts: dict, config, *, timeout: int = 300):
        self.root, self.layouts, self.config, self.timeout = root, layouts, config, timeout
        self._done: dict[str, list[dict]] = {}
        self._failed: dict[str, str] = {}

    def __getitem__(self, name: str) -> list[dict]:
        if name in self._failed:
            raise AssertionError(f"layout {name} failed earlier: {self._failed[name]}")
        if name not in self._done:
            nproc, sections, *env = (1, {}) if name == "one" else self.layouts[name]
            cfg = self.config(self.root, name, **sections)
            try:
                self._done[name] = torchrun_metrics(
                    cfg, self.root / f"{name}.yaml", nproc, timeout=self.timeout,
                    env={k: v.format(root=self.root) for k, v in (env[0] if env else {}).items()})
            except BaseException as exc:
                self._failed[name] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
                raise
        return self._done[name]
