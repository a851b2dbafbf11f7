"""Ray's private APIs used here (Ray 2.60), each with why. Everything else uses Ray's
public API. Ray is imported inside the functions (this module is imported by layers that
must not import Ray at module level). tests/test_compat.py resolves each entry of `USED`.

>>> JOB_CONFIG_ENV
'RAY_JOB_CONFIG_JSON_ENV_VAR'
"""

from __future__ import annotations

from typing import Any

from raytrain_platform.compat import resolve

__all__ = ["JOB_CONFIG_ENV", "USED", "available_resources_per_node", "limit_streaming_blocks",
           "llm_config_class", "placement_group_id", "resolve", "worker_group_callback"]

# The environment variable through which Ray hands a submitted job's driver its job config
# (ray._private.runtime_env.constants): the job's runtime_env, which no public API returns.
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"

USED: dict[str, str] = {
    "ray._private.runtime_env.constants:RAY_JOB_CONFIG_JSON_ENV_VAR":
        "the name of the variable holding a submitted job's runtime_env (JOB_CONFIG_ENV)",
    "ray._private.state:available_resources_per_node":
        "free resources per node, to place TP groups within a node (ray.util.tpu reads it the same way)",
    "ray.train.v2._internal.execution.callback:WorkerGroupCallback":
        "a Train callback that records a trial's placement group, released when Tune stops the trial",
    "ray._raylet:PlacementGroupID": "the placement group of a stopped trial, rebuilt from its recorded id",
    "ray.llm._internal.serve.core.configs.llm_config:LLMConfig":
        "Ray Serve LLM's config schema, to check --engine vllm configs where vLLM is not installed "
        "(the public ray.serve.llm.LLMConfig imports vLLM)",
    "ray.data.context:DataContext.get_current()._max_num_blocks_in_streaming_gen_buffer":
        "how many token blocks a read task runs ahead of training (no public setting)",
}


def available_resources_per_node() -> dict[str, dict[str, float]]:
    return resolve("ray._private.state:available_resources_per_node")()


def worker_group_callback() -> type:
    return resolve("ray.train.v2._internal.execution.callback:WorkerGroupCallback")


def placement_group_id(hex_id: str) -> Any:
    return resolve("ray._raylet:PlacementGroupID")(bytes.fromhex(hex_id))


def llm_config_class() -> type:
    """Ray Serve LLM's ``LLMConfig``: the public class where vLLM is installed, else its base."""
    try:
        from ray.serve.llm import LLMConfig
    except ImportError:
        return resolve("ray.llm._internal.serve.core.configs.llm_config:LLMConfig")
    return LLMConfig


def limit_streaming_blocks(context: Any, blocks: int) -> None:
    """At most `blocks` blocks a streaming read task yields ahead of its consumer.
    An AttributeError (the setting renamed or gone) is loud, not skipped."""
    if not hasattr(context, "_max_num_blocks_in_streaming_gen_buffer"):
        raise AttributeError("ray.data.DataContext has no _max_num_blocks_in_streaming_gen_buffer in this Ray "
                             "(raytrain_platform/compat/ray_private.py)")
    context._max_num_blocks_in_streaming_gen_buffer = blocks
