"""Errors the server shows to clients, and the one place that makes their text safe to show.

Clients display these messages to people, so nothing that reaches them may carry a stack trace,
a path on the server or a credential. Provider error texts are the risky ones (they can quote a
request URL, a key prefix or a local file), so they pass through ``safe_message`` first.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import JSONResponse


class ApiError(Exception):
    """A failure answered before any stream opens: an HTTP status with ``{code, message}``."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        retry_after: int | None = None,
        about_run: bool = False,
        current_run_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after  # seconds, for a refusal that passes (429)
        # ``about_run``: a send refused for the process's run (``run_not_current``, a reject's
        # ``busy``), answered with the run it has (``current_run_id``, None when idle), so that the
        # caller decides again on what was true at the refusal, not on a later read that may race
        self.about_run = about_run
        self.current_run_id = current_run_id

    def body(self) -> dict[str, Any]:
        """``{code, message}``, with ``current_run_id`` (null when idle) for a refusal about the run."""
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.about_run:
            body["current_run_id"] = self.current_run_id
        return body

    def response(self) -> JSONResponse:
        if self.about_run:  # (never a 401: no WWW-Authenticate to add)
            response = JSONResponse(self.body(), status_code=self.status)
        else:
            response = error_response(self.status, self.code, self.message)
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(self.retry_after)
        return response


def error_response(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"code": code, "message": message}, status_code=status, headers=headers)


_SECRETS = re.compile(
    r"(?i)\bbearer\s+\S+"  # an Authorization header value
    r"|\b(?:sk|pk|rk|key|api|tok)[-_][A-Za-z0-9_\-]{6,}"  # vendor key prefixes (sk-..., sk-ant-...)
    r"|\b(?:api[_-]?key|token|secret|password|authorization)\s*[=:]\s*\S+"
    r"|[A-Za-z0-9_\-+/]{32,}={0,2}"  # long opaque strings: keys, signed URLs, base64 blobs
)
_PATHS = re.compile(r"(?:[A-Za-z]:\\|~?/)(?:[\w.\-]+[/\\])+[\w.\-]*")
_URLS = re.compile(r"\bhttps?://\S+")
_MAX_LEN = 200


def safe_message(text: str | None, fallback: str) -> str:
    """The first line of ``text`` with credentials, URLs and file paths removed, or ``fallback``.

    Only the first line is kept because stack traces and provider dumps follow it; the length is
    capped because a client shows the message as a status line, not a report.
    """
    if not text:
        return fallback
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    if line.lower().startswith("traceback"):
        return fallback
    line = _URLS.sub("[url]", line)
    line = _SECRETS.sub("[redacted]", line)
    line = _PATHS.sub("[path]", line)
    if len(line) > _MAX_LEN:
        line = line[: _MAX_LEN - 1].rstrip() + "…"
    return line or fallback
