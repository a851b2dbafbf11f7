"""User-facing errors. Each is one line that names what is wrong and what is allowed.

The CLI turns any of these into a message on stderr and exit code 2; the HTTP
layer turns them into a 4xx. Nothing here imports torch or Ray.
"""

from __future__ import annotations

__all__ = ["UserError", "ConfigError", "DataError", "CheckpointError", "user_cause", "first_line"]


class UserError(Exception):
    """Bad input from the user (config, data, checkpoint, request): never a bug."""


class ConfigError(UserError):
    """A config field has a bad value.

    >>> str(ConfigError("train.lr", -1, "a number > 0"))
    'train.lr = -1: expected a number > 0'
    """

    def __init__(self, field: str, value: object, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field} = {value!r}: expected {allowed}")

    def __reduce__(self):
        # Raised in a Ray worker, it is pickled to reach the driver: rebuild it from
        # its three fields (Exception's default would call __init__ with the message).
        return (type(self), (self.field, self.value, self.allowed))


class DataError(UserError):
    """The data named by the config cannot be used (missing, empty, wrong schema)."""


class CheckpointError(UserError):
    """A checkpoint is missing, partial, for another model, or unsafe to load."""


def user_cause(exc: BaseException) -> UserError | None:
    """A UserError raised inside a Ray worker arrives wrapped; find it."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen or e is None:
            continue
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        stack += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        stack += list(getattr(e, "worker_failures", {}).values()) if isinstance(
            getattr(e, "worker_failures", None), dict) else []
    return None


def first_line(exc: BaseException) -> str:
    """The error a person needs: for worker failures, the last line of rank 0's traceback."""
    failures = getattr(exc, "worker_failures", None)
    if isinstance(failures, dict) and failures:
        exc = failures[min(failures)]
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""
