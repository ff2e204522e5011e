"""A local server speaking Anthropic's Messages wire format (streaming), scripted per test.

Builders return the named SSE events a real server sends: ``message_start`` (with input usage),
``content_block_start / _delta / _stop`` per block, ``message_delta`` (stop reason, output usage),
``message_stop``; ``ping`` frames and mid-stream ``error`` events too. Error answers carry
Anthropic's body shape ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.routing import Route

from tests.fakes.http_server import JSONReply, ScriptedEndpoint, ServerThread, SSEReply, sse_frame

MODEL = "claude-sonnet-4-5"

Event = tuple[str, dict[str, Any]]


def ev(name: str, **data: Any) -> Event:
    return (name, {"type": name, **data})


def message_start(input: int = 20, cache_read: int = 0, cache_write: int = 0, output: int = 1) -> Event:
    usage = {
        "input_tokens": input,
        "output_tokens": output,
        "cache_read_input_tokens": cache_read,
        "cache_creation_input_tokens": cache_write,
    }
    message: dict[str, Any] = {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return ev("message_start", message=message)


def text_block(index: int, text: str, pieces: int = 1) -> list[Event]:
    step = max(1, -(-len(text) // pieces))
    deltas = [
        ev("content_block_delta", index=index, delta={"type": "text_delta", "text": text[i : i + step]})
        for i in range(0, len(text), step)
    ]
    start = ev("content_block_start", index=index, content_block={"type": "text", "text": ""})
    return [start, *deltas, ev("content_block_stop", index=index)]


def thinking_block(index: int, thinking: str, signature: str) -> list[Event]:
    half = len(thinking) // 2
    return [
        ev("content_block_start", index=index, content_block={"type": "thinking", "thinking": "", "signature": ""}),
        ev("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": thinking[:half]}),
        ev("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": thinking[half:]}),
        ev("content_block_delta", index=index, delta={"type": "signature_delta", "signature": signature}),
        ev("content_block_stop", index=index),
    ]


def tool_start(index: int, id: str, name: str) -> Event:
    return ev(
        "content_block_start", index=index, content_block={"type": "tool_use", "id": id, "name": name, "input": {}}
    )


def json_delta(index: int, fragment: str) -> Event:
    return ev("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": fragment})


def tool_block(index: int, id: str, name: str, args: str, split: int = 3) -> list[Event]:
    step = max(1, -(-len(args) // split))
    frags = [json_delta(index, args[i : i + step]) for i in range(0, len(args), step)]
    return [tool_start(index, id, name), *frags, ev("content_block_stop", index=index)]


def message_end(stop_reason: str = "end_turn", output: int = 15) -> list[Event]:
    return [
        ev("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": None}, usage={"output_tokens": output}),
        ev("message_stop"),
    ]


def stream(*events: Event | str, **kw: Any) -> SSEReply:
    """Named SSE events; a plain string is sent as an unnamed ``data:`` frame verbatim."""
    frames = [sse_frame(e) if isinstance(e, str) else sse_frame(e[1], event=e[0]) for e in events]
    return SSEReply(frames=frames, **kw)


def text_reply(text: str, pieces: int = 1, input: int = 20, output: int = 15, **usage: int) -> SSEReply:
    return stream(
        message_start(input=input, **usage),
        ev("ping"),
        *text_block(0, text, pieces),
        *message_end("end_turn", output),
    )


def tool_reply(name: str, args: str, id: str = "toolu_01", text: str = "", split: int = 3) -> SSEReply:
    blocks: list[Event] = []
    if text:
        blocks.extend(text_block(0, text))
    blocks.extend(tool_block(len(blocks) and 1, id, name, args, split))
    return stream(message_start(), *blocks, *message_end("tool_use"))


def error_body(type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type, "message": message}}


def error(status: int, type: str, message: str, **headers: str) -> JSONReply:
    return JSONReply(
        status=status, body=error_body(type, message), headers={k.replace("_", "-"): v for k, v in headers.items()}
    )


class AnthropicFake(ScriptedEndpoint):
    """``POST /v1/messages``; ``base_url`` is the server root (the SDK adds ``/v1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.app = Starlette(routes=[Route("/v1/messages", self.handle, methods=["POST"])])
        self.server = ServerThread(self.app)

    @property
    def base_url(self) -> str:
        return self.server.url

    def __enter__(self) -> AnthropicFake:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
