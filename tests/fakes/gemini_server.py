"""A local server speaking the Gemini API's ``streamGenerateContent?alt=sse`` wire format.

Builders return the chunks a real server sends: ``GenerateContentResponse`` objects with one
candidate whose ``content.parts`` hold text, thought (``thought: true``) and whole
``functionCall`` parts, ``thoughtSignature`` on any part, ``finishReason`` on the last chunk and
cumulative ``usageMetadata``. Errors carry Google's body shape
``{"error": {"code", "message", "status", "details"}}``. The fake also records the request path
and query string, so that tests can check where the key travels.
"""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.fakes.http_server import JSONReply, ScriptedEndpoint, ServerThread, SSEReply, sse_frame

MODEL = "gemini-2.5-flash"


def usage(prompt: int = 20, output: int = 10, cached: int = 0, thoughts: int = 0) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "promptTokenCount": prompt,
        "candidatesTokenCount": output,
        "totalTokenCount": prompt + output + thoughts,
    }
    if cached:
        meta["cachedContentTokenCount"] = cached
    if thoughts:
        meta["thoughtsTokenCount"] = thoughts
    return meta


def chunk(*parts: dict[str, Any], finish: str | None = None, usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": list(parts)}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    body: dict[str, Any] = {"candidates": [candidate], "modelVersion": MODEL, "responseId": "resp-fake"}
    if usage_ is not None:
        body["usageMetadata"] = usage_
    return body


def text(t: str, **kw: Any) -> dict[str, Any]:
    return {"text": t, **kw}


def thought(t: str, signature: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"text": t, "thought": True}
    if signature:
        part["thoughtSignature"] = signature
    return part


def call(name: str, args: dict[str, Any], id: str | None = None, signature: str | None = None) -> dict[str, Any]:
    fc: dict[str, Any] = {"name": name, "args": args}
    if id is not None:
        fc["id"] = id
    part: dict[str, Any] = {"functionCall": fc}
    if signature:
        part["thoughtSignature"] = signature
    return part


def stream(*chunks: dict[str, Any] | str, **kw: Any) -> SSEReply:
    """Unnamed ``data:`` frames; a plain string is sent verbatim as the data."""
    return SSEReply(frames=[sse_frame(c) for c in chunks], **kw)


def text_reply(t: str, pieces: int = 1, prompt: int = 20, output: int = 10, **kw: int) -> SSEReply:
    step = max(1, -(-len(t) // pieces))
    bits = [t[i : i + step] for i in range(0, len(t), step)] or [""]
    chunks = [chunk(text(b), usage_=usage(prompt, 0)) for b in bits[:-1]]
    chunks.append(chunk(text(bits[-1]), finish="STOP", usage_=usage(prompt, output, **kw)))
    return stream(*chunks)


def tool_reply(*calls: dict[str, Any], lead: str = "") -> SSEReply:
    """Function calls arrive whole, in one chunk, with finishReason STOP (Gemini has no tool stop)."""
    chunks: list[dict[str, Any]] = []
    if lead:
        chunks.append(chunk(text(lead), usage_=usage(30, 0)))
    chunks.append(chunk(*calls, finish="STOP", usage_=usage(30, 12)))
    return stream(*chunks)


def error_body(code: int, status: str, message: str, details: list[Any] | None = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message, "status": status}
    if details is not None:
        err["details"] = details
    return {"error": err}


def error(code: int, status: str, message: str, details: list[Any] | None = None, **headers: str) -> JSONReply:
    return JSONReply(
        status=code,
        body=error_body(code, status, message, details),
        headers={k.replace("_", "-"): v for k, v in headers.items()},
    )


class GeminiFake(ScriptedEndpoint):
    """``POST /v1beta/models/{model}:streamGenerateContent``; ``base_url`` is the server root."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []
        self.queries: list[str] = []
        self.app = Starlette(routes=[Route("/v1beta/models/{target}", self._handle, methods=["POST"])])
        self.server = ServerThread(self.app)

    def reset(self) -> None:
        super().reset()
        self.paths.clear()
        self.queries.clear()

    async def _handle(self, request: Request) -> Response:
        self.paths.append(request.url.path)
        self.queries.append(request.url.query)
        return await self.handle(request)

    @property
    def base_url(self) -> str:
        return self.server.url

    def __enter__(self) -> GeminiFake:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
