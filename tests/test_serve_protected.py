"""``agentloop serve``: what tools may not touch (the kernel's data: its database with every
account's conversations, the archives, the policies) holds for ``/engine/chat`` too, whose agent
runs outside any process (a review found it read another account's conversation from the
database with one Shell call)."""

from __future__ import annotations

import io
from pathlib import Path

import httpx

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.cli.approvals import parse_approval
from agentloop.cli.config import Settings
from agentloop.cli.serve import ServeOptions
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.models.registry import register_provider
from tests.server_support import serving


def _script(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return "tool said: " + last.text
    text = last.text if isinstance(last, UserMessage) else ""
    if text.startswith("search: "):
        return Reply(tool_calls=[call("Search", pattern=text.removeprefix("search: "))])
    return Reply(tool_calls=[call("Shell", command=text)])


def test_engine_chat_cannot_read_the_kernels_data(tmp_path: Path) -> None:
    register_provider("protectedprobe", lambda _id: ScriptedModel(_script))
    ws = tmp_path / "ws"
    data = ws / "data"  # inside the workspace: Search must walk around it
    (data / "var" / "media" / "bob").mkdir(parents=True)
    (data / "var" / "media" / "bob" / "doc.txt").write_text("bob's SECRET-42\n")
    (ws / "plan.txt").write_text("no SECRET here\n")
    settings = Settings(model="protectedprobe:x", model_source="test")
    opts = ServeOptions(
        "127.0.0.1", 0, data.resolve(), ws.resolve(), settings, parse_approval("ask"), out=io.StringIO()
    )
    with serving(opts) as (url, headers):

        def ask(content: str) -> str:
            body = {"messages": [{"role": "user", "content": content}], "metadata": {"correlation_id": "c1"}}
            with httpx.Client(base_url=url, timeout=30) as client:
                reply = client.post("/engine/chat", json=body, headers=headers)
            assert reply.status_code == 200
            return reply.text

        shown = ask(f"cat {data.resolve()}/agentloop.db")
        assert "agentloop's own data is off limits to tools" in shown and "SQLite format" not in shown
        found = ask("search: SECRET")
        assert "plan.txt:1: no SECRET here" in found and "SECRET-42" not in found
