"""Serve application builders: options + checkpoints -> a Serve `Application`.

    serve run pipelines.serve:app checkpoint=runs/quickstart max_batch_size=16
    serve run pipelines.serve:app checkpoint=a=runs/a,b=runs/b max_models_per_replica=1

`app` takes the arguments Serve passes (``key=value`` strings from ``serve run``, or a
config's ``args``), checks them and loads every checkpoint once before anything is
deployed: a bad option or a missing, partial or mismatched checkpoint stops here with
one line naming it.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application, Deployment

from raytrain_platform.serve.catalog import load_catalog
from raytrain_platform.serve.options import ServeOptions, parse_serve_args

__all__ = ["app", "build_application", "deployment_options", "NORMAL_PRIORITY_ENV"]

# Ray starts workers at nice 15; replicas (and, in a Ray this package starts, Serve's
# proxy) answering requests run at normal priority.
NORMAL_PRIORITY_ENV = {"RAY_worker_niceness": "0"}
# Options that go into Serve's AutoscalingConfig (when max_replicas > 0), same names.
AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s",
                    "downscale_delay_s", "look_back_period_s")


def deployment_options(options: ServeOptions) -> dict[str, Any]:
    """Replicas (fixed or autoscaled), concurrency and resources of the deployment."""
    actor = {"num_cpus": options.cpus_per_replica, "num_gpus": 1 if options.use_gpu else 0,
             "runtime_env": {"env_vars": dict(NORMAL_PRIORITY_ENV)}}
    scaling: dict[str, Any] = {"num_replicas": options.num_replicas}
    if options.max_replicas:
        scaling = {"autoscaling_config": {key: getattr(options, key) for key in AUTOSCALING_KEYS}}
    return {"max_ongoing_requests": options.max_ongoing_requests, "ray_actor_options": actor,
            **scaling}


def build_application(catalog: dict[str, dict], options: ServeOptions) -> Application:
    """The deployment bound to an already loaded catalog (see `load_catalog`)."""
    from raytrain_platform.serve.app import ModelServer

    # @serve.deployment made the class a Deployment; mypy does not apply class decorators.
    deployment: Deployment = ModelServer  # type: ignore[assignment]
    return deployment.options(**deployment_options(options)).bind(catalog, options)


def app(args: dict) -> Application:
    """Serve's application builder: ``serve run pipelines.serve:app checkpoint=PATH [k=v ...]``.

    >>> application = app({"checkpoint": "runs/quickstart"})   # doctest: +SKIP
    """
    options = parse_serve_args(args)
    return build_application(load_catalog(options), options)
