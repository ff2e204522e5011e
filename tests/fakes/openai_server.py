"""A local server speaking OpenAI's Chat Completions wire format (streaming), scripted per test.

Builders return the chunks a real server sends: a role chunk, content / reasoning / tool call
deltas, a chunk with ``finish_reason``, then the usage chunk (empty ``choices``) and ``[DONE]``.
Errors carry OpenAI's body shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.routing import Route

from tests.fakes.http_server import JSONReply, ScriptedEndpoint, ServerThread, SSEReply, sse_frame

MODEL = "gpt-4o-mini"


def chunk(delta: dict[str, Any] | None = None, finish_reason: str | None = None, index: int = 0) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{"index": index, "delta": delta or {}, "finish_reason": finish_reason, "logprobs": None}],
    }


def usage_chunk(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def tool_delta(index: int, *, id: str | None = None, name: str | None = None, args: str = "") -> dict[str, Any]:
    """A ``delta.tool_calls`` fragment: ``id`` and ``name`` only on a call's first fragment."""
    fn: dict[str, Any] = {"arguments": args}
    if name is not None:
        fn["name"] = name
    call: dict[str, Any] = {"index": index, "function": fn}
    if id is not None:
        call["id"] = id
        call["type"] = "function"
    return {"tool_calls": [call]}


def stream(*chunks: dict[str, Any] | str, done: bool = True, **kw: Any) -> SSEReply:
    """An SSE reply from chunk dicts (or raw strings sent as ``data:`` verbatim)."""
    frames = [sse_frame(c) for c in chunks]
    if done:
        frames.append(sse_frame("[DONE]"))
    return SSEReply(frames=frames, **kw)


def text_reply(
    text: str, pieces: int = 1, prompt: int = 12, completion: int = 5, cached: int = 0, finish: str = "stop"
) -> SSEReply:
    """``text`` split into ``pieces`` content deltas, then finish and usage."""
    step = max(1, -(-len(text) // pieces))
    parts = [text[i : i + step] for i in range(0, len(text), step)]
    return stream(
        chunk({"role": "assistant", "content": ""}),
        *[chunk({"content": p}) for p in parts],
        chunk(finish_reason=finish),
        usage_chunk(prompt, completion, cached),
    )


def tool_reply(name: str, args: str, id: str = "call_1", text: str = "", split: int = 3) -> SSEReply:
    """One tool call whose JSON arguments arrive in ``split`` fragments, optional text first."""
    step = max(1, -(-len(args) // split))
    frags = [args[i : i + step] for i in range(0, len(args), step)]
    chunks: list[dict[str, Any]] = [chunk({"role": "assistant", "content": None})]
    if text:
        chunks.append(chunk({"content": text}))
    chunks.append(chunk(tool_delta(0, id=id, name=name, args="")))
    chunks.extend(chunk(tool_delta(0, args=f)) for f in frags)
    chunks.append(chunk(finish_reason="tool_calls"))
    chunks.append(usage_chunk(20, 10))
    return stream(*chunks)


def error(
    status: int, message: str, type: str = "invalid_request_error", code: str | None = None, **headers: str
) -> JSONReply:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return JSONReply(status=status, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()})


class OpenAIFake(ScriptedEndpoint):
    """``POST /v1/chat/completions``; ``base_url`` is what the SDK wants (it ends in ``/v1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.handle, methods=["POST"])])
        self.server = ServerThread(self.app)

    @property
    def base_url(self) -> str:
        return self.server.url + "/v1"

    def __enter__(self) -> OpenAIFake:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


@contextmanager
def openai_fake() -> Iterator[OpenAIFake]:
    with OpenAIFake() as fake:
        yield fake
