"""API keys: ``rtp serve --api-key KEY`` (repeatable) or ``RTP_API_KEY`` (comma-separated)
make every ``/v1/`` route require ``Authorization: Bearer KEY``, the header OpenAI's
clients send. A request without it, or with a key not configured, is a 401 in OpenAI's
error shape; ``/healthz`` answers liveness to anyone and names the models only to a key.

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured
key (no early exit), so the time taken tells nothing of a key's length or of how much of
it matched. No key is ever put in a message, a log line or a written config: a Serve
config records the environment variable the keys come from (`API_KEY_ENV`).

>>> keys = parse_api_keys("k1, k2", source="RTP_API_KEY")
>>> is_authorized("Bearer k2", digests(keys)), is_authorized("Bearer k3", digests(keys))
(True, False)
>>> parse_api_keys("two words", source="--api-key")
Traceback (most recent call last):
...
raytrain_platform.errors.ConfigError: --api-key = '(not shown)': expected keys of printable ASCII without spaces or commas
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Iterable

from raytrain_platform.errors import ConfigError

__all__ = ["API_KEY_ENV", "PROTECTED_PREFIX", "digests", "is_authorized", "is_loopback", "keys_from_env",
           "parse_api_keys"]

API_KEY_ENV = "RTP_API_KEY"
PROTECTED_PREFIX = "/v1/"  # OpenAI's routes, the model list, and this package's predict/generate
_KEY = re.compile(r"[\x21-\x2b\x2d-\x7e]+")  # printable ASCII but space and comma: a header value, a list item
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HIDDEN = "(not shown)"  # what a message says in place of a key


def parse_api_keys(value: str | Iterable[str], *, source: str) -> tuple[str, ...]:
    """Keys from a comma-separated string or a list of them (`source` names the flag or
    variable in errors, which never show the value); at least one."""
    items = value.split(",") if isinstance(value, str) else [k for item in value for k in item.split(",")]
    keys = tuple(dict.fromkeys(k.strip() for k in items if k.strip()))
    if not keys:
        raise ConfigError(source, "", "at least one API key (comma-separated)")
    if not all(_KEY.fullmatch(k) for k in keys):
        raise ConfigError(source, _HIDDEN, "keys of printable ASCII without spaces or commas")
    return keys


def keys_from_env(name: str) -> tuple[str, ...]:
    """The keys the environment variable `name` holds; a ConfigError if it is unset or
    holds none (a deployment configured for keys never serves without them)."""
    if not _ENV_NAME.fullmatch(name):
        raise ConfigError("api_key_env", name, "an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
    value = os.environ.get(name, "")
    if not value.strip():
        raise ConfigError("api_key_env", name, f"an environment variable holding the API keys (comma-separated); "
                          f"{name} is unset or empty where the application is built")
    return parse_api_keys(value, source=name)


def digests(keys: Iterable[str]) -> tuple[bytes, ...]:
    """What a replica keeps: each key's SHA-256 (equal lengths for the comparison)."""
    return tuple(hashlib.sha256(k.encode("ascii")).digest() for k in keys)


def is_authorized(authorization: str | None, key_digests: tuple[bytes, ...]) -> bool:
    """Whether an ``Authorization`` header value carries one of the keys (``Bearer KEY``;
    the scheme is case-insensitive). Every configured key is compared, whatever matched."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        given = ""
    given_digest = hashlib.sha256(given.strip().encode("utf-8", "surrogateescape")).digest()
    matched = False
    for digest in key_digests:
        matched |= hmac.compare_digest(given_digest, digest)
    return matched and bool(given.strip())


def is_loopback(host: str) -> bool:
    """Whether `host` (what ``--host`` binds) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: it may resolve to any interface
        return False
