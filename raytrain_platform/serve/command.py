"""`rtp serve`: serve checkpoints over HTTP until Ctrl-C, or write a Serve config.

    rtp serve runs/quickstart                         # http://127.0.0.1:8000, docs at /docs
    rtp serve mlp=runs/tabular gpt=runs/quickstart --replicas 2 --max-batch-size 16
    rtp serve runs/sweep --max-models-per-replica 2   # every run of a sweep, by run name
    rtp serve runs/quickstart --write-config serve.yaml && serve deploy serve.yaml
    rtp serve exported/ --write-config llm.yaml --engine vllm   # Ray Serve LLM (vLLM, GPUs)
    RTP_API_KEY=k1,k2 rtp serve runs/quickstart --host 0.0.0.0   # /v1/ needs Authorization: Bearer k1 (or k2)

Options and checkpoints are checked, and every checkpoint loaded once, before Ray
starts: bad input is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import yaml

from raytrain_platform.errors import ConfigError, UserError
from raytrain_platform.serve.auth import API_KEY_ENV, digests, is_loopback, parse_api_keys
from raytrain_platform.serve.options import ServeOptions, option_fields, parse_serve_args

__all__ = ["add_serve_arguments", "run_serve", "serve_config", "APP_NAME", "BUILDER_IMPORT_PATH"]

APP_NAME = "rtp"
BUILDER_IMPORT_PATH = "raytrain_platform.serve.builder:app"  # the same builder as pipelines.serve:app
ENGINES = ("torch", "vllm")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoints", nargs="+", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (latest checkpoint), checkpoint, export, or a folder of run "
                        "directories (a sweep); NAME=PATH sets the model id (default: the run's folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", default="8000", help="HTTP port (default 8000)")
    p.add_argument("--replicas", dest="num_replicas", default=None, help="replicas when not autoscaling (default 1)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else "
                                                   "an embedded local Ray)")
    p.add_argument("--write-config", metavar="FILE", default=None,
                   help="write a Serve config YAML for `serve deploy` instead of serving")
    p.add_argument("--api-key", dest="api_keys", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every /v1/ route; repeat for several keys "
                        f"(default: ${API_KEY_ENV}, comma-separated; the variable keeps keys out of the "
                        "process list)")
    p.add_argument("--engine", default="torch",
                   help="torch (default): this package's replicas, CPU or GPU; vllm (with --write-config): "
                        "a Ray Serve LLM config (ray.serve.llm, vLLM on GPUs) for Hugging Face exports")
    for f in option_fields():
        if f.name == "num_replicas":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action="store_true", default=None, help=f.metadata["help"])
        else:
            p.add_argument(flag, default=None, help=f"{f.metadata['help']} (default {f.default})")


def _options(args: argparse.Namespace) -> ServeOptions:
    """The flags as options; API keys from ``--api-key``, else from ``$RTP_API_KEY``."""
    given = {f.name: getattr(args, f.name) for f in option_fields() if getattr(args, f.name) is not None}
    if not args.api_keys and os.environ.get(API_KEY_ENV, "").strip():
        given["api_key_env"] = API_KEY_ENV
    options = parse_serve_args({"checkpoint": list(args.checkpoints), **given})
    if args.api_keys:
        options = dataclasses.replace(options, api_key_digests=digests(parse_api_keys(args.api_keys,
                                                                                      source="--api-key")))
    return options


def _warn_if_open(host: str, options: ServeOptions) -> None:
    if not options.api_key_digests and not is_loopback(host):
        print(f"warning: --host {host} is reachable from other machines and no API key is set: anyone who "
              f"can reach it can use every model served (set {API_KEY_ENV} or --api-key)",
              file=sys.stderr, flush=True)


def _keys_for_config(options: ServeOptions) -> ServeOptions:
    """A written config never holds a key: it names the variable the cluster reads them
    from (``$RTP_API_KEY``), where `serve deploy` builds the application."""
    if not options.api_key_digests or options.api_key_env:
        return options
    print(f"note: the API keys are not written to the config; it reads them from ${API_KEY_ENV} "
          "(comma-separated) where the application is built: set it there before serve deploy",
          file=sys.stderr, flush=True)
    return dataclasses.replace(options, api_key_env=API_KEY_ENV)


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:  # isdigit alone: '²', '٣' pass
        raise ConfigError("--port", text, "an integer in 1..65535")
    return int(text)


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"--host {host} --port {port}: cannot bind ({exc.strerror}); "
                            "pick another port with --port") from None


def serve_config(options: ServeOptions, *, host: str, port: int) -> dict[str, Any]:
    """A Serve config (the `serve deploy` schema) that deploys `options`."""
    return {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": BUILDER_IMPORT_PATH,
                              "args": options.to_args()}]}


def _engine(args: argparse.Namespace) -> str:
    if args.engine not in ENGINES:
        raise ConfigError("--engine", args.engine, f"one of {list(ENGINES)}")
    if args.engine == "vllm" and not args.write_config:
        raise ConfigError("--engine", args.engine, "torch to serve here; vllm writes a config for a GPU "
                          "cluster (add --write-config FILE)")
    return args.engine


def _write_config(path: str, options: ServeOptions, *, host: str, port: int, engine: str = "torch",
                  catalog: dict[str, dict] | None = None) -> None:
    from ray.serve.schema import ServeDeploySchema

    from raytrain_platform.serve.llm_config import llm_app_config, validate_llm_app_config

    if engine == "vllm":
        config = llm_app_config(catalog or {}, options, host=host, port=port)
        validate_llm_app_config(config)  # Serve's schema, and Ray Serve LLM's LLMConfig per model
    else:
        config = serve_config(options, host=host, port=port)
        ServeDeploySchema.model_validate(config)  # what `serve deploy` will check
    Path(path).write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"wrote {path}; deploy it with: serve deploy {path}")


def _stop_on_sigterm() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _serve_until_stopped(catalog: dict[str, dict], options: ServeOptions, *, host: str, port: int,
                         address: str | None) -> None:
    import ray
    from ray import serve

    from raytrain_platform.launch.session import init_ray
    from raytrain_platform.serve.builder import NORMAL_PRIORITY_ENV, build_application

    init_ray(address, verbose=False, env_vars=NORMAL_PRIORITY_ENV)
    attached = bool(address or os.environ.get("RAY_ADDRESS"))
    try:
        if options.use_gpu and ray.cluster_resources().get("GPU", 0) < 1:
            raise ConfigError("--use-gpu", True, "a Ray cluster with a GPU (this one has none)")
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_application(catalog, options), name=APP_NAME, route_prefix="/")
        url = f"http://{host}:{port}"
        print(f"serving {', '.join(catalog)} at {url} (OpenAPI: {url}/docs); Ctrl-C to stop", flush=True)
        _stop_on_sigterm()
        while True:
            signal.pause()
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:  # on a shared cluster, remove only this application
        serve.delete(APP_NAME) if attached else serve.shutdown()
        ray.shutdown()


def run_serve(args: argparse.Namespace) -> int:
    """`rtp serve`: check, load, then serve until Ctrl-C / SIGTERM (or write a config)."""
    from raytrain_platform.serve.catalog import load_catalog

    options = _options(args)
    port = _port(args.port)
    engine = _engine(args)
    if engine == "vllm" and options.api_key_digests:  # Ray Serve LLM's OpenAI ingress checks no key
        raise ConfigError("--engine", engine, f"torch with API keys (--api-key or ${API_KEY_ENV}): Ray Serve "
                          "LLM's OpenAI app has no key check; unset them, or put an authenticating proxy "
                          "in front of it")
    catalog = load_catalog(options)
    _warn_if_open(args.host, options)
    if args.write_config:
        _write_config(args.write_config, _keys_for_config(options), host=args.host, port=port, engine=engine,
                      catalog=catalog)
        return 0
    _check_port_free(args.host, port)
    _serve_until_stopped(catalog, options, host=args.host, port=port, address=args.address)
    print("stopped", flush=True)
    return 0
