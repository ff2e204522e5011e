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
from agentloop.cli.serve import BackgroundServer, ServeOptions
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.models.registry import register_provider


def _script(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return "tool said: " + last.text
    text = last.text if isinstance(last, UserMessage) else ""
    return Reply(tool_calls=[call("Shell", command=text)])


def test_engine_chat_cannot_read_the_kernels_data(tmp_path: Path) -> None:
    register_provider("protectedprobe", lambda _id: ScriptedModel(_script))
    data, ws = tmp_path / "data", tmp_path / "ws"
    data.mkdir()
    ws.mkdir()
    settings = Settings(model="protectedprobe:x", model_source="test")
    opts = ServeOptions(
        "127.0.0.1", 0, data.resolve(), ws.resolve(), settings, parse_approval("ask"), out=io.StringIO()
    )
    server = BackgroundServer(opts, start_timeout=60)
    running = server.start()
    try:
        accounts = running.ctx.accounts
        server.call(accounts.create_account("alice"))
        token, _ = server.call(accounts.create_token("alice"))
        command = f"cat {data.resolve()}/agentloop.db"
        body = {"messages": [{"role": "user", "content": command}], "metadata": {"correlation_id": "c1"}}
        with httpx.Client(base_url=running.url, timeout=30) as client:
            reply = client.post("/engine/chat", json=body, headers={"Authorization": f"Bearer {token}"})
        assert reply.status_code == 200
        assert "agentloop's own data is off limits to tools" in reply.text
        assert "SQLite format" not in reply.text
    finally:
        server.stop()
