"""`rtp serve DIR --write-config FILE --engine vllm`: a Ray Serve LLM application
(``ray.serve.llm:build_openai_app``, vLLM on GPUs) for Hugging Face folders that
``rtp export RUN --format hf`` wrote. The same OpenAI API as `--engine torch` (this
package's own replica), with vLLM's paged attention, CUDA graphs and tensor parallelism.

Each model becomes one ``LLMConfig``: its id, the folder as ``model_source``, the
context as ``max_model_len``, and the replicas (fixed, or autoscaling between
``min_replicas`` and ``max_replicas`` with the same target, delays and window). The
torch replica's own limits (max_new_tokens, max_prompt_bytes, batching, CPUs per
replica) are this package's engine's, not vLLM's: they are not written. vLLM needs a
GPU, so here the config is checked against Ray's own schemas instead: Serve's ``ServeDeploySchema`` for the file, and
``LLMConfig`` (``ray.serve.llm.LLMConfig`` is a plain subclass of the class used here,
which imports without vLLM) for every model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_platform.errors import ConfigError
from raytrain_platform.serve.options import ServeOptions

__all__ = ["LLM_APP_NAME", "LLM_BUILDER", "llm_app_config", "validate_llm_app_config"]

LLM_APP_NAME = "rtp-llm"
LLM_BUILDER = "ray.serve.llm:build_openai_app"
_HF_CONFIG = "config.json"


def _llm_config(entry: dict, options: ServeOptions) -> dict[str, Any]:
    path = Path(entry["checkpoint"])
    if not (path / _HF_CONFIG).is_file() or entry["tokenizer"] is None:
        raise ConfigError("--engine", "vllm", f"Hugging Face folders (model {entry['id']!r} is a "
                          f"{entry['model']['name']} checkpoint at {path}): export it with rtp export RUN "
                          "--format hf --out DIR and serve DIR, or use --engine torch")
    deployment: dict[str, Any] = {"max_ongoing_requests": options.max_ongoing_requests}
    if options.max_replicas:
        deployment["autoscaling_config"] = {"min_replicas": options.min_replicas,
                                            "max_replicas": options.max_replicas,
                                            "target_ongoing_requests": options.target_ongoing_requests,
                                            "upscale_delay_s": options.upscale_delay_s,
                                            "downscale_delay_s": options.downscale_delay_s,
                                            "look_back_period_s": options.look_back_period_s}
    else:
        deployment["num_replicas"] = options.num_replicas
    engine_kwargs: dict[str, Any] = {"tensor_parallel_size": 1}
    if entry["context_len"]:
        engine_kwargs["max_model_len"] = entry["context_len"]
    return {"model_loading_config": {"model_id": entry["id"], "model_source": str(path)},
            "engine_kwargs": engine_kwargs, "deployment_config": deployment}


def llm_app_config(catalog: dict[str, dict], options: ServeOptions, *, host: str, port: int) -> dict[str, Any]:
    """A Serve config (the `serve deploy` schema) running every model of `catalog` on vLLM."""
    llm_configs = [_llm_config(entry, options) for entry in catalog.values()]
    return {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port},
            "applications": [{"name": LLM_APP_NAME, "route_prefix": "/", "import_path": LLM_BUILDER,
                              "args": {"llm_configs": llm_configs}}]}


def validate_llm_app_config(config: dict[str, Any]) -> None:
    """Checks `config` with Ray's schemas: the Serve config, then each ``LLMConfig``."""
    from ray.serve.schema import ServeDeploySchema

    from raytrain_platform.compat.ray_private import llm_config_class

    LLMConfig: Any = llm_config_class()  # the public class needs vLLM (or SGLang) installed to import

    ServeDeploySchema.model_validate(config)
    for app in config["applications"]:
        for llm_config in app["args"]["llm_configs"]:
            LLMConfig.model_validate(llm_config)
