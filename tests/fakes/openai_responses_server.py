"""A local server speaking OpenAI's Responses API wire format (streaming), scripted per test.

``POST /v1/responses`` records each request body and answers with the next scripted reply:
an SSE stream whose frames carry ``event: <type>`` and the event's JSON (``sequence_number``
is filled in by ``stream``), or a JSON error body in OpenAI's shape. ``POST /v1/responses/compact``
does the same with its own queue (``compacts``), answered with a ``compaction_reply`` (the
compacted window) or an error.
Builders return the events a real server sends for a text answer, a function call and a
reasoning item, so a test only writes down what differs.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.applications import Starlette
from starlette.routing import Route

from tests.fakes.http_server import JSONReply, ScriptedEndpoint, ServerThread, SSEReply, sse_frame

MODEL = "gpt-4o-mini"


def response(status: str = "in_progress", **fields: Any) -> dict[str, Any]:
    """A ``response`` object as the lifecycle events carry it."""
    return {
        "id": "resp_fake",
        "object": "response",
        "created_at": 1_700_000_000,
        "model": MODEL,
        "status": status,
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        **fields,
    }


def usage(input: int = 12, output: int = 5, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input + output,
    }


def created() -> dict[str, Any]:
    return {"type": "response.created", "response": response()}


def completed(input: int = 12, output: int = 5, cached: int = 0) -> dict[str, Any]:
    return {"type": "response.completed", "response": response("completed", usage=usage(input, output, cached))}


def incomplete(reason: str = "max_output_tokens") -> dict[str, Any]:
    body = response("incomplete", incomplete_details={"reason": reason}, usage=usage())
    return {"type": "response.incomplete", "response": body}


def failed(code: str, message: str) -> dict[str, Any]:
    body = response("failed", error={"code": code, "message": message})
    return {"type": "response.failed", "response": body}


def message_events(text: str, index: int = 0, pieces: int = 1, item_id: str = "msg_1") -> list[dict[str, Any]]:
    """An assistant ``message`` output item whose text arrives in ``pieces`` deltas."""
    step = max(1, -(-len(text) // pieces))
    parts = [text[i : i + step] for i in range(0, len(text), step)]
    item = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}
    done_part = {"type": "output_text", "text": text, "annotations": []}
    where = {"item_id": item_id, "output_index": index, "content_index": 0}
    return [
        {"type": "response.output_item.added", "output_index": index, "item": item},
        {"type": "response.content_part.added", **where, "part": {**done_part, "text": ""}},
        *[{"type": "response.output_text.delta", **where, "delta": p, "logprobs": []} for p in parts],
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": done_part},
        {
            "type": "response.output_item.done",
            "output_index": index,
            "item": {**item, "status": "completed", "content": [done_part]},
        },
    ]


def call_added(index: int, call_id: str, name: str, item_id: str | None = None) -> dict[str, Any]:
    item = {
        "type": "function_call",
        "id": item_id or f"fc_{index}",
        "call_id": call_id,
        "name": name,
        "arguments": "",
        "status": "in_progress",
    }
    return {"type": "response.output_item.added", "output_index": index, "item": item}


def call_delta(index: int, delta: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "response.function_call_arguments.delta",
        "item_id": item_id or f"fc_{index}",
        "output_index": index,
        "delta": delta,
    }


def call_done(index: int, call_id: str, name: str, args: str, item_id: str | None = None) -> dict[str, Any]:
    item = {
        "type": "function_call",
        "id": item_id or f"fc_{index}",
        "call_id": call_id,
        "name": name,
        "arguments": args,
        "status": "completed",
    }
    return {"type": "response.output_item.done", "output_index": index, "item": item}


def call_events(index: int, call_id: str, name: str, args: str, split: int = 3) -> list[dict[str, Any]]:
    """A ``function_call`` output item whose JSON arguments arrive in ``split`` fragments."""
    step = max(1, -(-len(args) // split))
    frags = [args[i : i + step] for i in range(0, len(args), step)]
    return [
        call_added(index, call_id, name),
        *[call_delta(index, f) for f in frags],
        {"type": "response.function_call_arguments.done", "item_id": f"fc_{index}", "output_index": index,
         "arguments": args},
        call_done(index, call_id, name, args),
    ]  # fmt: skip


def reasoning_events(
    index: int, summaries: list[str], encrypted: str | None, item_id: str = "rs_1"
) -> list[dict[str, Any]]:
    """A ``reasoning`` output item: one summary part per entry of ``summaries``, each streamed as
    one delta, and the whole item (with its encrypted content) at its end."""
    item = {"type": "reasoning", "id": item_id, "summary": []}
    events: list[dict[str, Any]] = [{"type": "response.output_item.added", "output_index": index, "item": item}]
    for n, text in enumerate(summaries):
        where = {"item_id": item_id, "output_index": index, "summary_index": n}
        events += [
            {"type": "response.reasoning_summary_part.added", **where, "part": {"type": "summary_text", "text": ""}},
            {"type": "response.reasoning_summary_text.delta", **where, "delta": text},
            {"type": "response.reasoning_summary_text.done", **where, "text": text},
            {"type": "response.reasoning_summary_part.done", **where, "part": {"type": "summary_text", "text": text}},
        ]
    whole = {**item, "summary": [{"type": "summary_text", "text": t} for t in summaries]}
    if encrypted is not None:
        whole["encrypted_content"] = encrypted
    events.append({"type": "response.output_item.done", "output_index": index, "item": whole})
    return events


def stream(*events: dict[str, Any] | str, cut_after: int | None = None, delay: float = 0.0) -> SSEReply:
    """An SSE reply from event dicts (each framed under its own ``event:`` name, numbered in
    order) or raw strings sent as ``data:`` verbatim."""
    frames = []
    for n, event in enumerate(events):
        if isinstance(event, str):
            frames.append(sse_frame(event))
        else:
            frames.append(sse_frame(json.dumps({**event, "sequence_number": n}), event=event["type"]))
    return SSEReply(frames=frames, cut_after=cut_after, delay=delay)


def text_reply(text: str, pieces: int = 1, input: int = 12, output: int = 5, cached: int = 0) -> SSEReply:
    """A whole text answer: created, the message item, completed with usage."""
    return stream(created(), *message_events(text, pieces=pieces), completed(input, output, cached))


def tool_reply(name: str, args: str, call_id: str = "call_1", text: str = "") -> SSEReply:
    """One function call (after a message item with ``text``, if any), then completed."""
    events = [created()]
    if text:
        events += message_events(text)
    events += call_events(1 if text else 0, call_id, name, args)
    events.append(completed(20, 10))
    return stream(*events)


def error(
    status: int, message: str, type: str = "invalid_request_error", code: str | None = None, **headers: str
) -> JSONReply:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return JSONReply(status=status, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()})


def compaction_reply(
    encrypted: str = "enc-compacted", users: tuple[str, ...] = (), input: int = 300, output: int = 40
) -> JSONReply:
    """What ``/v1/responses/compact`` answers: the user messages ``users``, then one compaction item."""
    kept = [
        {"type": "message", "id": f"msg_u{n}", "role": "user", "status": "completed",
         "content": [{"type": "input_text", "text": text}]}
        for n, text in enumerate(users)
    ]  # fmt: skip
    body = {
        "id": "resp_compact",
        "object": "response.compaction",
        "created_at": 1_700_000_000,
        "output": [*kept, {"type": "compaction", "id": "cmp_1", "encrypted_content": encrypted}],
        "usage": usage(input, output),
    }
    return JSONReply(status=200, body=body)


class ResponsesFake(ScriptedEndpoint):
    """``POST /v1/responses`` and ``/v1/responses/compact`` (``compacts``, scripted and recorded
    apart); ``base_url`` is what the SDK wants (it ends in ``/v1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.compacts = ScriptedEndpoint()
        self.app = Starlette(
            routes=[
                Route("/v1/responses", self.handle, methods=["POST"]),
                Route("/v1/responses/compact", self.compacts.handle, methods=["POST"]),
            ]
        )
        self.server = ServerThread(self.app)

    @property
    def base_url(self) -> str:
        return self.server.url + "/v1"

    def reset(self) -> None:
        super().reset()
        self.compacts.reset()

    def __enter__(self) -> ResponsesFake:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
