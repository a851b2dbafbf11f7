"""One evaluation on lm-evaluation-harness: its tasks on a Hugging Face folder, read by
lm_eval's own ``hf`` model class (``HFLM``), or served by ``rtp serve`` and read through
its ``local-completions`` model (OpenAI's completions with ``echo`` and ``logprobs``,
the prompt as token ids of the folder's tokenizer). Both score the same log-likelihoods:
the same tokens, the same weights.

>>> scores_of({"docmc": {"alias": "docmc", "acc,none": 0.25, "acc_stderr,none": "N/A", "f1,strict": 1}})
{'docmc': {'acc': 0.25, 'f1.strict': 1.0}}
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_platform.errors import ConfigError
from raytrain_platform.evaluation.target import EvalTarget, prepared_target
from raytrain_platform.evaluation.tasks import check_loadable, check_tasks

__all__ = ["EvalSpec", "evaluate", "evaluate_path", "scores_of", "server_key"]

KEY_ENVS = ("OPENAI_API_KEY", "RTP_API_KEY")  # the key sent to a server, first found (RTP_API_KEY's first)


@dataclass
class EvalSpec:
    """What to evaluate with: tasks (names or YAML files), the folders that define them,
    and either lm_eval's HF model (`base_url` None) or a server at `base_url`."""

    tasks: list[str]
    include: list[str] = field(default_factory=list)
    base_url: str | None = None  # http://HOST:PORT of `rtp serve` (or any OpenAI-compatible server)
    served_model: str | None = None  # the model id there (default: the only one it lists)
    batch_size: int = 8
    limit: int | None = None  # documents per task (a quick look; the score is of those only)
    num_fewshot: int | None = None
    device: str = "cpu"
    log_samples: bool = False  # keep each document's requests and responses (in memory, not in the file)


def scores_of(results: dict) -> dict[str, dict[str, float]]:
    """lm_eval's per-task results -> ``{task: {metric: value}}``: numbers only, the
    ``none`` filter dropped from names (``acc,none`` -> ``acc``), stderrs left out."""
    scores: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or isinstance(value, bool) or \
                    not isinstance(value, (int, float)):
                continue
            scores.setdefault(task, {})[metric if filt == "none" else f"{metric}.{filt}"] = float(value)
    return scores


def server_key() -> str | None:
    """The API key sent to a server: ``$OPENAI_API_KEY``, else the first of ``$RTP_API_KEY``."""
    for name in KEY_ENVS:
        value = os.environ.get(name, "").split(",")[0].strip()
        if value:
            return value
    return None


def _context_len(model_dir: Path) -> int:
    """The positions the model takes (what lm_eval's HF model reads from the config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    for name in ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048  # lm_eval's own default


def _served_model(base_url: str, key: str | None) -> str:
    """The only model the server lists, or a ConfigError asking for --served-model."""
    import requests

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = requests.get(f"{base_url}/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        ids = [m["id"] for m in r.json()["data"]]
    except Exception as exc:  # unreachable, refused (401), not OpenAI's shape
        raise ConfigError("--base-url", base_url, f"an OpenAI-compatible server that lists its models "
                          f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if len(ids) != 1:
        raise ConfigError("--served-model", None, f"one of the models {base_url} serves: {', '.join(ids)}")
    return ids[0]


def _model(target: EvalTarget, spec: EvalSpec) -> Any:
    """lm_eval's model object: its HF model on the folder, or local-completions."""
    if spec.base_url is None:
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=str(target.model_dir), device=spec.device, batch_size=spec.batch_size,
                    trust_remote_code=False)
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    key = server_key()
    base = spec.base_url.rstrip("/")
    model_id = spec.served_model or _served_model(base, key)
    # Built here, not from an argument string: lm_eval logs those, and the header holds the key.
    return LocalCompletionsAPI(base_url=f"{base}/v1/completions", model=model_id, tokenizer=str(target.model_dir),
                               tokenizer_backend="huggingface", tokenized_requests=True,
                               max_length=_context_len(target.model_dir), batch_size=spec.batch_size,
                               max_retries=1, header={"Authorization": f"Bearer {key}"} if key else None)


def evaluate(target: EvalTarget, spec: EvalSpec, *, manager: Any = None) -> dict[str, Any]:
    """Run `spec`'s tasks on `target`: ``{"scores", "results", ...}`` (lm_eval's results
    trimmed to what is JSON, plus ``samples`` with `spec.log_samples`)."""
    import lm_eval

    if manager is None:  # else the caller checked them
        manager = check_tasks(spec.tasks, spec.include)
        check_loadable(manager, spec.tasks)
    started = time.time()
    out = lm_eval.simple_evaluate(model=_model(target, spec), tasks=list(spec.tasks), task_manager=manager,
                                  limit=spec.limit, num_fewshot=spec.num_fewshot, log_samples=spec.log_samples,
                                  bootstrap_iters=1000)
    backend = "hf" if spec.base_url is None else "local-completions"
    record = {"source": target.source, "step": target.step, "backend": backend, "tasks": list(spec.tasks),
              "served_model": spec.served_model if spec.base_url else None, "base_url": spec.base_url,
              "limit": spec.limit, "num_fewshot": spec.num_fewshot, "lm_eval_version": lm_eval.__version__,
              "wall_time_s": round(time.time() - started, 3), "scores": scores_of(out["results"]),
              "results": _jsonable(out["results"]), "n_samples": _jsonable(out.get("n-samples", {})),
              "versions": _jsonable(out.get("versions", {}))}
    if spec.log_samples:
        record["samples"] = out.get("samples", {})
    return record


def _jsonable(value: Any) -> Any:
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(value, default=handle_non_serializable))


def evaluate_path(path: str | Path, spec: EvalSpec, *, trust_builder: bool = False) -> tuple[EvalTarget, dict]:
    """Check `spec`'s tasks, prepare `path` (a run, checkpoint or export) and evaluate it."""
    manager = check_tasks(spec.tasks, spec.include)  # before any model is exported or loaded
    check_loadable(manager, spec.tasks)
    with prepared_target(path, trust_builder=trust_builder) as target:
        return target, evaluate(target, spec, manager=manager)
