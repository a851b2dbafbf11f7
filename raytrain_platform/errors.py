"""User-facing errors. Each is one line that names what is wrong and what is allowed.

The CLI turns any of these into a message on stderr and exit code 2; the HTTP
layer turns them into a 4xx. Nothing here imports torch or Ray.
"""

from __future__ import annotations

import argparse
import errno
import re
import sys
import tempfile
from pathlib import Path
from typing import NoReturn, TypeVar

__all__ = ["CheckpointError", "ConfigError", "DataError", "NonFiniteError", "OneLineParser", "PATH_ERRNOS", "UserError",
           "describe_error", "first_line", "folder_problem", "root_cause", "user_cause"]


# An OSError with one of these, writing where the user said, is a bad path (exit 2), not a
# failed run.
PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
                         errno.EEXIST, errno.ENAMETOOLONG})


def folder_problem(target: Path) -> str | None:
    """Why no folder can be written at the local path `target`, or None: it is a folder
    that takes new entries, or it can be created (its nearest existing parent is one,
    shown by creating and removing a nameless file there, which also holds for root and
    for read-only mounts, where permission bits alone mislead). Nothing else is created.
    The one check behind ``run.storage_path``, ``rtp doctor --out``, ``rtp export --out``,
    ``rtp make-data`` and ``tiny_llm``.

    >>> folder_problem(Path("/proc/version")), folder_problem(Path("/proc/version/x"))
    ('/proc/version is a file', '/proc/version is a file, so it cannot be created')
    >>> folder_problem(Path("/proc/rtp/x"))
    '/proc is not writable (No such file or directory)'
    """
    existing = target
    try:
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent  # where the missing folders would be created
        if not existing.is_dir():
            return f"{existing} is a file" + ("" if existing == target else ", so it cannot be created")
    except OSError as exc:  # a parent this user may not search
        return f"{existing} cannot be reached ({exc.strerror or type(exc).__name__})"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return f"{existing} is not writable ({exc.strerror or type(exc).__name__})"
    return None


class OneLineParser(argparse.ArgumentParser):
    """An `argparse` parser whose own errors (an unknown flag, a flag without its value, a
    missing argument) are one line on stderr and exit 2, not a usage block; its
    subparsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


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


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weights (a diverged run).
    Not bad input: the CLI exits 1. The message names the step and the newest
    checkpoint whose loss was finite."""


# Where Ray keeps the exception it wraps: RayTaskError.cause, Train v2's
# UserExceptionWithTraceback._base_exc and ControllerError.controller_failure.
_WRAPPED_ATTRS = ("cause", "_base_exc", "controller_failure")
# A remote traceback whose exception object did not survive the trip (only its text did).
_OURS_IN_TEXT = re.compile(r"raytrain_platform\.errors\.(ConfigError|DataError|CheckpointError|UserError): (.+)")


def _links(exc: BaseException) -> list[BaseException]:
    """The exceptions `exc` wraps, innermost-first candidates in a stable order: Ray's
    wrapped exception, each failed worker's (by rank), a group's members, then the
    explicit cause (or the implicit context, unless suppressed with ``from None``)."""
    out: list[BaseException] = []
    for name in _WRAPPED_ATTRS:
        inner = getattr(exc, name, None)
        if isinstance(inner, BaseException):
            out.append(inner)
    failures = getattr(exc, "worker_failures", None)
    if isinstance(failures, dict):
        out += [failures[rank] for rank in sorted(failures) if isinstance(failures[rank], BaseException)]
    out += [e for e in getattr(exc, "exceptions", ()) or () if isinstance(e, BaseException)]
    if exc.__cause__ is not None:
        out.append(exc.__cause__)
    elif exc.__context__ is not None and not exc.__suppress_context__:
        out.append(exc.__context__)
    return out


def _walk(exc: BaseException) -> list[tuple[int, BaseException]]:
    """Every exception reachable from `exc`, depth-first, each once, with its depth."""
    seen: set[int] = set()
    order: list[tuple[int, BaseException]] = []
    stack = [(0, exc)]
    while stack:
        depth, e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        order.append((depth, e))
        stack += [(depth + 1, inner) for inner in reversed(_links(e))]
    return order


def _from_text(exc: BaseException) -> UserError | None:
    """Our error named in a remote traceback's text (the object itself was lost)."""
    for _, e in _walk(exc):
        for text in (getattr(e, "traceback_str", None), str(e)):
            found = _OURS_IN_TEXT.findall(text or "")
            if found:
                kind, message = found[-1]
                # A ConfigError's three fields are not in its text: rebuilt as a UserError.
                return {"DataError": DataError, "CheckpointError": CheckpointError}.get(
                    kind, UserError)(message.strip())
    return None


def user_cause(exc: BaseException) -> UserError | None:
    """A UserError raised inside Ray arrives wrapped (a Ray task error, a Train worker
    group error, a Tune trial error, Ray Data's retry note): find the innermost one.

    >>> try:
    ...     try:
    ...         raise DataError("part.parquet: row group 0 has NaN or infinite features")
    ...     except DataError as inner:
    ...         raise RuntimeError("worker failed") from inner
    ... except RuntimeError as outer:
    ...     print(user_cause(outer))
    part.parquet: row group 0 has NaN or infinite features
    """
    found = [(depth, e) for depth, e in _walk(exc) if isinstance(e, UserError)]
    return _deepest(found) if found else _from_text(exc)


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception in `exc`'s chain: what went wrong, under Ray's wrappers
    (the first failing worker by rank when several failed)."""
    return _deepest(_walk(exc))


_E = TypeVar("_E", bound=BaseException)


def _deepest(found: list[tuple[int, _E]]) -> _E:
    """The first of the deepest exceptions in `_walk`'s (depth, exception) order."""
    deepest = max(depth for depth, _ in found)
    return next(e for depth, e in found if depth == deepest)


def _message_line(exc: BaseException) -> str:
    """One line of an exception's own message. Ray appends notes after it (Ray Data's
    retry advice); a traceback text (a Ray task error whose cause was lost) ends
    with the line that names the error."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    if lines[0].startswith("Traceback") or lines[0].startswith("ray::") or getattr(exc, "traceback_str", None):
        return lines[-1]
    return lines[0]


def describe_error(exc: BaseException) -> str:
    """The error a person needs, in one line: our own error's message, else the root
    cause's type and message.

    >>> try:
    ...     try:
    ...         raise ValueError("boom\\nmore detail")
    ...     except ValueError as inner:
    ...         raise RuntimeError("Training failed due to worker errors") from inner
    ... except RuntimeError as outer:
    ...     print(describe_error(outer))
    ValueError: boom
    """
    ours = user_cause(exc)
    if ours is not None:
        return _message_line(ours)
    root = root_cause(exc)
    line = _message_line(root)
    if getattr(root, "traceback_str", None) or line.startswith(f"{type(root).__name__}:"):
        return line
    return f"{type(root).__name__}: {line}" if line else type(root).__name__


def first_line(exc: BaseException) -> str:
    """One line of `exc`: our own error's message, or the root cause's (see `describe_error`)."""
    ours = user_cause(exc)
    return _message_line(ours if ours is not None else root_cause(exc))
