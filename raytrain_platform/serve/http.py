"""HTTP plumbing of the ingress: a request body size limit, and every error as a 4xx
(or 5xx) in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with
a one-line message that names the problem (so the ``openai`` client raises its typed
errors: BadRequestError, NotFoundError, ...). Malformed JSON is 400, a body that fails
the schema 422 (400 on the OpenAI endpoints, as OpenAI answers), with the field as
``param``; a body over the limit 413; on a server with API keys, a ``/v1/`` request
without one of them 401 (`ApiKeyCheck`); nothing a client sends reaches the replica as
an exception.
"""

from __future__ import annotations

import re

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raytrain_platform.errors import UserError, describe_error, first_line
from raytrain_platform.serve.auth import PROTECTED_PREFIX, is_authorized
from raytrain_platform.serve.schemas import ErrorResponse

__all__ = ["make_api", "ERROR_RESPONSES", "error", "error_body", "APIError", "ApiKeyCheck", "OPENAI_PATHS"]

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in (
        (400, "malformed JSON, or a model of the other kind"),
        (401, "no API key, or not one the server accepts (servers started with API keys)"), (404, "unknown model id"),
        (413, "body over max_body_bytes"), (422, "a field is missing, of the wrong type, "
                                                 "non-finite, or over a limit"))}


# Paths that answer schema errors with 400, as OpenAI's API does.
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
          422: "invalid_request_error", 503: "service_unavailable"}


class APIError(HTTPException):
    """An HTTP error with OpenAI's ``param`` (the field at fault) and ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(status_code=status, detail=message)
        self.param, self.code = param, code


def error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> HTTPException:
    return APIError(status, message, param=param, code=code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {...}}`` in OpenAI's shape (also sent as a stream's last event)."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class BodySizeLimit:
    """Refuses bodies over ``app.state.max_body_bytes``: up front by Content-Length, and
    while reading for bodies sent without one (chunked)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = scope["app"].state.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            response = _error_response(413, f"body of {length.decode(errors='replace')} bytes: "
                                            f"at most {limit} (max_body_bytes)")
            return await response(scope, receive, send)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # FastAPI passes HTTPExceptions from the body read through
                raise error(413, f"body over {limit} bytes (max_body_bytes)")
            return message

        await self.app(scope, limited_receive, send)


class ApiKeyCheck:
    """With ``app.state.api_key_digests`` set (serve/auth.py), every route under
    ``/v1/`` needs ``Authorization: Bearer KEY``: a 401 in OpenAI's shape before the body
    is read. The messages never repeat what was sent."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key_digests = getattr(scope["app"].state, "api_key_digests", ()) if scope["type"] == "http" else ()
        if not key_digests or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization")
        if is_authorized(header.decode("latin-1") if header is not None else None, key_digests):
            return await self.app(scope, receive, send)
        message = ("invalid API key: the key sent is not one this server accepts" if header else
                   "no API key: send the header 'Authorization: Bearer KEY' (this server requires one)")
        response = _error_response(401, message, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _error_response(status: int, message: str, *, param: str | None = None,
                    code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status)


# A union member's tag in an error location (``str``, ``list[str]``, ``list[_TextPart]``):
# pydantic's name for the branch tried, not a field of the request.
_UNION_TAG = re.compile(r"^[\w-]+\[.*\]$|^(str|int|float|bool|bytes|none|dict|list)$")


def _fields(loc: tuple) -> tuple:
    """An error location as the request's own fields (no ``body``, no union tags)."""
    return tuple(p for p in loc if p != "body" and not (isinstance(p, str) and _UNION_TAG.match(p)))


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str | None]:
    """(status, one-line message, the field at fault). A field of several allowed types
    (``prompt``: a string or a list of strings) fails once per type: the message names
    the deepest field that failed (``stop.1``, not ``stop.str``), and where the types
    failed at the field itself, what each would have needed."""
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        return 400, f"malformed JSON body: {reason}", None
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return 422, "missing JSON body", None
    located = [(_fields(e.get("loc", ())), e) for e in errors]
    same = [(loc, e) for loc, e in located if loc[:1] == located[0][0][:1]]  # the one field's union branches
    at = max((loc for loc, _ in same), key=len)  # the first of the deepest
    chosen = [e for loc, e in same if loc == at]
    value = chosen[0].get("input")
    missing = chosen[0].get("type") == "missing"
    shown = "" if missing or isinstance(value, (dict, list)) else f" (got {value!r:.60})"
    message = ", or ".join(dict.fromkeys(str(e.get("msg")) for e in chosen))
    # other fields' errors, and this field's at other places as deep (a list's other items)
    rest = len(errors) - len(same) + sum(len(loc) == len(at) and loc != at for loc, _ in same)
    more = f" (and {rest} more)" if rest else ""
    where = ".".join(map(str, at)) or "body"
    return 422, f"{where}: {message}{shown}{more}", where


def make_api(title: str, version: str) -> FastAPI:
    """A FastAPI app with the body limit and the one-line error handlers installed."""
    api = FastAPI(title=title, version=version)
    api.state.max_body_bytes = 1 << 20  # the deployment sets its own
    api.state.api_key_digests = ()  # none: open (the deployment sets its keys)
    api.add_middleware(BodySizeLimit)
    api.add_middleware(ApiKeyCheck)  # added last, runs first: no body is read for a refused request

    @api.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message, param = _validation_message(exc)
        if request.url.path in OPENAI_PATHS:
            status = 400
        return _error_response(status, message, param=param)

    @api.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = "body: not a JSON object in UTF-8 (could not be read as UTF-8 JSON)"
        if exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            message = f"{request.method} {request.url.path}: {message.lower()} (see /docs)"
        return _error_response(exc.status_code, message, param=getattr(exc, "param", None),
                               code=getattr(exc, "code", None))

    @api.exception_handler(UserError)
    async def _user(request: Request, exc: UserError) -> JSONResponse:
        return _error_response(503, f"model unavailable: {first_line(exc)}")

    @api.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(500, f"internal error: {describe_error(exc)}")  # its root cause, one line

    return api
