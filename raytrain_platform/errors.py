"""User-facing errors. Each is one line that names what is wrong and what is allowed.

The CLI turns any of these into a message on stderr and exit code 2; the HTTP
layer turns them into a 4xx. Nothing here imports torch or Ray.
"""

from __future__ import annotations

__all__ = ["UserError", "ConfigError", "DataError", "CheckpointError"]


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
