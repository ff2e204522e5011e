"""Every HTTP failure of the server as JSON ``{code, message}``, and one JSON log line per problem.

Clients of ``/v1`` parse errors, so nothing may answer with Starlette's plain-text 404/405 or its
HTML 500 page. Unknown routes and wrong methods come from the router as ``HTTPException``; an
unexpected exception is logged here with its traceback *inside* the JSON record (one line per
record for log shippers) and answered with a bare 500 ``internal``: its text could name a path
or a credential, so it never reaches the client.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ExceptionHandler

from agentloop.server.errors import ApiError, error_response

logger = logging.getLogger("agentloop.server")

# The code a status answers with when the failure did not choose one (router errors).
STATUS_CODES: Mapping[int, str] = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    500: "internal",
    503: "unavailable",
}


def log_json(level: int, message: str, *, exc: BaseException | None = None, **fields: Any) -> None:
    """One JSON line. Headers are never passed in, so a bearer token cannot reach a log."""
    if not logger.isEnabledFor(level):
        return
    payload: dict[str, Any] = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "level": logging.getLevelName(level).lower(),
        "component": "api",
        "message": message,
        **fields,
    }
    if exc is not None:  # the traceback inside the JSON, so the record stays one line
        payload["exception"] = "".join(traceback.format_exception(exc))
    logger.log(level, json.dumps(payload, default=str))


def internal_error(request: Request, exc: BaseException) -> Response:
    """Log ``exc`` with its traceback and answer a detail-free 500."""
    log_json(
        logging.ERROR,
        "request failed",
        exc=exc,
        method=request.method,
        path=request.url.path,
        error_type=type(exc).__name__,
    )
    return error_response(500, "internal", "the server failed to answer this request")


def field_name(loc: tuple[int | str, ...], root: str = "body") -> str:
    """A pydantic error location as the client wrote it: ``media[0].mime_type``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or root


def invalid(field: str, problem: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{field}: {problem}")


def validation_error(exc: ValidationError, root: str = "body") -> ApiError:
    """The first problem of a failed validation, naming its field (``text: field required``)."""
    err = exc.errors(include_url=False, include_context=False, include_input=False)[0]
    if err["type"] == "json_invalid":
        # (pydantic's parser stops at a nesting depth: valid JSON, but say why it was refused)
        deep = "recursion limit" in str(err.get("msg", ""))
        return invalid(root, "nested too deeply" if deep else "not valid JSON")
    if not err["loc"] and err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return invalid(root, "must be a JSON object")
    problem = err["msg"]
    if err["type"] == "extra_forbidden":
        problem = "unknown field"
    return invalid(field_name(err["loc"], root), problem[:1].lower() + problem[1:])


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = STATUS_CODES.get(exc.status_code, "internal" if exc.status_code >= 500 else "invalid_request")
    if exc.status_code == 404:
        message = f"no route {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = exc.detail if isinstance(exc.detail, str) else code
    response = error_response(exc.status_code, code, message)
    for name, value in (exc.headers or {}).items():  # e.g. Allow on a 405
        response.headers[name] = value
    return response


async def _unexpected(request: Request, exc: Exception) -> Response:
    return internal_error(request, exc)


def exception_handlers() -> dict[Any, ExceptionHandler]:
    """For ``Starlette(exception_handlers=...)``: the router's 404/405 as JSON, and a last resort for
    anything else (Starlette still re-raises that one to the server after answering). HTTP only:
    the router closes an unknown WebSocket itself, and errors inside a socket are its own business."""
    return {HTTPException: _http_exception, Exception: _unexpected}
